"""A ZeroMQ client for the engines' KV-event sockets that reads frame by frame, each bounded before it is read.

libzmq hands a multipart message to its reader only once its last part has arrived, and bounds a part's size
(``ZMQ_MAXMSGSIZE``) but neither a message's parts nor its bytes, nor what its queue holds of one message: a
publisher's single message of 40 parts of 48 MiB took the gateway to 2.1 GB before the subscriber could count
its parts, and a replay answer of the same to 795 MiB (sweep 24). Here every frame's header is read before its
body, and a frame past ``max_frame`` bytes or a message past ``max_parts`` parts ends the connection with
:class:`ZmtpError` before the rest is read: one message at a time, at most ``max_parts * max_frame`` bytes.

What is spoken of ZMTP 3.0 (https://rfc.zeromq.org/spec/23/), as a client, over ``tcp://host:port`` or
``ipc://path``: the greeting (version 3.0, the NULL mechanism), the NULL handshake (``READY`` with this end's
``Socket-Type``, the peer's ``READY`` read and its socket type checked), message frames (``MORE``, ``LONG``),
and commands between messages (``PING`` answered with ``PONG`` while the last is sent, the rest skipped; more
than :data:`MAX_COMMANDS` in a second between two messages end the connection). A SUB subscribes with a message
(``0x01`` and the topic), which ZMTP 3.0 peers and ZMTP 3.1 peers (libzmq 4.2 and later) both read. No reconnection: a
closed or broken connection is the caller's to open again, as the subscriber's sessions do.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING = SIGNATURE + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31  # 64 bytes
MORE, LONG, COMMAND = 0x01, 0x02, 0x04
# the peer socket types each of ours talks to (ZMTP 3.0's socket compatibility table)
PEERS = {"SUB": {b"PUB", b"XPUB"}, "DEALER": {b"ROUTER", b"DEALER", b"REP"}}
MAX_COMMAND_BYTES = 4096  # a READY or PING is tens of bytes
# commands a peer may send in a second between two messages: heartbeats come one an interval; a peer sending
# commands instead of messages held the event loop (one read of 256 KiB is ~43,000 six-byte commands, each handled
# in one turn) and, with PINGs it never read the PONGs of, grew the gateway ~200 MB a second (sweep 25)
MAX_COMMANDS = 64  # (libzmq heartbeats at 40 ms are 25 a second)
PONG_CONTEXT = 16  # bytes of a PING's context a PONG echoes (ZMTP 3.1: at most 16)


class ZmtpError(Exception):
    """The peer broke the protocol or a bound: the caller closes the connection."""


def address(endpoint: str) -> tuple[str, int] | str:
    """(host, port) of a ``tcp://host:port`` endpoint, or the path of an ``ipc://path`` one."""
    if endpoint.startswith("ipc://"):
        return endpoint.removeprefix("ipc://")
    parts = urlsplit(endpoint)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:  # (the endpoint is not shown: it may hold a
        raise ValueError("not a tcp://host:port or ipc://path endpoint")  # password an operator typed by mistake)
    return parts.hostname, port


