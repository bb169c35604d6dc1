"""The seam under forwarding: one POST to a backend, answered with a status, headers and a body read whole or
as it arrives.

:class:`~gateway.proxy.h1.H1Transport` carries real requests (HTTP/1.1 on asyncio protocols; its responses
can hand their body to a :class:`BodySink` as it arrives). httpx stays on the control plane (health, load,
models), where it is on no request's path: its pool added ~10x the latency under concurrency.

:class:`MockTransport` answers from a function, as httpx's ``MockTransport`` does, so forwarding and failover
are unit-tested without sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.proxy.upstream import ResponseTooLarge, UpstreamError


class BodySink(Protocol):
    """Where a streamed body goes as it arrives, for a response that can hand it over (``stream_to``): ``data``
    for each piece, then ``end`` once (None when the body is complete, else the error that cut it). Called from
    the event loop's protocol callbacks: it must not block, and an exception it raises from ``data`` ends the
    response with that error."""

    def data(self, chunk: bytes) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


class UpstreamResponse(Protocol):
    """A backend's answer. ``read``, ``read_prefix`` or ``chunks`` consume the body (once); ``release`` must always
    be called."""

    status: int
    headers: Mapping[str, str]

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; past ``limit`` bytes :class:`~gateway.proxy.upstream.ResponseTooLarge`, as soon as
        that is known (its ``Content-Length``, or the bytes as they arrive), without reading the rest."""
        ...

    async def read_prefix(self, limit: int) -> tuple[bytes, bool]:
        """The body's first ``limit`` bytes at most, and whether there was more (which is then never read)."""
        ...

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

    async def read(self, limit: int | None = None) -> bytes:
        body = self.body + b"".join(await _collect(self.chunks()))
        if limit is not None and len(body) > limit:
            raise ResponseTooLarge(limit)
        return body

    async def read_prefix(self, limit: int) -> tuple[bytes, bool]:
        body = self.body + b"".join(await _collect(self.chunks()))
        return body[:limit], len(body) > limit

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
