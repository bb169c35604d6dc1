"""The hot path's own Redis connection: pipelined commands on one asyncio protocol, packed and parsed by
hiredis (the C parser redis-py itself uses, installed with it).

Every admission waits for one Redis round trip before its first upstream byte. Through redis-py's pipeline
that round trip costs CPU for a pooled connection taken and given back, the commands packed and the replies
read in Python, a task per read. Here a batch is one ``transport.write`` of ``hiredis.pack_command`` bytes, and
the replies are parsed in ``data_received`` as they arrive, each resolving its caller's future in the order
the commands were sent. Gateway CPU per admission (the ADMIT script with a slot, uvloop, a loopback
redis-server, medians of 4 interleaved runs of 4,000): 132 us one at a time and 42 us when 16 go together,
against 322 us and 83 us through redis-py. Everything else (scripts loaded, heartbeats' reads, settlements,
the subscriber) stays on redis-py.

Only for ``redis://`` and ``unix://`` URLs; ``rediss://`` (TLS, with redis-py's many certificate options) keeps
the redis-py pipeline.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import parse_qsl, urlsplit

import hiredis


class RespError(Exception):
    """An error reply; ``no_script``: Redis does not hold the script (it restarted)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.no_script = message.startswith("NOSCRIPT")


class _Protocol(asyncio.Protocol):
    def __init__(self, owner: RespConnection) -> None:
        self._owner = owner
        self._reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's are not asyncio.Transport subclasses)

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._owner.waiting
        reply = reader.gets()
        while reply is not False:
            if not waiting:  # a reply nobody asked for: the stream is out of step, start again
                self._owner.broken(ConnectionError("Redis sent a reply that no command asked for"), self)
                return
            future = waiting.popleft()
            self._owner.replies += 1
            if not future.done():  # (done: its caller gave up, timed out)
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(RespError(str(reply)))
                else:
                    future.set_result(reply)
            reply = reader.gets()

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner.broken(ConnectionError(f"connection to Redis lost: {exc or 'closed'}"), self)


class RespConnection:
    """``await execute(commands)``: each command's reply (an error reply as a :class:`RespError` in its place),
    the commands sent together. Connects on first use and again after the connection broke; a command in
    flight when it broke fails with ConnectionError (it may or may not have run)."""

    def __init__(self, connection_kwargs: dict[str, Any], timeout: float) -> None:
        self._kwargs = connection_kwargs
        self._timeout = timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.replies = 0  # replies read, on any of its connections (a connection answering nothing stays at it)

    @staticmethod
    def supports(url: str) -> bool:
        """Whether this client can stand in for redis-py's on ``url``: plain TCP or a UNIX socket, with at most a
        user, a password and a database (any other option is redis-py's to honour)."""
        parts = urlsplit(url)
        return parts.scheme in ("redis", "unix") and all(k == "db" for k, _ in parse_qsl(parts.query))

    async def execute(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        await self.connected()
        return list(await asyncio.gather(*self.send(commands), return_exceptions=True))

    async def connected(self) -> None:
        """Connect, unless connected."""
        if self._protocol is None:
            await self._connect()

    def send(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[Any]]:
        """Write ``commands`` (connected first: :meth:`connected`); each one's reply comes on its future, set as
        soon as the reply is read (done: Redis answered, whether or not its caller has run since)."""
        protocol = self._protocol
        if protocol is None or protocol.transport is None:
            raise ConnectionError("not connected to Redis")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        self.waiting.extend(futures)
        protocol.transport.write(b"".join(hiredis.pack_command(tuple(c)) for c in commands))
        return futures

    async def _connect(self) -> _Protocol:
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        kw = self._kwargs
        async with asyncio.timeout(self._timeout):
            if kw.get("path"):
                transport, protocol = await loop.create_unix_connection(lambda: _Protocol(self), kw["path"])
            else:
                transport, protocol = await loop.create_connection(lambda: _Protocol(self),
                                                                   kw.get("host", "localhost"),
                                                                   int(kw.get("port", 6379)))
            # (uvloop may call connection_made after this returns)
            protocol.transport = transport
            self._protocol = protocol
            handshake: list[tuple[Any, ...]] = []
            if kw.get("password") is not None:
                user = kw.get("username")
                handshake.append(("AUTH", user, kw["password"]) if user else ("AUTH", kw["password"]))
            if int(kw.get("db") or 0):
                handshake.append(("SELECT", int(kw["db"])))
            if handshake:
                for reply in await self.execute(handshake):
                    if isinstance(reply, Exception):
                        self.broken(ConnectionError(f"Redis refused the connection's set-up: {reply}"))
                        raise ConnectionError(f"Redis refused the connection's set-up: {reply}")
        return protocol

    def broken(self, exc: Exception, protocol: _Protocol | None = None) -> None:
        """The connection (``protocol``'s, when given: only if it is still the current one) is unusable: fail
        what waits on it; the next command connects again."""
        if protocol is not None and protocol is not self._protocol:
            return  # an earlier connection's end, already dealt with
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()
        waiting, self.waiting = self.waiting, collections.deque()
        for future in waiting:
            if not future.done():
                future.set_exception(exc)

    def close(self) -> None:
        self.broken(ConnectionError("closed"))