class Connection:
    """One ZMTP connection to a peer: ``await Connection.open(...)``, then ``send`` and ``recv`` whole messages."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int,
                 max_parts: int) -> None:
        self._reader = reader
        self._writer = writer
        self.max_frame = max_frame
        self.max_parts = max_parts

    @classmethod
    async def open(cls, endpoint: str, socket_type: str, *, max_frame: int, max_parts: int,
                   seconds: float) -> Connection:
        """Connect to ``endpoint`` as a ``socket_type`` (``SUB`` or ``DEALER``) and complete the handshake within
        ``seconds``; OSError, TimeoutError or ZmtpError when that fails."""
        where = address(endpoint)
        async with asyncio.timeout(seconds):
            if isinstance(where, str):
                reader, writer = await asyncio.open_unix_connection(where)
            else:
                reader, writer = await asyncio.open_connection(*where)
            connection = cls(reader, writer, max_frame, max_parts)
            try:
                await connection._handshake(socket_type)
            except BaseException:
                connection.close()
                raise
        return connection

    async def _handshake(self, socket_type: str) -> None:
        self._writer.write(GREETING)
        greeting = await self._reader.readexactly(64)
        if greeting[0] != 0xFF or greeting[9] != 0x7F:
            raise ZmtpError("the peer is not a ZeroMQ socket (no ZMTP signature)")
        if greeting[10] < 3:
            raise ZmtpError(f"the peer speaks ZMTP {greeting[10]}.{greeting[11]}; 3.0 or later is needed")
        mechanism = greeting[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ZmtpError(f"the peer asks for the {mechanism!r} mechanism; only NULL is spoken")
        self._writer.write(_frame(COMMAND, _command(b"READY", {b"Socket-Type": socket_type.encode()})))
        await self._writer.drain()
        flags, body = await self._read_frame(MAX_COMMAND_BYTES)
        name, properties = _parse_command(body) if flags & COMMAND else (b"", {})
        if name != b"READY":
            raise ZmtpError("the peer did not complete the NULL handshake (no READY)")
        peer = properties.get(b"socket-type", b"")
        if peer.upper() not in PEERS[socket_type]:
            raise ZmtpError(f"a {socket_type} socket cannot talk to the peer's {peer[:20]!r} socket")

    async def send(self, parts: list[bytes]) -> None:
        self._writer.write(b"".join(_frame(MORE if i < len(parts) - 1 else 0, part) for i, part in enumerate(parts)))
        await self._writer.drain()

    async def recv(self) -> list[bytes]:
        """The next message's parts; ZmtpError past ``max_parts`` parts or ``max_frame`` bytes in a part (nothing
        more of it is read), asyncio.IncompleteReadError when the peer closes."""
        parts: list[bytes] = []
        commands, since = 0, asyncio.get_running_loop().time()
        while True:
            flags, body = await self._read_frame()
            if flags & COMMAND:
                if parts:
                    raise ZmtpError("a command inside a message")
                # (MAX_COMMANDS a second: an idle publisher's heartbeats, one every interval, were counted until the
                # 17th ended a healthy subscription, sweep 27)
                now = asyncio.get_running_loop().time()
                if now - since >= 1.0:
                    commands, since = 0, now
                commands += 1
                if commands > MAX_COMMANDS:
                    raise ZmtpError(f"more than {MAX_COMMANDS} commands in a second between two messages")
                name, _ = _parse_command(body)
                # (a heartbeat: PONG, with the start of the context the peer sent after its TTL; none while the
                # last ones are unsent: a peer that does not read them is owed nothing more)
                if name == b"PING" and not self._writer.transport.get_write_buffer_size():
                    self._writer.write(_frame(COMMAND, b"\x04PONG" + body[7:7 + PONG_CONTEXT]))
                continue
            parts.append(body)
            if not flags & MORE:
                return parts
            if len(parts) >= self.max_parts:
                raise ZmtpError(f"a message of more than {self.max_parts} parts")

    async def _read_frame(self, most: int | None = None) -> tuple[int, bytes]:
        """A frame, bounded by what it is: a command to MAX_COMMAND_BYTES, a message's part to ``max_frame`` (a
        message after a heartbeat was held to the command's bound, and a batch over 4 KiB ended the connection,
        sweep 27)."""
        head = await self._reader.readexactly(1)
        flags = head[0]
        if flags & ~(MORE | LONG | COMMAND):
            raise ZmtpError(f"a frame with unknown flags {flags:#x}")
        limit = MAX_COMMAND_BYTES if flags & COMMAND else self.max_frame
        if most is not None:  # (the handshake's READY: a command, whatever the peer flags it)
            limit = min(limit, most)
        size = int.from_bytes(await self._reader.readexactly(8 if flags & LONG else 1), "big")
        if size > limit:
            raise ZmtpError(f"a frame of {size} bytes, more than {limit}")
        return flags, await self._reader.readexactly(size)

    def close(self) -> None:
        """Close at once, dropping what is unsent: a peer that reads nothing kept a closed connection, and what it
        was owed, for as long as it held its socket open (sweep 25)."""
        with contextlib.suppress(Exception):
            self._writer.transport.abort()


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) > 255:
        return bytes([flags | LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def _command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    return bytes([len(name)]) + name + b"".join(
        bytes([len(key)]) + key + len(value).to_bytes(4, "big") + value for key, value in properties.items())


def _parse_command(body: bytes) -> tuple[bytes, dict[bytes, bytes]]:
    """A command's name and, for READY, its properties (names lower-cased: they are case-insensitive)."""
    if not body or len(body) < 1 + body[0]:
        raise ZmtpError("a malformed command")
    name = body[1:1 + body[0]]
    properties: dict[bytes, bytes] = {}
    if name == b"READY":
        at = 1 + body[0]
        while at < len(body):
            size = body[at]
            key = body[at + 1:at + 1 + size]
            at += 1 + size
            if at + 4 > len(body):
                raise ZmtpError("a malformed READY command")
            length = int.from_bytes(body[at:at + 4], "big")
            properties[key.lower()] = body[at + 4:at + 4 + length]
            at += 4 + length
    return name, properties
