"""A raw asyncio HTTP/1.1 backend whose answer to each POST is a script the test sets, for faults that no
engine emulator produces on purpose: bytes that are not HTTP, an error body echoing the credentials it was
sent, an auth refusal, a stream of nothing but comment pings, a stream that never sends its usage.

``GET`` answers the model list (so discovery and the health probe pass), or, for a path in ``get_answers``,
the status and body set there (an engine's ``/metrics`` or ``/health`` turning hostile), after the seconds
``get_delays`` sets for it; ``gets`` counts the GETs of each path. ``seen_headers`` and ``seen_body`` keep the
headers and body of the last POST.
:func:`gateway_over` puts a gateway in front of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable
from typing import Any

import orjson

from gateway.app import GatewayApp, create_app
from gateway.config import settings_from_mapping
from tests.conftest import serve_in_thread


def _chunk(text: str) -> bytes:
    doc = {"id": "s", "object": "chat.completion.chunk", "created": 0, "model": "m",
           "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class ScriptedUpstream:
    """Modes: ``stream`` (``tokens`` chunks ``every`` s apart, then usage and [DONE]; with ``hold_usage``, the
    tokens and then nothing until the client leaves), ``stream_no_usage`` (the same without the usage chunk),
    ``stream_at_once`` (the same stream, chunked, in one write with its head: the whole answer in one read),
    ``complete`` (a non-streamed answer of ``tokens`` words), ``not_http`` (bytes that are not an HTTP response),
    ``echo_500``
    (HTTP 500 whose message repeats the Authorization header it got and the backend's own address), ``echo_token_500``
    (the same with only the header's credentials, its scheme left off),
    ``status_401``, ``pings`` (200 SSE, then ``: ping`` every ``every`` s until the client leaves), ``huge_error``
    (a 400 whose JSON body is ``size`` bytes) and ``huge_answer`` (a non-streamed 200 of ``size`` bytes), each with
    a ``Content-Length`` or, with ``chunked``, without; ``sent`` counts the body bytes the gateway took of it;
    ``script`` (the answer ``script`` returns for the request's headers: its status, content type and body pieces,
    each written on its own, ``every`` s apart, so that each is a read of its own)."""

    def __init__(self, mode: str = "stream", model: str = "m", tokens: int = 8, every: float = 0.01,
                 hold_usage: bool = False, size: int = 0, chunked: bool = False) -> None:
        self.mode, self.model, self.tokens, self.every = mode, model, tokens, every
        self.size, self.chunked = size, chunked
        self.sent = 0
        self.usage: dict[str, Any] | None = None  # what ``complete`` and ``stream`` report (None: the true counts)
        self.hold_usage = hold_usage  # the tokens sent, the rest held back until the client leaves
        self.port = 0
        self.posts = 0
        self.seen_headers: dict[str, str] = {}
        self.seen_body = b""  # the last POST's body
        self.written = 0  # the pieces of ``script`` answers written
        self.get_answers: dict[str, tuple[int, bytes]] = {}  # path -> (status, body), set from the test's thread
        self.get_delays: dict[str, float] = {}  # path -> seconds a GET of it waits before its answer
        # mode "script": the request's headers -> (status, content type, body pieces), set from the test's thread
        self.script: Callable[[dict[str, str]], tuple[int, str, list[bytes]]] | None = None
        self.gets: dict[str, int] = {}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ScriptedUpstream:
        self._thread.start()

        async def start() -> None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(5)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            assert self._server is not None
            self._server.close()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:  # connections still being answered (a stream mid-way, pings)
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if head.startswith(b"GET"):
                    path = head.split(b" ", 2)[1].decode()
                    self.gets[path] = self.gets.get(path, 0) + 1
                    if self.get_delays.get(path):  # real time: an engine slow to answer, as the test sets
                        await asyncio.sleep(self.get_delays[path])
                    status, answer = self.get_answers.get(path, (200, orjson.dumps(
                        {"object": "list", "data": [{"id": self.model, "object": "model"}]})))
                    writer.write(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                                 % (status, len(answer)) + answer)
                    await writer.drain()
                    continue
                self.posts += 1
                self.seen_body = body
                self.seen_headers = {
                    k.decode().lower(): v.decode()
                    for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
                }
                self.seen_headers = {k: v.strip() for k, v in self.seen_headers.items()}
                if not await self._answer(writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter) -> bool:
        """Write the scripted answer; False when the connection is done with."""
        mode = self.mode
        if mode == "not_http":
            writer.write(b"SSH-2.0-OpenSSH_9.2\r\nthis is no HTTP server\r\n\r\n")
            await writer.drain()
            return False
        if mode in ("echo_500", "echo_token_500", "status_401"):
            status = b"401 Unauthorized" if mode == "status_401" else b"500 Internal Server Error"
            credentials = self.seen_headers.get("authorization", "")
            if mode == "echo_token_500":
                credentials = credentials.rpartition(" ")[2]
            message = (f"rejected credentials '{credentials}' at {self.url}/v1/chat"
                       if mode != "status_401" else "invalid api key")
            body = orjson.dumps({"error": {"message": message, "type": "server_error"}})
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            await writer.drain()
            return True
        if mode == "script":
            assert self.script is not None
            status, content_type, pieces = self.script(self.seen_headers)
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % (status, content_type.encode(), sum(map(len, pieces))))
            for piece in pieces:
                await writer.drain()
                await asyncio.sleep(self.every)  # real time: the pieces ``every`` s apart, each a read of its own
                if writer.is_closing():
                    break  # (the gateway let go of the answer)
                writer.write(piece)
                self.written += 1
            await writer.drain()
            return False
        if mode in ("huge_error", "huge_answer"):
            await self._huge(writer)
            return False
        usage: dict[str, Any] = self.usage or {"prompt_tokens": 10, "completion_tokens": self.tokens,
                                               "total_tokens": 10 + self.tokens}
        if mode == "complete":
            body = orjson.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": self.model,
                                 "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                     "role": "assistant", "content": "".join(f"t{i} " for i in range(self.tokens))}}],
                                 "usage": usage})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                         % len(body) + body)
            await writer.drain()
            return True
        if mode == "stream_at_once":
            events = [_chunk(f"t{i} ") for i in range(self.tokens)]
            events.append(b"data: " + orjson.dumps({"id": "s", "object": "chat.completion.chunk", "created": 0,
                                                    "model": "m", "choices": [], "usage": usage}) + b"\n\n")
            events.append(b"data: [DONE]\n\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        if mode == "pings":
            while True:
                await asyncio.sleep(self.every)  # real time: a ping every ``every`` s, against the gateway's timeouts
                writer.write(b": ping\n\n")
                await writer.drain()
        for i in range(self.tokens):
            writer.write(_chunk(f"t{i} "))
            await writer.drain()
            await asyncio.sleep(self.every)  # real time: the stream's pace, a token every ``every`` s
        if self.hold_usage:
            await asyncio.Future()  # (until the client leaves: the connection's task is cancelled at exit)
        if mode == "stream":
            writer.write(b"data: " + orjson.dumps({"id": "s", "object": "chat.completion.chunk", "created": 0,
                                                   "model": "m", "choices": [], "usage": usage}) + b"\n\n")
        writer.write(b"data: [DONE]\n\n")
        await writer.drain()
        return False

    async def _huge(self, writer: asyncio.StreamWriter) -> None:
        """A body of ``size`` bytes, written a MiB at a time as the gateway takes it."""
        if self.mode == "huge_error":
            status, head, tail = b"400 Bad Request", b'{"error": {"message": "', b'"}}'
        else:
            status = b"200 OK"
            head = b'{"id": "c", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "'
            tail = b'"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
        framing = b"Transfer-Encoding: chunked" if self.chunked else b"Content-Length: %d" % self.size
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + framing + b"\r\n\r\n")
        body = head + b"E" * (self.size - len(head) - len(tail)) + tail
        for at in range(0, len(body), 1 << 20):
            piece = body[at:at + (1 << 20)]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if self.chunked else piece)
            await writer.drain()
            self.sent += len(piece)
        if self.chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()


def gateway_over(upstream: ScriptedUpstream, **extra: Any) -> tuple[GatewayApp, Any]:
    """A gateway app whose one backend is ``upstream`` (``backend``: more of its settings; the rest: gateway
    settings), and its server, to start with ``with``."""
    backend = {"name": "scripted", "engine": "openai", "url": upstream.url, **extra.pop("backend", {})}
    settings = settings_from_mapping({"backends": [backend], "scrape": {"interval": 0.1, "timeout": 1.0}, **extra})
    app = create_app(settings)
    return app, serve_in_thread(app)
