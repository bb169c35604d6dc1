"""Misbehaving peers for the fault scenarios: a backend answering garbage, a client reading slowly, a client
sending a huge header, and a crowd of idle connections."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.bench.faults.harness import (
    _bound_socket,
)

# -- a backend answering garbage -----------------------------------------------------------------------------
_EVENT = b'data: {"id":"g","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,' \
         b'"delta":{"content":"hi"},"finish_reason":null}]}\n\n'

# mode -> (framing, body, ending): framing "close" (body until EOF), "chunked"; ending "eof" (clean close
# after a complete body), "abort" (connection dropped: a chunked body never terminated)
GARBAGE: dict[str, tuple[str, bytes, str]] = {
    "binary_noise": ("close", b"\x00\xff\xfe not SSE {{{ \x01" * 64, "eof"),
    "noise_blocks": ("close", b"hello there\n\nretry-not-a-field\n\n", "eof"),
    "not_json_events": ("close", b"data: this is not json\n\ndata: [DONE]\n\n", "eof"),
    "json_cut_at_eof": ("close", _EVENT + b'data: {"id":"g","choices":[{"delta":{"content":"hel', "eof"),
    "json_cut_chunked_abort": ("chunked", _EVENT + b'data: {"id":"g","choices":[{"delta":{"cont', "abort"),
    "events_without_done": ("chunked", _EVENT * 3, "eof"),
    "empty_200": ("chunked", b"", "eof"),
    "html_200": ("close", b"<html><body>502 Bad Gateway</body></html>", "eof"),
}


class GarbageBackend:
    """A raw asyncio HTTP/1.1 server: ``GET`` answers the model list (so discovery and health pass); ``POST``
    answers ``200 text/event-stream`` with the body of ``mode`` (see :data:`GARBAGE`), framed and ended as
    that mode says. ``mode`` may change at any time; ``requests`` counts the POSTs."""

    def __init__(self, mode: str = "binary_noise", model: str = "m") -> None:
        self.mode = mode
        self.model = model
        self.requests = 0
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                if length:
                    await reader.readexactly(int(length.group(1)))
                if head.startswith(b"GET"):
                    models = orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]})
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(models), models))
                    await writer.drain()
                    continue
                self.requests += 1
                framing, body, ending = GARBAGE[self.mode]
                if framing == "close":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                                 + body)
                    await writer.drain()
                    break
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                if body:
                    writer.write(b"%x\r\n%s\r\n" % (len(body), body))
                if ending == "abort":
                    await writer.drain()
                    writer.transport.abort()
                    return
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class AsyncThread:
    """An event loop on a daemon thread, for servers the client's loop must not host."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fakes", daemon=True)

    def call(self, coro: Awaitable[Any], timeout: float = 10.0) -> Any:
        async def run() -> Any:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def __enter__(self) -> AsyncThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


# -- a slow client ------------------------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


class SlowReader:
    """A client that asks for a long stream and reads ``chunk`` bytes every ``every`` seconds, through a
    socket with a small receive buffer (so the kernel does not soak the stream up on its behalf)."""

    def __init__(self, host: str, port: int, body: dict[str, Any], chunk: int = 256, every: float = 0.1) -> None:
        self.host, self.port, self.body = host, port, body
        self.chunk, self.every = chunk, every
        self.read = 0
        self.status_line = b""

    async def run(self, seconds: float) -> None:
        import socket

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=self.chunk)
        payload = orjson.dumps(self.body)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (self.host.encode(), len(payload), payload))
        await writer.drain()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                data = await asyncio.wait_for(reader.read(self.chunk), timeout=max(0.01, end - time.monotonic()))
                if not data:
                    break
                if not self.status_line:
                    self.status_line = data.split(b"\r\n", 1)[0]
                self.read += len(data)
                await asyncio.sleep(self.every)
        except TimeoutError:
            pass
        finally:
            writer.transport.abort()


def free_ports(n: int) -> list[int]:
    socks = [_bound_socket() for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# -- clients attacking the front door -----------------------------------------------------------------------
@dataclass
class HugeHeaderResult:
    status: int | None
    body: bytes
    seconds_after_limit: float  # from the client having sent one byte past the limit to the first byte back
    bytes_sent: int  # before the gateway closed the connection under the sender


def send_huge_header(port: int, limit: int, size: int = 64 << 20, path: str = "/health",
                     timeout: float = 30.0) -> HugeHeaderResult:
    """``GET path`` with one header ``size`` bytes long, written 1 MiB at a time while a second thread reads
    the answer (blocking; run it on a thread of its own)."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    answer: list[tuple[float, bytes]] = []

    def read() -> None:
        chunks = []
        first = 0.0
        with contextlib.suppress(OSError):
            while data := sock.recv(65536):
                first = first or time.perf_counter()
                chunks.append(data)
        answer.append((first, b"".join(chunks)))

    reader = threading.Thread(target=read, name="huge-header-reader", daemon=True)
    reader.start()
    head = b"GET %s HTTP/1.1\r\nHost: gateway\r\nX-Big: " % path.encode()
    filler = _FILLER
    sent = 0
    crossed = 0.0
    try:
        sock.sendall(head + filler[: limit - len(head) + 1])
        crossed = time.perf_counter()
        sent = limit + 1
        while sent < size:
            sock.sendall(filler)
            sent += len(filler)
        sock.sendall(b"\r\n\r\n")
    except OSError:
        pass  # the gateway answered and closed: what a client still sending gets
    reader.join(timeout=timeout)
    sock.close()
    first, raw = answer[0] if answer else (0.0, b"")
    head_part, _, body = raw.partition(b"\r\n\r\n")
    status = int(head_part.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.") else None
    return HugeHeaderResult(status, body, first - crossed if first else float("inf"), sent)


_FILLER = b"a" * (1 << 20)


class IdleFlood:
    """``count`` connections opened to ``port`` and left silent (blocking; run it on a thread of its own).
    ``refused()`` counts those the gateway answered 503 and closed; ``closed()`` those it closed silently."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self.socks: list[Any] = []
        self.opened_in_s = 0.0
        self._answers: dict[int, bytes] = {}

    def open(self) -> None:
        import socket

        t0 = time.perf_counter()
        for _ in range(self.count):
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            sock.setblocking(False)
            self.socks.append(sock)
        self.opened_in_s = time.perf_counter() - t0

    def _poll(self) -> None:
        for i, sock in enumerate(self.socks):
            if i in self._answers:
                continue
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except ConnectionError:
                data = b""
            self._answers[i] = data  # enough to tell a 503 from a silent close

    def refused(self) -> int:
        self._poll()
        return sum(a.startswith(b"HTTP/1.1 503 ") for a in self._answers.values())

    def closed(self) -> int:
        self._poll()
        return sum(a == b"" for a in self._answers.values())

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()
