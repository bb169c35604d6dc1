"""Minimal raw-ASGI helpers for the hot path (no framework response objects per request)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

# scope["state"] key of the server's ClientWriter for the request, where the server offers one
BODY_WRITER = "gateway.body_writer"
# what ClientWriter.write did: nothing (the client is gone), wrote, or wrote and filled the client's buffer
GONE, WRITTEN, FULL = 0, 1, 2


class ClientWriter(Protocol):
    """Writes body chunks of a response started with ``send`` straight to the client's connection, from any
    callback (no coroutine step per chunk); the response is still ended with ``send``. Offered by the
    gateway's own server protocol (``gateway.server_protocol.BodyWriter``)."""

    def write(self, body: bytes) -> int:
        """One chunk: GONE when the client is gone (nothing written); FULL when written and the client's buffer
        is now full (produce nothing more until ``when_writable`` calls back); else WRITTEN."""
        ...

    async def start(self, send: Send, message: Message, first: bytes) -> None:
        """Start the response with ``send`` (``message``: its ``http.response.start``) and write its head and the
        first chunk ``first`` to the connection together."""
        ...

    async def send_whole(self, send: Send, start: Message, body: bytes) -> None:
        """Send a whole response with ``send`` (``start``, then ``body`` as its last body message), written to the
        connection in one write."""
        ...

    def when_writable(self, callback: Callable[[], None]) -> None: ...

    def when_disconnected(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the client's connection is lost (at once if it is already); None: no longer."""
        ...


JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"


async def send_body(send: Send, status: int, body: bytes, headers: Headers, content_type: bytes = JSON,
                    writer: ClientWriter | None = None) -> None:
    """A whole response with a content-length; with the client's ``writer``, its head and body in one write."""
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", content_type),
            (b"content-length", str(len(body)).encode()),
            *headers,
        ],
    }
    if writer is not None:
        await writer.send_whole(send, start, body)
        return
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})


def header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None
