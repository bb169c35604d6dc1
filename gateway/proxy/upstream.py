"""The data-plane HTTP client and the one place its errors become the gateway's own.

aiohttp, not httpx, carries proxied requests: on our machines httpx's connection pool added ~10x the
latency of aiohttp at 64 concurrent streams (see the commit that introduced this module for the figures).
httpx stays on the control plane (health, load, models), where it is not on any request's path.
"""

from __future__ import annotations

import asyncio

import aiohttp

from gateway.config import TimeoutSettings
from gateway.errors import Redactor
from gateway.proxy.sse import InvalidStream


class UpstreamError(Exception):
    """The upstream failed. ``connect`` is true when no request reached it (safe to try another backend);
    ``auth`` when it refused the gateway's own credentials for it (401/403): a configuration fault of the
    gateway's, never the client's."""

    def __init__(self, message: str, *, connect: bool = False, timeout: bool = False, auth: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.timeout = timeout
        self.auth = auth

    @property
    def code(self) -> str:
        """The error code a client sees, and the request's outcome."""
        if self.auth:
            return "upstream_auth_failed"
        return "upstream_timeout" if self.timeout else "upstream_failed"

    @property
    def reason(self) -> str:
        """Why another backend is tried (the retries metric's label)."""
        if self.auth:
            return "upstream_auth"
        if self.timeout:
            return "timeout"
        return "connect_failed" if self.connect else "upstream_failed"

    def redacted(self, redactor: Redactor) -> UpstreamError:
        return UpstreamError(redactor.scrub(str(self)), connect=self.connect, timeout=self.timeout, auth=self.auth)


def map_error(exc: BaseException) -> UpstreamError:
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, InvalidStream):
        return UpstreamError(f"the backend's stream is malformed: {exc}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(f"cannot connect: {exc.os_error.strerror or exc}", connect=True)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamError("timed out", timeout=True)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamError("the backend closed the connection")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return UpstreamError("the backend's response was cut off")
    if isinstance(exc, aiohttp.ClientError | OSError):
        return UpstreamError(f"{type(exc).__name__}: {exc}")
    raise exc


class Upstream:
    """Owns the aiohttp session (one pool of keep-alive connections for all backends)."""

    def __init__(self, timeouts: TimeoutSettings) -> None:
        self.timeouts = timeouts
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
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.timeouts.connect),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() has not run")
        return self._session
