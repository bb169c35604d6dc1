"""The seam under forwarding: one POST to a backend, answered with a status, headers and a body read whole or
as it arrives.

:class:`AiohttpTransport` carries real requests. aiohttp, not httpx, is the data-plane client: on our machines
httpx's connection pool added ~10x the latency of aiohttp at 64 concurrent streams (see the commit that
introduced aiohttp for the figures); httpx stays on the control plane (health, load, models), where it is on
no request's path. Its exceptions become :class:`~gateway.proxy.upstream.UpstreamError` in one place,
:meth:`AiohttpTransport.map_error`.

:class:`MockTransport` answers from a function, as httpx's ``MockTransport`` does, so forwarding and failover
are unit-tested without sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from gateway.config import TimeoutSettings
from gateway.proxy.upstream import UpstreamError


class BodySink(Protocol):
    """Where a streamed body goes as it arrives, for a response that can hand it over (``stream_to``): ``data``
    for each piece, then ``end`` once (None when the body is complete, else the error that cut it). Called from
    the event loop's protocol callbacks: it must not block, and an exception it raises from ``data`` ends the
    response with that error."""

    def data(self, chunk: bytes) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


class UpstreamResponse(Protocol):
    """A backend's answer. ``read`` or ``chunks`` consume the body (once); ``release`` must always be called."""

    status: int
    headers: Mapping[str, str]

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def release(self) -> None: ...

    # A response may also offer ``stream_to(sink: BodySink)`` (then ``pause_reading``/``resume_reading``
    # apply flow control): the body then bypasses ``chunks`` (see ``gateway.proxy.h1``).
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Transport(Protocol):
    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send one request; raises whatever its client raises (see ``map_error``)."""
        ...

    def map_error(self, exc: BaseException) -> UpstreamError:
        """The gateway's error for an exception raised by ``post`` or while reading its response; re-raises
        ``exc`` when it is no transport failure."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def map_common(exc: BaseException) -> UpstreamError | None:
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamError("timed out", timeout=True)
    return None


# --- aiohttp ------------------------------------------------------------------------------------------------
class _AiohttpResponse:
    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def read(self) -> bytes:
        return await self._response.read()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.content.iter_any()

    def release(self) -> None:
        self._response.release()

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class AiohttpTransport:
    """Owns the aiohttp session: one pool of keep-alive connections for all backends."""

    def __init__(self, timeouts: TimeoutSettings) -> None:
        self._timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # admission control is the gateway's job, not the pool's
            # below the 5 s idle timeout of uvicorn (vLLM, SGLang, TabbyAPI) and llama.cpp's server, so the
            # pool never reuses a connection the backend is closing (a 502 "server disconnected" otherwise)
            keepalive_timeout=4,
            ttl_dns_cache=10,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self._timeouts.connect),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        if self._session is None:
            raise RuntimeError("AiohttpTransport.start() has not run")
        try:
            return _AiohttpResponse(await self._session.post(url, data=body, headers=headers))
        except aiohttp.ClientConnectorError:
            raise  # no connection could be made: nothing was sent
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # A pooled keep-alive connection the backend had closed meanwhile: the request never reached it
            # (the write failed, or the server hung up before reading). Once more; aiohttp has dropped that
            # connection. A second failure is the backend's.
            return _AiohttpResponse(await self._session.post(url, data=body, headers=headers))

    def map_error(self, exc: BaseException) -> UpstreamError:
        common = map_common(exc)
        if common is not None:
            return common
        if isinstance(exc, aiohttp.ClientConnectorError):
            return UpstreamError(f"cannot connect: {exc.os_error.strerror or exc}", connect=True)
        if isinstance(exc, aiohttp.ServerDisconnectedError):
            return UpstreamError("the backend closed the connection")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return UpstreamError("the backend's response was cut off")
        if isinstance(exc, aiohttp.ClientError | OSError):
            return UpstreamError(f"{type(exc).__name__}: {exc}")
        raise exc


# --- for tests ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MockRequest:
    url: str
    body: bytes
    headers: Mapping[str, str]


@dataclass(slots=True)
class MockResponse:
    """An answer given whole (``body``) or in pieces (``chunks``, each sent after ``delay`` seconds); a chunk
    that is an exception is raised at that point of the body, as a broken connection would."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"})
    body: bytes = b""
    pieces: Iterable[bytes | BaseException] = ()
    delay: float = 0.0
    released: bool = False

    async def read(self) -> bytes:
        return self.body + b"".join(await _collect(self.chunks()))

    async def chunks(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            if self.delay:
                await asyncio.sleep(self.delay)
            if isinstance(piece, BaseException):
                raise piece
            yield piece

    def release(self) -> None:
        self.released = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _collect(chunks: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in chunks]


Handler = Callable[[MockRequest], MockResponse | Awaitable[MockResponse]]


class MockTransport:
    """Answers every request from ``handler`` (a function of :class:`MockRequest`, plain or async); records
    the requests in ``requests``. An exception the handler raises is raised by ``post``, as a failed
    connection would be: raise an :class:`UpstreamError` (``connect=True`` for a refused one)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self.requests: list[MockRequest] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        request = MockRequest(url, body, dict(headers))
        self.requests.append(request)
        answer = self._handler(request)
        if not isinstance(answer, MockResponse):
            answer = await answer
        return answer

    def map_error(self, exc: BaseException) -> UpstreamError:
        common = map_common(exc)
        if common is not None:
            return common
        if isinstance(exc, OSError):
            return UpstreamError(f"{type(exc).__name__}: {exc}")
        raise exc
