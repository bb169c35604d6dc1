"""One subscriber per engine that publishes KV events: it keeps that engine's :class:`EventIndex` whole, or
says it is not.

The stream is trusted only while it is known complete. Sequence numbers say when it is not:

* a batch after a hole (``seq`` ahead of the next expected): the missed batches are asked for on the replay
  socket and applied in order; if the engine no longer buffers them (or has no replay socket), the index is
  cleared and counted *partial* for ``history_seconds`` while new events rebuild it;
* a batch behind (``seq`` already seen, with another timestamp): the engine restarted and numbers from 0
  again, and its cache is empty: the index is cleared and rebuilt from the new process's history (replayed
  from seq 0 when the engine still buffers it);
* the backend came back up (its health epoch moved): the same, since a restart may have published nothing
  yet; a backend that only flapped replays its whole buffered history and loses nothing;
* silence: requests that must make the engine store new blocks were sent ``silence_seconds`` ago and no
  batch has come since (a dead publisher, or a subscription the network dropped).

On start the subscriber replays from seq 0 too, so a gateway (re)started next to a running engine learns what
it already holds, as far as the engine's replay buffer reaches (vLLM and SGLang keep 10,000 batches).

While a stream is not live, routing falls back to the approximate index for that backend alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from gateway.clock import SYSTEM, Clock
from gateway.kvcache.index import MAX_NODES, EventIndex
from gateway.kvcache.wire import (
    MAX_PAYLOAD_BYTES,
    Batch,
    WireError,
    batch_steps,
    message_parts,
    replay_parts,
    work,
)
from gateway.kvcache.zmtp import Connection, ZmtpError
from gateway.pool.backend import Backend
from gateway.tasks import cancel_and_wait

T = TypeVar("T")

log = logging.getLogger("gateway.kvcache")

State = Literal["connecting", "live", "partial", "silent", "resyncing"]
RECENT_SEQS = 4096  # applied batches remembered (seq -> ts) to tell a duplicate from a restart
# what one replay may bring before it is applied: the engines buffer 10,000 batches (vLLM's replay buffer), and
# the index holds at most MAX_NODES blocks; a replay past either is no history this gateway can use (it is
# refused, as one that never ends: an engine answering a replay endlessly grew the gateway ~120 MB a second
# for as long as it went on, sweep 16)
REPLAY_MAX_BATCHES = 10_000
REPLAY_MAX_WORK = MAX_NODES
# bytes of live messages received and not yet applied: an engine publishing faster than they are applied (each
# a valid batch of half a million blocks) had libzmq's queue hold 4.5 GB (sweep 16). A message past this is
# dropped (dropping 1.3 GB/s through Python held the event loop seconds, sweep 17); the hole in the sequence it
# leaves is filled by a replay, or the stream goes partial, as for any message missed.
BACKLOG_BYTES = 2 * MAX_PAYLOAD_BYTES
# a replay's payloads in all (what work() does not count, a long string in each event, grew a replay of one-block
# batches by 32 MiB each: sweep 17)
REPLAY_MAX_BYTES = 2 * MAX_PAYLOAD_BYTES
# parts of a live message: topic, sequence number and payload (and one more, for what a release adds). A message
# of more breaks the scheme: the subscription is closed at its fifth part's header, before the part is read, and
# opened again after the session's backoff, the hole filled by a replay (read to its end, a million one-byte parts
# cost ~17 s of CPU, sweep 18; held by libzmq until the last, 40 parts of 48 MiB took 2.1 GB, sweep 24).
MAX_PARTS = 4
# the most bytes one part may have (a payload past MAX_PAYLOAD_BYTES is refused when decoded anyway): the
# connection is closed at the part's header, before its body is read (gateway.kvcache.zmtp)
MAX_FRAME_BYTES = MAX_PAYLOAD_BYTES + 1024
CONNECT_SECONDS = 5.0  # to connect and complete ZeroMQ's handshake
RECONNECT_SECONDS = 0.1  # after the publisher closed the connection (doubled while it stays down, to 2 s)
MESSAGE_FLOOR = 1024  # bytes a message counts in the backlog at least (empty ones took no room: sweep 18)
REPLAY_MAX_SECONDS = 60.0  # one replay in all, however its batches keep coming (each renews replay_timeout)


@dataclass(frozen=True, slots=True)
class StreamSettings:
    endpoint: str  # tcp://host:port of the engine's PUB socket
    replay_endpoint: str | None = None  # its ROUTER replay socket
    topic: str = ""
    block_size: int | None = None  # None: as the first event says
    silence_seconds: float = 10.0
    history_seconds: float = 60.0
    replay_timeout: float = 2.0


@dataclass(slots=True)
class StreamCounters:
    batches: int = 0
    events: int = 0
    skipped_events: int = 0
    decode_errors: int = 0
    dropped: int = 0  # live messages dropped unread: the backlog waiting to be applied was at its bound
    gaps: int = 0
    replays: dict[str, int] = field(default_factory=lambda: {"complete": 0, "partial": 0, "failed": 0})
    resets: dict[str, int] = field(default_factory=lambda: {"restart": 0, "epoch": 0, "history_lost": 0,
                                                             "cleared": 0})


class EventStream:
    """The subscriber of one backend. ``live()`` says whether routing may trust ``index`` now."""

    def __init__(self, backend: Backend, settings: StreamSettings, clock: Clock = SYSTEM) -> None:
        self.backend = backend
        self.clock = clock
        self.settings = settings
        self.index = EventIndex(settings.block_size)
        self.counters = StreamCounters()
        self.state: State = "connecting"
        self._next_seq = 0
        self._recent: OrderedDict[int, float] = OrderedDict()  # seq -> ts of applied batches
        self._epoch = backend.epoch
        self._partial_until = 0.0
        self._expecting_since: float | None = None  # a request that must store new blocks was sent
        self.last_batch_at: float | None = None
        self._dealer: Connection | None = None
        self._connected = False  # the current session got through its handshake
        self._task: asyncio.Task[None] | None = None

    # -- read by routing ------------------------------------------------------------------------------------------
    def live(self, now: float | None = None) -> bool:
        if self.state not in ("live", "partial", "silent"):
            return False
        if self.backend.epoch != self._epoch:
            return False  # came back up: the session loop resyncs
        now = self.clock.monotonic() if now is None else now
        if self.state == "partial":
            if now < self._partial_until:
                return False
            self.state = "live"
        expecting = self._expecting_since
        if expecting is not None and now - expecting > self.settings.silence_seconds:
            self.state = "silent"
            return False
        return True

    def expect_blocks(self, now: float | None = None) -> None:
        """A request was sent that will make the engine store blocks it does not hold: events are due."""
        if self._expecting_since is None:
            self._expecting_since = self.clock.monotonic() if now is None else now

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"kv-events:{self.backend.name}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait([task])
        self._close_dealer()

    async def _run(self) -> None:
        backoff, lost = 0.5, RECONNECT_SECONDS
        while True:
            try:
                self._connected = False
                await self._session()
            except asyncio.CancelledError:
                raise
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                # the publisher closed, restarted or is not up yet: connect again soon, as ZeroMQ's own sockets do
                # every 100 ms (the restarted engine's first batches tell it restarted), more slowly while it is down
                if self._connected:  # (a session that got through its handshake: this outage is a new one)
                    lost = RECONNECT_SECONDS
                (log.info if lost == RECONNECT_SECONDS else log.debug)(  # (once an outage, not every 2 s of it)
                    "kv events from %s: %r; connecting again", self.backend.name, exc)
                self.state = "connecting"
                await self.clock.sleep(lost)
                lost = min(lost * 2, 2.0)
            except Exception as exc:  # a broken message: start over (the index is rebuilt from a replay), more
                # slowly each time (a publisher breaking every session is asked less and less often)
                log.warning("kv events from %s: %s", self.backend.name, exc)
                self.state = "connecting"
                await self.clock.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _session(self) -> None:
        self._close_dealer()  # (a new session asks for history on a new connection: the engine may have restarted)
        sub = await Connection.open(self.settings.endpoint, "SUB", max_frame=MAX_FRAME_BYTES, max_parts=MAX_PARTS,
                                    seconds=CONNECT_SECONDS)
        self._connected = True
        # received at once, applied in turn: what waits is held here, bounded in bytes (see BACKLOG_BYTES); the
        # connection is read one message at a time, so what the publisher sends beyond waits in its own queue
        backlog: collections.deque[tuple[list[bytes], int]] = collections.deque()
        held = 0
        arrived = asyncio.Event()

        async def receive() -> None:
            # a turn for everyone else after each message: a publisher of ~200,000 tiny messages a second held the
            # event loop for as long as it sent (sweep 17). A message of more parts than MAX_PARTS, or a part of
            # more than MAX_FRAME_BYTES, ends the session where its header says so.
            nonlocal held
            while True:
                try:
                    frames = await sub.recv()
                except ZmtpError as exc:
                    self.counters.decode_errors += 1
                    raise ValueError(f"{exc}: subscribing again") from None
                size = max(MESSAGE_FLOOR, sum(len(f) for f in frames))
                if held + size > BACKLOG_BYTES:
                    self.counters.dropped += 1
                else:
                    backlog.append((frames, size))
                    held += size
                    arrived.set()
                await asyncio.sleep(0)

        reader: asyncio.Task[None] | None = None
        try:
            await sub.send([b"\x01" + self.settings.topic.encode()])  # (a subscription, as ZMTP 3.0 writes one)
            reader = asyncio.create_task(receive(), name=f"kv-events-in:{self.backend.name}")
            reader.add_done_callback(lambda _: arrived.set())  # (its end wakes the loop below)
            await asyncio.sleep(0.05)  # let the subscription reach the publisher before asking for history
            before = self._next_seq
            await self._resync(None)
            if before > 0 and 0 <= self._next_seq < before and self.state == "live":
                # (its whole history numbers less than what was seen before this connection: it restarted while
                # the connection was down; the index was rebuilt from the new process's history already)
                self.counters.resets["restart"] += 1
            while True:
                if reader.done():
                    reader.result()  # (a socket error or a broken message: raised, and the session starts over)
                if self.backend.epoch != self._epoch:
                    await self._resync("epoch")
                if not backlog:
                    arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrived.wait(), 0.5)
                    continue
                frames, size = backlog.popleft()
                held -= size
                await self._on_message(frames)
                await asyncio.sleep(0)  # (a message that fails to decode, or a tiny batch, never pauses otherwise)
        finally:
            await cancel_and_wait([reader] if reader is not None else [])
            sub.close()

    # -- the stream -----------------------------------------------------------------------------------------------
    async def _on_message(self, frames: list[bytes]) -> None:
        try:
            batch = await _paced(batch_steps(*message_parts(frames)))
        except WireError as exc:
            self.counters.decode_errors += 1
            log.debug("kv events from %s: undecodable message: %s", self.backend.name, exc)
            return
        seq = batch.seq
        if seq == self._next_seq or self._next_seq < 0:  # (< 0: no history to continue, this one starts it)
            await self._apply(batch)
        elif seq > self._next_seq:
            self.counters.gaps += 1
            await self._fill_gap(batch)
        elif self._recent.get(seq) == batch.ts:
            return  # already applied (it came by replay too)
        else:  # numbered again from the start: the engine restarted
            self._reset("restart")
            if seq == 0:
                await self._apply(batch)
            else:
                await self._replay_from_zero()

    async def _fill_gap(self, batch: Batch) -> None:
        missed = await self._replay(self._next_seq)
        if missed is not None:
            for replayed in missed:
                if replayed.seq == self._next_seq:
                    await self._apply(replayed)
        if self._next_seq == batch.seq:
            self.counters.replays["complete"] += 1
            await self._apply(batch)
            return
        if self._next_seq > batch.seq:  # the replay reached past it
            self.counters.replays["complete"] += 1
            return
        self.counters.replays["failed" if missed is None else "partial"] += 1
        self._reset("history_lost")
        self._lost_history()
        await self._apply(batch)

    async def _resync(self, reason: Literal["epoch"] | None) -> None:
        """Rebuild the index from the engine's replay buffer (start, or the backend came back up)."""
        self.state = "resyncing"
        self._epoch = self.backend.epoch
        if reason is not None:
            self._reset(reason)
        await self._replay_from_zero()

    async def _replay_from_zero(self) -> None:
        self.index.clear()
        self._next_seq = 0
        batches = await self._replay(0)
        if batches is None:  # no replay socket or no answer: what came before is unknown
            self.counters.replays["failed"] += 1 if self.settings.replay_endpoint else 0
            self._lost_history()
            self._next_seq = -1  # the first live batch starts the stream, whatever its number
            self.state = "partial"
            return
        if batches and batches[0].seq != 0:
            self.counters.replays["partial"] += 1
            self._lost_history()
            self._next_seq = batches[0].seq
        else:
            self.counters.replays["complete"] += 1
            self.state = "live"
        for batch in batches:
            if batch.seq == self._next_seq:
                await self._apply(batch)

    async def _apply(self, batch: Batch) -> None:
        await _paced(self.index.apply_steps(batch))
        self._next_seq = batch.seq + 1
        recent = self._recent
        recent[batch.seq] = batch.ts
        if len(recent) > RECENT_SEQS:
            recent.popitem(last=False)
        c = self.counters
        c.batches += 1
        c.events += len(batch.events)
        c.skipped_events += batch.skipped
        self.last_batch_at = self.clock.monotonic()
        self._expecting_since = None
        if self.state == "silent":
            self.state = "live"

    def _reset(self, reason: str) -> None:
        self.counters.resets[reason] = self.counters.resets.get(reason, 0) + 1
        self.index.clear()
        self._recent.clear()
        self._expecting_since = None

    def _lost_history(self) -> None:
        self.state = "partial"
        self._partial_until = self.clock.monotonic() + self.settings.history_seconds

    # -- replay ---------------------------------------------------------------------------------------------------
    async def _replay(self, start: int) -> list[Batch] | None:
        """Every batch the engine still buffers from ``start`` on, in order; None when it cannot say."""
        endpoint = self.settings.replay_endpoint
        if endpoint is None:
            return None
        try:
            if self._dealer is None:
                self._dealer = await Connection.open(endpoint, "DEALER", max_frame=MAX_FRAME_BYTES,
                                                     max_parts=MAX_PARTS, seconds=self.settings.replay_timeout)
            dealer = self._dealer
            async with asyncio.timeout(self.settings.replay_timeout):  # (a peer that reads nothing: no wait for it)
                await dealer.send([b"", max(0, start).to_bytes(8, "big")])
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ZmtpError) as exc:  # (no replay socket: no history)
            log.debug("kv events from %s: no replay: %r", self.backend.name, exc)
            self._close_dealer()
            return None
        batches: list[Batch] = []
        brought = size = 0  # the replay's work so far (wire.work: blocks and tokens), and its payloads' bytes
        now = self.clock.monotonic
        deadline = now() + self.settings.replay_timeout
        ends = now() + REPLAY_MAX_SECONDS
        while True:
            left = min(deadline, ends) - now()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(dealer.recv(), left)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ZmtpError):  # (ZmtpError: past a bound)
                self._close_dealer()  # a late answer must not be read as the next one's
                return None
            try:
                parts = replay_parts(message)
                if parts is None:
                    return batches
                size += len(parts[1])
                if size > REPLAY_MAX_BYTES:
                    break
                batch = await _paced(batch_steps(*parts))
            except WireError:
                self.counters.decode_errors += 1
                continue
            batches.append(batch)
            brought += sum(work(event) for event in batch.events)
            if len(batches) > REPLAY_MAX_BATCHES or brought > REPLAY_MAX_WORK:
                break
            deadline = now() + self.settings.replay_timeout  # a long history keeps coming
        log.warning("backend %s: its KV-event replay brought more than %d batches, %d blocks or %d bytes; refused",
                    self.backend.name, REPLAY_MAX_BATCHES, REPLAY_MAX_WORK, REPLAY_MAX_BYTES)
        self._close_dealer()  # (what else it sends is not read as the next replay's answer)
        return None

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close()
            self._dealer = None


