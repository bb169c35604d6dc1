"""A small HTTP/1.1 server on raw asyncio + httptools: cheap enough to stream thousands of tokens a second.

One :class:`Connection` (an ``asyncio.Protocol``) per socket parses requests with httptools and hands each to
the app as a :class:`Request` plus a :class:`Responder`. Streamed bodies use chunked transfer encoding and
are written straight to the transport; nothing is buffered per chunk beyond one ``bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, cast

import httptools

log = logging.getLogger("gateway.sim")


class Request:
    __slots__ = ("body", "headers", "method", "path", "query")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # lower-case names
        self.body = body


class Responder:
    """Writes one response. ``closed`` turns true when the client goes away; ``on_close`` callbacks run then."""

    __slots__ = ("_conn", "_keep_alive", "closed", "finished", "on_close", "started")

    def __init__(self, conn: Connection, keep_alive: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self.closed = False
        self.started = False
        self.finished = False
        self.on_close: list[Callable[[], None]] = []

    def _head(self, status: int, content_type: str, extra: str) -> bytes:
        reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Unknown"
        conn = "keep-alive" if self._keep_alive else "close"
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\nconnection: {conn}\r\n"
                f"{extra}\r\n").encode()

    def send(self, status: int, body: bytes, content_type: str = "application/json",
             headers: dict[str, str] | None = None) -> None:
        if self.closed or self.started:
            return
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.started = True
        self._conn.write(self._head(status, content_type, f"content-length: {len(body)}\r\n{extra}") + body)
        self._done()

    def start_stream(self, status: int = 200, content_type: str = "text/event-stream; charset=utf-8") -> None:
        if self.closed or self.started:
            return
        self.started = True
        self._conn.write(self._head(status, content_type, "transfer-encoding: chunked\r\ncache-control: no-cache\r\n"))

    def chunk(self, data: bytes) -> None:
        if not self.closed:
            self._conn.write(b"%x\r\n%b\r\n" % (len(data), data))

    def end_stream(self) -> None:
        if not self.closed and not self.finished:
            self._conn.write(b"0\r\n\r\n")
            self._done()

    def abort(self) -> None:
        """Drop the connection without finishing the response (a crash or a mid-stream drop)."""
        self._conn.abort()

    def _done(self) -> None:
        self.finished = True
        self._conn.response_done(self._keep_alive)


App = Callable[[Request, Responder], Awaitable[None]]


class Connection(asyncio.Protocol):
    def __init__(self, app: App, registry: set[Connection]) -> None:
        self._app = app
        self._registry = registry
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._current: Responder | None = None
        self._pending: list[tuple[Request, bool]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self._registry.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                import socket

                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort()
        except httptools.HttpParserError:
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._registry.discard(self)
        self._transport = None
        current = self._current
        if current is not None:
            current.closed = True
            for cb in current.on_close:
                try:
                    cb()
                except Exception:  # a callback must not break the others
                    log.exception("on_close callback failed")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parsed = httptools.parse_url(self._url)
        method = self._parser.get_method().decode()
        req = Request(method, parsed.path.decode(), (parsed.query or b"").decode(), self._headers,
                      b"".join(self._body))
        keep_alive = self._parser.should_keep_alive()
        self._pending.append((req, keep_alive))
        if self._current is None:
            self._next()

    # helpers
    def _next(self) -> None:
        if not self._pending or self._transport is None:
            return
        req, keep_alive = self._pending.pop(0)
        resp = Responder(self, keep_alive)
        self._current = resp
        task = asyncio.get_running_loop().create_task(self._serve(req, resp))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, req: Request, resp: Responder) -> None:
        try:
            await self._app(req, resp)
        except Exception:
            log.exception("emulator handler failed on %s %s", req.method, req.path)
            if not resp.started:
                resp.send(500, b'{"error":"internal emulator error"}')
            else:
                self.abort()

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def response_done(self, keep_alive: bool) -> None:
        self._current = None
        if not keep_alive:
            if self._transport is not None:
                self._transport.close()
            return
        if self._pending:
            asyncio.get_running_loop().call_soon(self._next)

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def json_body(req: Request) -> Any:
    import orjson

    return orjson.loads(req.body) if req.body else None
