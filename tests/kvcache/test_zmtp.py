"""The gateway's own ZeroMQ client for KV events (gateway.kvcache.zmtp), against libzmq's sockets (pyzmq): it
speaks to them as their own SUB and DEALER do, and ends a message past its bounds at the frame's header."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
from collections.abc import Iterator

import pytest
import zmq

from gateway.kvcache.contexts import close_context, open_context
from gateway.kvcache.zmtp import Connection, ZmtpError
from tests.conftest import free_port_block


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx = open_context(zmq.Context)
    yield ctx
    close_context(ctx)


async def refusal(connection: Connection) -> str:
    """Why ``connection`` refused what came next (its ZmtpError's words); closed after."""
    try:
        with pytest.raises(ZmtpError) as raised:
            await asyncio.wait_for(connection.recv(), 10)
        return str(raised.value)
    finally:
        connection.close()


async def publish_once_subscribed(pub: zmq.Socket[bytes], parts: list[bytes]) -> None:
    """Send ``parts`` once the subscription has reached ``pub`` (an XPUB: it hears subscriptions; a plain PUB drops
    what it sends before)."""
    subscription = await asyncio.get_running_loop().run_in_executor(None, pub.recv)
    assert subscription[:1] == b"\x01"
    pub.send_multipart(parts)


@pytest.mark.parametrize("over", ["tcp", "ipc"])
def test_a_sub_reads_what_a_libzmq_pub_sends_on_its_topic(context: zmq.Context[zmq.Socket[bytes]], over: str,
                                                          tmp_path: pathlib.Path) -> None:
    # (ipc://, which the configuration takes, too: the first of this client spoke tcp alone, sweep 25)
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}" if over == "tcp" else f"ipc://{tmp_path}/kv.ipc"
    pub = context.socket(zmq.XPUB)
    pub.bind(endpoint)
    big = bytes(range(256)) * 4096  # (1 MiB: a frame of the long form)

    async def scenario() -> list[bytes]:
        sub = await Connection.open(endpoint, "SUB", max_frame=2 << 20, max_parts=4, seconds=5)
        sending = asyncio.get_running_loop().create_task(
            publish_once_subscribed(pub, [b"other", b"x"]))  # (another topic first: not for this subscriber)
        await sub.send([b"\x01kv"])
        await sending
        pub.send_multipart([b"kv", (7).to_bytes(8, "big"), big])
        try:
            return await asyncio.wait_for(sub.recv(), 10)
        finally:
            sub.close()

    assert asyncio.run(scenario()) == [b"kv", (7).to_bytes(8, "big"), big]
    pub.close(0)


def test_a_publisher_with_heartbeats_is_read_however_long_it_is_quiet(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Sweep 27: libzmq's ZMQ_HEARTBEAT_IVL PINGs counted toward the commands allowed between two messages (an
    idle publisher was cut at the 17th), and a message after one was held to a command's 4 KiB."""
    endpoint = f"tcp://127.0.0.1:{free_port_block(1)}"
    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.HEARTBEAT_IVL, 40)  # (ms: 25 PINGs a second)
    pub.bind(endpoint)
    batch = b"b" * 10_000

    async def scenario() -> list[bytes]:
        sub = await Connection.open(endpoint, "SUB", max_frame=2 << 20, max_parts=4, seconds=5)
        sending = asyncio.get_running_loop().create_task(publish_once_subscribed(pub, [b"kv", b"x"]))
        await sub.send([b"\x01kv"])
        await sending
        heard, enough = [0], asyncio.Event()
        read = sub._read_frame

        async def counting(most: int | None = None) -> tuple[int, bytes]:
            flags, body = await read(most)
            if flags & 0x04:  # (a command: here, a heartbeat)
                heard[0] += 1
                if heard[0] >= 24:
                    enough.set()
            return flags, body

        sub._read_frame = counting  # type: ignore[method-assign]
        try:
            assert await asyncio.wait_for(sub.recv(), 10) == [b"kv", b"x"]
            reading = asyncio.get_running_loop().create_task(sub.recv())  # (answering each PING meanwhile)
            await asyncio.wait_for(enough.wait(), 10)  # (24 heartbeats while the publisher is quiet: 16 cut it)
            pub.send_multipart([b"kv", batch])
            return await asyncio.wait_for(reading, 10)
        finally:
            sub.close()

    assert asyncio.run(scenario()) == [b"kv", batch]
    pub.close(0)


@pytest.mark.parametrize(("parts", "words"), [([b"kv"] + [b"p" * 1024] * 39, "more than 4 parts"),
                                             ([b"kv", b"seq", b"x" * 5000], "a frame of 5000 bytes, more than 4096")])
