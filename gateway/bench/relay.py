"""A bare TCP relay: what any proxy pays on this machine before it does anything at all, for overhead benchmarks.

Each client connection gets its own upstream connection, and bytes are copied both ways as they arrive, with
flow control and nothing else: no HTTP parsing, no routing, no metrics. Its CPU per request and per chunk is the
floor of the sockets, the event loop and the kernel that a proxy in Python (uvloop) cannot go under, and that
a Rust proxy shares in its kernel part; the overhead benchmark runs it beside the gateway (target ``relay``) so
the gateway's figures can be read against it.

``python -m gateway.bench.relay --port 18508 --upstream 127.0.0.1:18500``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from typing import cast


class _Side(asyncio.Protocol):
    """One connection of a pair; what it receives is written to the other's transport."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []  # (the client's bytes before the upstream connection is made)
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.write(data)
        else:
            self._early.append(data)

    def eof_received(self) -> bool:
        peer = self.peer
        if peer is not None and peer.transport is not None and peer.transport.can_write_eof():
            peer.transport.write_eof()
        else:
            self._eof = True
        return True  # (keep the write side open: the other side may still answer)

    def connection_lost(self, exc: Exception | None) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None:
            peer.transport.close()

    # flow control: a peer that cannot keep up pauses this side's reads
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def joined(self, peer: _Side) -> None:
        """``peer``'s connection is made: what arrived meanwhile goes to it."""
        self.peer = peer
        peer.peer = self
        assert peer.transport is not None
        for data in self._early:
            peer.transport.write(data)
        self._early.clear()
        if self._eof and peer.transport.can_write_eof():
            peer.transport.write_eof()


class _Downstream(_Side):
    def __init__(self, host: str, port: int) -> None:
        super().__init__()
        self._upstream = (host, port)
        self._connecting: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._connecting = asyncio.get_running_loop().create_task(self._connect())  # (the loop keeps weak refs)

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(_Side, *self._upstream)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        if self.transport is None or self.transport.is_closing():
            if upstream.transport is not None:
                upstream.transport.close()
            return
        self.joined(upstream)


async def serve(port: int, upstream: str, host: str = "127.0.0.1") -> None:
    up_host, _, up_port = upstream.rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Downstream(up_host or "127.0.0.1", int(up_port)), host, port,
                                      reuse_address=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gateway.bench.relay", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--upstream", required=True, help="host:port to relay to")
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.port, args.upstream, args.host))
    else:
        uvloop.run(serve(args.port, args.upstream, args.host))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
