"""The subscriber against a publisher speaking the engines' scheme over real ZMQ sockets on loopback: history
replayed on start, gaps filled by replay, a lost history and a restart reset the index, silence and a health
epoch change take the stream out of routing."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.engines.registry import ENGINES
from gateway.kvcache.contexts import close_context, open_context
from gateway.kvcache.index import request_keys
from gateway.kvcache.subscriber import EventHub, EventStream, StreamSettings
from gateway.pool.backend import Backend
from gateway.pool.state import Health, Probe
from tests.waiting import until, until_true

TOKENS = list(range(64))
TS = 1.7e9  # the batches' timestamps: the publisher's own, made distinct by counting


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}


class Publisher:
    """PUB + ROUTER replay with a bounded buffer, numbering batches from 0 (a restart numbers again)."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer_steps: int = 100, replay: bool = True) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_steps = buffer_steps
        self.seq = 0
        self.made = 0  # batches made, restarts or not: each its own timestamp (a restart's seq 0 is not the old one)
        self._task = asyncio.get_running_loop().create_task(self._serve()) if replay else None

    async def publish(self, *events: dict[str, object], send: bool = True) -> None:
        payload = msgpack.packb([TS + self.made, list(events), 0])
        seq = self.seq
        self.seq += 1
        self.made += 1
        self.buffer = ([*self.buffer, (seq, payload)])[-self.buffer_steps:]
        if send:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        self.seq = 0
        self.buffer = []

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.router.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


def make_backend() -> Backend:
    backend = Backend("v", "vllm", "http://127.0.0.1:1", spec=ENGINES["vllm"])
    backend.record_probe(Probe(Health.READY))
    return backend


def held(stream: EventStream, tokens: list[int] = TOKENS) -> int:
    return int(stream.index.match(request_keys(tokens, 16)) * 16)