def test_a_message_past_its_bounds_ends_at_the_header_that_says_so(
        context: zmq.Context[zmq.Socket[bytes]], parts: list[bytes], words: str) -> None:
    """Sweep 24: libzmq hands a message over only once its last part is in, bounding each part but not their
    number: one message of 40 parts of 48 MiB took the gateway to 2.1 GB before it could count them."""
    port = free_port_block(1)
    pub = context.socket(zmq.XPUB)
    pub.bind(f"tcp://127.0.0.1:{port}")

    async def scenario() -> str:
        sub = await Connection.open(f"tcp://127.0.0.1:{port}", "SUB", max_frame=4096, max_parts=4, seconds=5)
        sending = asyncio.get_running_loop().create_task(publish_once_subscribed(pub, parts))
        await sub.send([b"\x01kv"])
        await sending
        return await refusal(sub)

    assert words in asyncio.run(scenario())
    pub.close(0)


def test_a_dealer_asks_a_libzmq_router_and_reads_its_answer(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    port = free_port_block(1)
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")

    async def scenario() -> list[bytes]:
        dealer = await Connection.open(f"tcp://127.0.0.1:{port}", "DEALER", max_frame=4096, max_parts=4, seconds=5)
        await dealer.send([b"", (5).to_bytes(8, "big")])
        loop = asyncio.get_running_loop()
        identity, empty, start = await loop.run_in_executor(None, router.recv_multipart)
        assert empty == b"" and int.from_bytes(start, "big") == 5
        router.send_multipart([identity, b"", b"batch"])
        try:
            return await asyncio.wait_for(dealer.recv(), 10)
        finally:
            dealer.close()

    assert asyncio.run(scenario()) == [b"", b"batch"]
    router.close(0)


def test_a_peer_that_is_not_zeromq_or_of_the_wrong_type_is_refused(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    port, other = free_port_block(2), 0
    other = port + 1
    listener = socket.create_server(("127.0.0.1", port))
    pull = context.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{other}")

    async def scenario() -> tuple[str, str]:
        async def not_zeromq() -> None:
            loop = asyncio.get_running_loop()
            connection, _ = await loop.run_in_executor(None, listener.accept)
            connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b" " * 64)
            connection.settimeout(10)
            with contextlib.suppress(OSError):  # (open until the client gives up on it, closing or resetting it)
                await loop.run_in_executor(None, connection.recv, 1024)
            connection.close()

        serving = asyncio.get_running_loop().create_task(not_zeromq())
        with pytest.raises(ZmtpError) as plain:
            await Connection.open(f"tcp://127.0.0.1:{port}", "SUB", max_frame=4096, max_parts=4, seconds=5)
        await serving
        with pytest.raises(ZmtpError) as wrong:
            await Connection.open(f"tcp://127.0.0.1:{other}", "SUB", max_frame=4096, max_parts=4, seconds=5)
        return str(plain.value), str(wrong.value)

    plain, wrong = asyncio.run(scenario())
    assert "not a ZeroMQ socket" in plain and "cannot talk to the peer's b'PULL' socket" in wrong
    listener.close()
    pull.close(0)


@pytest.mark.parametrize("flood", ["pings", "commands"])
def test_a_peer_sending_commands_instead_of_messages_is_cut_off(flood: str) -> None:
    """Sweep 25: a publisher sending PINGs and never reading the PONGs grew the gateway ~200 MB a second, and one
    sending small commands between messages held the event loop (another key's p50 from 21 to 557 ms). More than
    MAX_COMMANDS between two messages end the connection; a PONG is owed only while the last one is sent."""
    from gateway.kvcache.zmtp import GREETING, MAX_COMMANDS, _command, _frame

    port = free_port_block(1)
    listener = socket.create_server(("127.0.0.1", port))
    ping = _frame(0x04, b"\x04PING" + b"\x00\x10" + b"c" * 200_000)
    junk = _frame(0x04, b"\x03FOO")

    async def scenario() -> str:
        def publisher() -> int:  # (in a thread: its sends block)
            connection, _ = listener.accept()
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            connection.sendall(GREETING + _frame(0x04, _command(b"READY", {b"Socket-Type": b"PUB"})))
            sent = 0
            connection.settimeout(10)
            try:
                for _ in range(10 * MAX_COMMANDS):
                    connection.sendall(ping if flood == "pings" else junk * 1000)
                    sent += 1
                while connection.recv(65536):  # (held open, unread by intent, until the gateway closes it)
                    pass
            except OSError:  # (the gateway cut it off)
                pass
            connection.close()
            return sent

        sending = asyncio.get_running_loop().run_in_executor(None, publisher)
        sub = await Connection.open(f"tcp://127.0.0.1:{port}", "SUB", max_frame=1 << 20, max_parts=4, seconds=5)
        await sub.send([b"\x01"])
        try:
            return await refusal(sub)
        finally:
            await sending

    why = asyncio.run(scenario())
    # (a PING past 4 KiB is refused at its header, before its body is read; small commands, past MAX_COMMANDS in a
    # second)
    expected = f"more than {MAX_COMMANDS} commands" if flood != "pings" else "a frame of 200007 bytes, more than 4096"
    assert expected in why
    listener.close()
