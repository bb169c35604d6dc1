"""The data plane's upstream client: HTTP/1.1 on asyncio protocols, parsed by httptools (the C parser uvicorn
already runs on the client side), with a keep-alive pool per backend.

Why not aiohttp, which it replaces on the hot path: a profile of one gateway process at 64 streams spent ~9%
of its CPU inside ``ClientSession._request`` (cookies, redirects, tracing hooks, timeouts it does not need) and
paid, per streamed chunk, a ``StreamReader`` feed, a future and a task wake-up before the gateway saw the
bytes. Here a response's body is handed to a *sink*, synchronously, from ``data_received``: the gateway's
relay checks the events and writes them to the client's socket in the same callback, with no task switch per
chunk (:meth:`H1Response.stream_to`). A response can still be read whole (:meth:`H1Response.read`) or iterated
(:meth:`H1Response.chunks`), as :class:`~gateway.proxy.transport.Transport` requires. See the commit that
introduced it for the figures.

What it does: ``POST`` with a ``Content-Length`` body; responses with a length, chunked or close-delimited;
keep-alive per the response and the request's ``Connection`` header; a stale pooled connection (closed by the
backend while idle) is retried once on a fresh one, as aiohttp does; TCP_NODELAY (asyncio's default); TLS for
``https`` URLs. Bounds: the response head (``max_header_bytes``), a body read whole (the caller's limit, else
``max_body_bytes``), a body's beginning (``read_prefix``: the rest is never read), and, when nobody reads, the
buffered body (reading from the backend pauses at 1 MiB). What it does not: redirects,
cookies, proxies from the environment, compression (the gateway never asks for it), HTTP/2.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

from gateway.config import TimeoutSettings
from gateway.proxy.transport import BodySink, map_common
from gateway.proxy.upstream import ResponseTooLarge, UpstreamError

# buffered body bytes at which reading from the backend pauses when nothing consumes them yet
_HIGH_WATER = 1 << 20
# below the 5 s idle timeout of uvicorn (vLLM, SGLang, TabbyAPI) and llama.cpp's server, so the pool never reuses
# a connection the backend is closing
KEEPALIVE_SECONDS = 4.0
DNS_TTL_SECONDS = 10.0


MAX_INTERIM = 8  # interim (1xx) responses before an answer's own (a real engine sends one at most)


class _Stale(Exception):
    """A pooled connection closed before any byte of the response: the request never reached the backend."""


class _Target:
    __slots__ = ("host", "host_header", "key", "path", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        default = (self.tls and self.port == 443) or (not self.tls and self.port == 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if default else f"{host}:{self.port}").encode("idna")
        self.path = ((parts.path or "/") + (f"?{parts.query}" if parts.query else "")).encode()
        self.key = (parts.scheme, self.host, self.port)


class H1Response:
    """One response. Its body goes to a sink (``stream_to``), or is buffered for ``read``/``chunks``."""

    __slots__ = ("_buffered", "_conn", "_limit", "_pieces", "_prefix", "_sink", "_waiter", "_whole", "complete",
                 "error", "headers", "keep_alive", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        self._conn = conn
        self.status = status
        self.headers: Mapping[str, str] = _Headers(headers)
        self.keep_alive = keep_alive
        self.complete = False
        self.error: BaseException | None = None
        self._pieces: list[bytes] = []
        self._buffered = 0
        self._sink: BodySink | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False  # read() wants the whole body: never paused (its limit bounds it)
        self._limit = conn.owner.max_body_bytes  # buffered bytes past which the response fails
        self._prefix: int | None = None  # read_prefix()'s limit: past it, reading stops

    # -- from the connection ----------------------------------------------------------------------------
    def _data(self, chunk: bytes) -> None:
        sink = self._sink
        if sink is not None:
            try:
                sink.data(chunk)
            except Exception as exc:  # the sink refused the stream: end it with that error
                self._fail(exc)
                self._conn.close()
            return
        self._pieces.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > self._limit:
            self._pieces.clear()  # (held no longer than it takes to say so)
            self._fail(ResponseTooLarge(self._limit))
            self._conn.close()
            return
        if (self._buffered > _HIGH_WATER and not self._whole) or (
                self._prefix is not None and self._buffered > self._prefix):
            self._conn.pause_reading()
        self._wake()

    def _complete(self) -> None:
        if self.complete or self.error is not None:
            return
        self.complete = True
        sink = self._sink
        if sink is not None:
            sink.end(None)
        else:
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        sink = self._sink
        if sink is not None:
            sink.end(error)
        else:
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- for the caller ---------------------------------------------------------------------------------
    async def read(self, limit: int | None = None) -> bytes:
        # A whole-body read needs every byte, up to its limit: no pause from here on. (It was paused again
        # past 1 MiB and never resumed: a non-streamed answer over ~1 MiB hung until timeouts.total.)
        if limit is not None:
            declared = self.headers.get("content-length", "")
            if declared.isdecimal() and int(declared) > limit:
                raise ResponseTooLarge(limit)  # (unread: release() closes the connection)
            self._limit = limit
            if self._buffered > limit:
                raise ResponseTooLarge(limit)
        self._whole = True
        self._conn.resume_reading()
        while not self.complete:
            if self.error is not None:
                raise self.error
            await self._wait()
        body = b"".join(self._pieces)
        self._pieces.clear()  # (the pieces go as soon as they are joined: a large answer is held once, not twice)
        return body

    async def read_prefix(self, limit: int) -> tuple[bytes, bool]:
        self._prefix = limit
        self._conn.resume_reading()
        while not self.complete and self._buffered <= limit:
            if self.error is not None:
                raise self.error
            await self._wait()
        body = b"".join(self._pieces)
        # (more than limit, or not complete: the rest stays unread, and release() closes the connection)
        return body[:limit], len(body) > limit

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            if self._pieces:
                data = b"".join(self._pieces) if len(self._pieces) > 1 else self._pieces[0]
                self._pieces.clear()
                self._buffered = 0
                self._conn.resume_reading()
                yield data
                continue
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            await self._wait()

    def stream_to(self, sink: BodySink) -> None:
        """From now on, hand the body to ``sink`` as it arrives (what was buffered first), and its end."""
        self._sink = sink
        pending, self._pieces, self._buffered = self._pieces, [], 0
        for chunk in pending:
            try:
                sink.data(chunk)
            except Exception as exc:  # the sink refused the stream: end it with that error
                self.error = exc
                self._conn.close()
                sink.end(exc)
                return
        if self.error is not None:
            sink.end(self.error)
        elif self.complete:
            sink.end(None)
        else:
            self._conn.resume_reading()

    def pause_reading(self) -> None:
        self._conn.pause_reading()

    def resume_reading(self) -> None:
        self._conn.resume_reading()

    def release(self) -> None:
        """Done with it: a complete response's connection goes back to the pool (if the backend keeps it alive),
        any other is closed (a body left unread cannot be skipped cheaply, and a stream cut short must stop)."""
        self._sink = None
        conn = self._conn
        if conn.response is not self:
            conn.close()  # (what else is on it is no answer of ours: never pooled, never left open)
            return
        conn.response = None
        if self.complete and self.keep_alive and self.error is None:
            conn.owner._give_back(conn)
        else:
            conn.close()


class _Headers(dict[str, str]):
    """Response headers, looked up case-insensitively (stored lower-case)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a backend, answering one request at a time."""

    def __init__(self, owner: H1Transport, key: tuple[str, str, int]) -> None:
        self.owner = owner
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.response: H1Response | None = None
        self._head: asyncio.Future[H1Response] | None = None
        self._header_names: list[bytes] = []
        self._header_values: list[bytes] = []
        self._body: list[bytes] = []  # the current read's body pieces, not yet handed to the response
        self._head_bytes = 0
        # bytes fed since the parser last finished anything (a header line, a chunk's size, body): what it holds
        # of a header, a trailer or a line it is still building (see data_received)
        self._unfinished = 0
        self._progressed = False
        self._interim = 0  # interim (1xx) heads before the current response's own
        self._received = False  # any byte of the current response
        self._paused = False
        self._close_delimited = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's transports are not its subclasses)

    def data_received(self, data: bytes) -> None:
        if self._head is None and self.response is None:
            self.close()  # bytes nobody asked for (on an idle connection): its framing can no longer be trusted
            return
        self._received = True
        self._progressed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(UpstreamError(f"the backend's HTTP response is malformed: {exc}"))
        except httptools.HttpParserUpgrade:
            self._abort(UpstreamError("the backend switched protocols"))
        if self._progressed:
            self._unfinished = 0
        else:
            # httptools builds a header's name or value (a trailer's too) by appending each read to it: one
            # that never ends cost time quadratic in its size, on the event loop (100 MB: 5 s of every stream
            # held, every backend's health check timed out; sweep 16). on_header's bound comes only once the
            # line is whole: this one counts what is fed while nothing is finished.
            self._unfinished += len(data)
            if self._unfinished > self.owner.max_header_bytes and not self.closed:
                self._abort(UpstreamError(f"the backend sent more than {self.owner.max_header_bytes} bytes of one "
                                          f"header or line"))
                return
        body = self._body
        if body:  # the read's body pieces, as one (see on_body); _deliver's lines inline, ~0.4 us a read less
            piece = body[0] if len(body) == 1 else b"".join(body)
            body.clear()
            response = self.response
            if response is not None:
                response._data(piece)

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner._forget(self)
        head = self._head
        if head is not None and not head.done():
            head.set_exception(_Stale() if not self._received else UpstreamError("the backend closed the connection"))
        response = self.response
        if response is not None and not response.complete:
            if self._close_delimited and exc is None:
                response._complete()  # a body without length or chunks ends with the connection
            else:
                response._fail(UpstreamError("the backend's response was cut off"))

    # -- httptools callbacks ------------------------------------------------------------------------------
    def on_chunk_header(self) -> None:
        self._progressed = True

    def on_chunk_complete(self) -> None:
        self._progressed = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self._progressed = True
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.owner.max_header_bytes:
            error = UpstreamError(f"the backend's response headers exceed {self.owner.max_header_bytes} bytes")
            self._abort(error)
            raise error  # stops the parser
        self._header_names.append(name)
        self._header_values.append(value)

    def on_headers_complete(self) -> None:
        self._progressed = True
        status = self.parser.get_status_code()
        names, values = self._header_names, self._header_values
        self._header_names, self._header_values = [], []
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            # (a real engine sends one at most; one sending them without end had millions parsed, the loop held
            # ~650 ms of every 700 until first_byte, sweep 17: their headers count in the head's bound, and
            # past MAX_INTERIM of them the answer is refused)
            self._interim += 1
            if self._interim > MAX_INTERIM:
                error = UpstreamError(f"the backend sent more than {MAX_INTERIM} interim (1xx) responses")
                self._abort(error)
                raise error  # stops the parser
            return
        self._head_bytes = self._interim = 0
        head = self._head
        if head is None or head.done():
            # a response no request waits for: bytes after a complete answer (in the same read, or later). It
            # replaced the answer on the connection, whose release then neither pooled nor closed it: a
            # connection and ~1.2 MB kept per request, for good (sweep 18). The connection is closed.
            error = UpstreamError("the backend sent a response that no request asked for")
            self._abort(error)
            raise error  # stops the parser
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in zip(names, values,
                                                                                                  strict=True)}
        self._close_delimited = "content-length" not in headers and "chunked" not in headers.get(
            "transfer-encoding", "").lower()
        response = H1Response(self, status, headers, self.parser.should_keep_alive() and not self._close_delimited)
        self.response = response
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, body: bytes) -> None:
        # Kept until the parser is through the read: a backend's chunks that arrive together (many at once when
        # this process is busy: ~10 a read at 256 streams, a whole answer at 1,024) reach the sink as one piece,
        # checked in one pass and written to the client in one system call instead of one per chunk.
        self._progressed = True
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._progressed = True
        if self._body:  # the body before its end
            self._deliver()
        response = self.response
        if response is not None:
            response._complete()

    def _deliver(self) -> None:
        """Hand the body pieces parsed so far to the response, as one."""
        body = self._body
        piece = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        response = self.response
        if response is not None:
            response._data(piece)

    # -- the pool's side ----------------------------------------------------------------------------------
    async def request(self, head: bytes, body: bytes) -> H1Response:
        assert self.transport is not None
        self._received = False
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)
        try:
            return await self._head
        except asyncio.CancelledError:
            # abandoned before its answer (the client left; a non-streamed answer's head comes only with it):
            # closing the connection is how HTTP/1.1 tells the engine to stop computing it
            self.close()
            raise
        finally:
            self._head = None

    def pause_reading(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner._forget(self)
            if self.transport is not None:
                self.transport.close()

    def _abort(self, error: UpstreamError) -> None:
        self._body.clear()
        head = self._head
        if head is not None and not head.done():
            head.set_exception(error)
        if self.response is not None:
            self.response._fail(error)
        self.close()


class H1Transport:
    """The :class:`~gateway.proxy.transport.Transport` of the data plane: keep-alive pools per backend address,
    most recently used connection first (the least likely to have been closed by the backend meanwhile)."""

    def __init__(self, timeouts: TimeoutSettings, *, keepalive: float = KEEPALIVE_SECONDS,
                 max_header_bytes: int = 64 * 1024, max_body_bytes: int = 256 << 20) -> None:
        self._timeouts = timeouts
        self.keepalive = keepalive
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._dns: dict[tuple[str, int], tuple[float, str]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def set_timeouts(self, timeouts: TimeoutSettings) -> None:
        """Reloaded timeouts, for the connections opened from now on."""
        self._timeouts = timeouts

    async def start(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # backends come and go with discovery: keep the cache bounded
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> H1Response:
        if self._closed:
            raise RuntimeError("H1Transport is closed")
        target = self._target(url)
        head = _request_head(target, len(body), headers)
        conn = self._take_idle(target.key)
        if conn is not None:
            try:
                return await conn.request(head, body)
            except _Stale:
                pass  # closed by the backend while idle: the request never reached it; once more, afresh
        conn = await self._connect(target)
        try:
            return await conn.request(head, body)
        except _Stale:
            raise UpstreamError("the backend closed the connection") from None

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest = time.monotonic() - self.keepalive
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if conn.idle_since < oldest:
                conn.close()
                continue
            return conn
        return None

    def _give_back(self, conn: _Connection) -> None:
        if self._closed or conn.closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        conn.resume_reading()  # an idle connection must see the backend close it
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= 1024:  # more idle connections to one backend than any burst needs
            conn.close()
            return
        idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _resolve(self, host: str, port: int) -> str:
        try:
            socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
            return host  # an address already
        except OSError:
            pass
        now = time.monotonic()
        cached = self._dns.get((host, port))
        if cached is not None and cached[0] > now:
            return cached[1]
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"no address for {host}")
        address = str(infos[0][4][0])
        if len(self._dns) > 4096:
            self._dns.clear()
        self._dns[(host, port)] = (now + DNS_TTL_SECONDS, address)
        return address

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, target.key)
        tls: ssl.SSLContext | None = None
        if target.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._timeouts.connect):
                address = await self._resolve(target.host, target.port)
                await loop.create_connection(lambda: conn, address, target.port, ssl=tls,
                                             server_hostname=target.host if tls else None)
        except TimeoutError:
            raise UpstreamError(f"cannot connect: no answer within {self._timeouts.connect:g} s",
                                timeout=True) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect: {exc.strerror or exc}", connect=True) from None
        self._open.add(conn)
        return conn

    def map_error(self, exc: BaseException) -> UpstreamError:
        common = map_common(exc)
        if common is not None:
            return common
        if isinstance(exc, ssl.SSLError | OSError):
            return UpstreamError(f"{type(exc).__name__}: {exc}")
        raise exc


def _request_head(target: _Target, length: int, headers: Mapping[str, str]) -> bytes:
    lines = [b"POST ", target.path, b" HTTP/1.1\r\nHost: ", target.host_header, b"\r\nContent-Length: ",
             str(length).encode(), b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines += (name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)