class Turns:
    """Counts the turns the event loop gives a task beside the code under test (while in its ``async with``)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Turns:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)


def run(scenario: Callable[[zmq.asyncio.Context, Publisher, EventHub], Awaitable[None]],
        kind: type[Publisher] | None = None, **publisher: object) -> None:
    async def main() -> None:
        ctx = open_context(zmq.asyncio.Context)  # (a socket a failed scenario left open must not hang it)
        pub = (kind or Publisher)(ctx, **publisher)  # type: ignore[arg-type]
        hub = EventHub()
        try:
            await scenario(ctx, pub, hub)
        finally:
            await hub.stop()
            pub.close()
            close_context(ctx)

    asyncio.run(asyncio.wait_for(main(), 20))


def subscribe(hub: EventHub, pub: Publisher, backend: Backend, **settings: float) -> EventStream:
    hub.sync([(backend, StreamSettings(pub.endpoint, pub.replay_endpoint, **settings))])  # type: ignore[arg-type]
    return hub.streams[backend.name]


def test_history_is_replayed_on_start_and_live_batches_follow() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        await pub.publish(stored([1, 2], None, TOKENS[:32]))  # before the gateway subscribed
        backend = make_backend()
        stream = subscribe(hub, pub, backend)
        await until(lambda: stream.state == "live", "the stream live")
        assert held(stream) == 32 and hub.live_index(backend) is stream
        await pub.publish(stored([3, 4], 2, TOKENS[32:]))
        await until(lambda: held(stream) == 64, "64 tokens held")
        assert stream.counters.replays["complete"] == 1 and stream.counters.gaps == 0

    run(scenario)


def test_a_gap_is_filled_by_replay() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        await pub.publish(stored([1], None, TOKENS[:16]))
        await pub.publish(stored([2], 1, TOKENS[16:32]), send=False)  # lost on the way
        await pub.publish(stored([3], 2, TOKENS[32:48]))
        await until(lambda: held(stream) == 48, "48 tokens held")
        assert stream.counters.gaps == 1 and stream.counters.replays["complete"] == 2  # start + the gap
        assert stream.live()

    run(scenario)


def test_a_gap_beyond_the_replay_buffer_resets_and_waits_out_the_history_window() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend(), history_seconds=60)
        await until(lambda: stream.state == "live", "the stream live")
        await pub.publish(stored([1], None, TOKENS[:16]))
        for _ in range(3):  # the buffer keeps 2: the first missed batch is gone
            await pub.publish({"type": "AllBlocksCleared"}, send=False)
        await pub.publish(stored([9], None, TOKENS[:16]))
        await until(lambda: stream.counters.resets["history_lost"] == 1, "a reset for the history lost")
        assert not stream.live() and stream.counters.replays["partial"] == 1
        assert held(stream) == 16  # rebuilt from what came after
        ends = stream._partial_until  # (the history window's end: the moment routing is told)
        assert not stream.live(ends - 0.01) and stream.live(ends)

    run(scenario, buffer_steps=2)


def test_a_restarted_engine_numbering_from_zero_clears_the_index() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        await pub.publish(stored([1, 2], None, TOKENS[:32]))
        await pub.publish(stored([3], 2, TOKENS[32:48]))
        await until(lambda: held(stream) == 48, "48 tokens held")
        pub.restart()
        await pub.publish(stored([7], None, TOKENS[:16]))
        await until(lambda: stream.counters.resets["restart"] == 1, "a reset for the restart")
        assert held(stream) == 16 and stream.live()

    run(scenario)


def test_silence_after_requests_that_must_store_blocks_takes_the_stream_out() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend(), silence_seconds=0.2)
        await until(lambda: stream.state == "live", "the stream live")
        sent = 1000.0  # (the times routing tells the stream, here of a clock of the test's)
        stream.expect_blocks(sent)
        assert stream.live(sent + 0.1)
        assert not stream.live(sent + 0.25) and stream.state == "silent"
        await pub.publish(stored([1], None, TOKENS[:16]))
        await until(stream.live, "the stream live again")

    run(scenario)


def test_a_backend_coming_back_up_resyncs_from_the_replay_buffer() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        backend = make_backend()
        stream = subscribe(hub, pub, backend)
        await until(lambda: stream.state == "live", "the stream live")
        await pub.publish(stored([1, 2], None, TOKENS[:32]))
        await until(lambda: held(stream) == 32, "32 tokens held")
        backend.record_probe(Probe(Health.DOWN))
        backend.record_probe(Probe(Health.READY))  # epoch moves: not trusted until resynced
        assert not stream.live()
        await until(lambda: stream.counters.resets["epoch"] == 1 and stream.live(), "resynced after the epoch")
        assert held(stream) == 32  # it only flapped: the replay restored everything

    run(scenario)


def test_without_a_replay_socket_the_first_batch_starts_a_partial_stream() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend(), history_seconds=60)
        await until(lambda: stream.state == "partial", "the stream partial")

        async def published() -> bool:  # (again until one arrives: the subscription may not have reached it yet)
            await pub.publish(stored([1], None, TOKENS[:16]))
            return held(stream) == 16

        await until_true(published, "16 tokens held")
        assert not stream.live()
        ends = stream._partial_until
        assert not stream.live(ends - 0.01) and stream.live(ends)

    run(scenario, replay=False)


def test_undecodable_messages_are_counted_and_skipped() -> None:
    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        await pub.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])
        await pub.publish(stored([1], None, TOKENS[:16]))
        await until(lambda: held(stream) == 16, "16 tokens held")
        assert stream.counters.decode_errors == 1

    run(scenario)


def test_a_huge_batch_is_decoded_and_applied_a_few_thousand_blocks_at_a_time() -> None:
    """Sweep 8: one 27 MB batch held the event loop 5 s, decoded and applied whole. Here a 60,000-event batch
    is taken a step at a time: a task beside it runs many times before the batch is in."""
    from gateway.kvcache.wire import PACE

    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        async with Turns() as turns:
            many = [stored([1000 + i], None, TOKENS[:16]) for i in range(60_000)]
            await pub.publish(*many, stored([1], None, TOKENS[:16]))
            await until(lambda: stream.counters.events == 60_001, "the huge batch applied", within=15)
            # decoding and applying each paused every PACE blocks (an event counts 1 plus its blocks)
            assert turns.count >= 2 * (2 * 60_000) // PACE, turns.count
            assert held(stream) == 16

    run(scenario)


class EndlessReplay(Publisher):
    """Answers a replay with batches of ``blocks`` blocks each, numbered on and on, and never its end."""

    blocks = 1
    medium = "GPU"
    pause = 0.0  # seconds between two batches

    async def _serve(self) -> None:
        assert self.router is not None
        frames = await self.router.recv_multipart()
        seq = 0
        while True:
            hashes = list(range(seq * self.blocks + 10, (seq + 1) * self.blocks + 10))
            event = stored(hashes, None, TOKENS[:16] * self.blocks) | {"medium": self.medium}
            payload = msgpack.packb([TS + seq, [event], 0])
            await self.router.send_multipart([frames[0], b"", b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            # (0: a loop turn, as a send to a peer that left completes at once: let the gateway run)
            await asyncio.sleep(self.pause)  # real time: the pace, against the subscriber's REPLAY_MAX_SECONDS


@pytest.mark.parametrize(("blocks", "medium", "bound"), [(1, "GPU", "batches"), (2000, "GPU", "work"),
                                                        (1, "x" * 1000, "bytes"), (1, "x" * 100_000, "bytes"),
                                                        (1, "GPU", "seconds")],
                         ids=["many-batches", "many-blocks", "long-strings", "too-long-strings", "slow-batches"])
def test_a_replay_that_never_ends_is_refused_at_its_bound_and_the_live_stream_goes_on(
        monkeypatch: pytest.MonkeyPatch, blocks: int, medium: str, bound: str) -> None:
    """Sweep 16: a replay was kept whole until its end marker, each batch extending its deadline: an engine
    answering one endlessly grew the gateway ~120 MB a second for as long as it sent. Sweep 17: batches of one
    block with a 32 MiB ``medium`` each passed the bounds in batches and blocks. Past REPLAY_MAX_BATCHES batches,
    REPLAY_MAX_WORK blocks, REPLAY_MAX_BYTES of payload or REPLAY_MAX_SECONDS (each small here, the others out
    of reach) it is refused: what came before is unknown, the stream partial, and live batches are applied as ever."""
    from gateway.kvcache import subscriber

    monkeypatch.setattr(subscriber, "REPLAY_MAX_BATCHES", 50 if bound == "batches" else 10**6)
    monkeypatch.setattr(subscriber, "REPLAY_MAX_WORK", 10_000 if bound == "work" else 10**9)
    monkeypatch.setattr(subscriber, "REPLAY_MAX_BYTES", 200_000 if bound == "bytes" else 10**9)
    monkeypatch.setattr(subscriber, "REPLAY_MAX_SECONDS", 1.0 if bound == "seconds" else 10**6)
    monkeypatch.setattr(EndlessReplay, "blocks", blocks)
    monkeypatch.setattr(EndlessReplay, "medium", medium)
    # (sweep 18: a batch every 1.5 s renews the replay's timeout: one replay could last 10,000 of them)
    monkeypatch.setattr(EndlessReplay, "pause", 0.05 if bound == "seconds" else 0.0)

    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend(), history_seconds=60)
        await until(lambda: stream.counters.replays["failed"] == 1, "the replay refused")
        assert stream.state == "partial" and held(stream) == 0
        await pub.publish(stored([1], None, TOKENS[:16]))
        await until(lambda: held(stream) == 16, "16 tokens held")

    run(scenario, EndlessReplay)


def test_live_messages_past_the_backlog_bound_are_dropped_and_the_hole_is_filled_by_replay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep 16: ZeroMQ's queue held whatever an engine published faster than it was applied, up to 100,000
    messages of up to 64 MiB (4.5 GB, growing). What waits is bounded in bytes now (small here): a message past
    it is dropped unread, and the hole it leaves is filled by a replay like any message missed."""
    from gateway.kvcache import subscriber

    monkeypatch.setattr(subscriber, "BACKLOG_BYTES", 200_000)

    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        gate = asyncio.Event()  # (the index applies nothing until it opens: what arrives meanwhile waits)
        apply = stream._on_message

        async def held_back(frames: list[bytes]) -> None:
            await gate.wait()
            await apply(frames)

        stream._on_message = held_back  # type: ignore[method-assign]
        for i in range(60):  # ~45 KB each: no more than four wait together
            await pub.publish(stored(list(range(10_000 + 2000 * i, 12_000 + 2000 * i)), None, [99] * 16 * 2000))
        await until(lambda: stream.counters.dropped >= 50, "50 messages dropped")
        gate.set()
        await pub.publish(stored([1], None, TOKENS[:16]))
        await until(lambda: held(stream) == 16, "16 tokens held", within=10)
        assert stream.counters.dropped > 0 and stream.counters.gaps > 0
        assert stream.counters.replays["complete"] >= 2 and stream.counters.batches == 61, stream.counters

    run(scenario)