async def _paced(steps: Generator[None, None, T]) -> T:
    """Run ``steps`` to its end, letting the event loop run at each of its pauses."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result: T = done.value
            return result
        await asyncio.sleep(0)


class EventHub:
    """The event streams of every backend configured with ``kv_events``. Routing asks ``live_index``."""

    def __init__(self, clock: Clock = SYSTEM) -> None:
        self.clock = clock  # what the streams' windows, replay deadlines and backoff read
        self.streams: dict[str, EventStream] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def live_index(self, backend: Backend, now: float | None = None) -> EventStream | None:
        stream = self.streams.get(backend.name)
        if stream is None or stream.backend is not backend or not stream.live(now):
            return None
        return stream

    @property
    def enabled(self) -> bool:
        return bool(self.streams)

    def sync(self, wanted: Iterable[tuple[Backend, StreamSettings]]) -> None:
        """Subscribe to each (backend, settings) not yet followed; stop following backends no longer listed."""
        wanted = list(wanted)
        names = {b.name for b, _ in wanted}
        for name in [n for n in self.streams if n not in names]:
            self._retire(self.streams.pop(name))
        for backend, settings in wanted:
            old = self.streams.get(backend.name)
            if old is not None and old.backend is backend and old.settings == settings:
                continue
            if old is not None:
                self._retire(old)
            stream = self.streams[backend.name] = EventStream(backend, settings, self.clock)
            stream.start()

    def _retire(self, stream: EventStream) -> None:
        task = asyncio.get_running_loop().create_task(stream.stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def stop(self) -> None:
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            await stream.stop()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