def test_a_flood_of_small_messages_leaves_the_event_loop_to_everyone_else() -> None:
    """Sweep 17: a waiting message is handed over at once (awaiting it never suspends), so a publisher of ~200,000
    junk messages a second held the event loop for as long as it sent (one request waited 18 s). The receive and
    the apply each give the loop a turn after every message: a task beside them runs at least that often."""

    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        stream = subscribe(hub, pub, make_backend())
        await until(lambda: stream.state == "live", "the stream live")
        async with Turns() as turns:
            for _ in range(5000):
                pub.pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"], flags=zmq.NOBLOCK)
            # (the loop held while ZeroMQ's own thread queues them all for the subscriber, as a publisher faster
            # than the gateway does; past its high-water mark the publisher drops some)
            time.sleep(0.5)  # noqa: ASYNC251  real time: ZeroMQ's thread queueing the flood, the loop held
            before = turns.count

            async def behind_them() -> bool:  # a batch after the flood applied: every message before it was read
                await pub.publish(stored([1], None, TOKENS[:16]))  # (again until one is not dropped)
                return held(stream) == 16

            await until_true(behind_them, "a batch sent after the flood applied")
            seen = stream.counters.decode_errors
            assert seen >= 100 and turns.count - before >= seen, (seen, turns.count - before)  # a turn after each one

    run(scenario)


def test_a_message_of_more_parts_than_a_batch_has_ends_the_subscription_and_a_replay_fills_the_hole() -> None:
    """Sweep 18: a message of a million one-byte parts was read to its end to be dropped, ~17 s of the gateway's
    CPU each, while ZeroMQ queued the next. The subscriber now reads no further than a batch's parts: it closes
    the subscription there (what ZeroMQ queued goes with it), subscribes again, and a replay fills the hole."""
    from zmq.utils.monitor import recv_monitor_message

    async def scenario(ctx: zmq.asyncio.Context, pub: Publisher, hub: EventHub) -> None:
        monitor = pub.pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            stream = subscribe(hub, pub, make_backend())
            await until(lambda: stream.state == "live", "the stream live")
            assert (await recv_monitor_message(monitor))["event"] == zmq.EVENT_ACCEPTED
            await pub.pub.send_multipart([b""] * 200_000)
            await pub.publish(stored([1], None, TOKENS[:16]))  # (behind it: lost with the subscription)
            assert (await recv_monitor_message(monitor))["event"] == zmq.EVENT_DISCONNECTED  # the gateway hung up
            assert stream.counters.decode_errors == 1
            assert (await recv_monitor_message(monitor))["event"] == zmq.EVENT_ACCEPTED  # and subscribed again
            await until(lambda: held(stream) == 16, "16 tokens held", within=10)  # the batch after it, replayed
            await pub.publish(stored([2], 1, TOKENS[16:32]))
            await until(lambda: held(stream) == 32, "32 tokens held")
            assert stream.counters.decode_errors == 1 and stream.state == "live"
        finally:
            pub.pub.disable_monitor()
            monitor.close(0)

    run(scenario)
