"""The step scheduler: one timer per engine step drives every running sequence of a server.

Each step: admit waiting sequences (sequence limit, KV capacity in tokens, the prefix cache's own rule), spend
the step's prefill budget on prompts (cached tokens are skipped), then sleep the step's duration
(``Profile.decode_seconds(decoding batch, their context)`` plus each prompt chunk's ``Profile.prefill_seconds``
and, when any prompt was processed, ``prefill_base_s``; all over ``time_scale``) and hand every decoding sequence one
token; a sequence whose prompt finished prefilling gets its first token at the end of that step.

Timestamps on sequences are on a *simulated* clock that advances by exactly each step's modelled duration
(and catches up with the wall clock, times ``time_scale``, when idle), so reported timings follow the model
even when the host is slow; wall-clock pacing is best effort.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import deque
from typing import Protocol

from gateway.sim.prefix_cache import PrefixCache
from gateway.sim.profiles import Profile
from gateway.sim.stats import Latencies, Stats

log = logging.getLogger("gateway.sim")


class Sink(Protocol):
    def on_token(self, seq: Sequence) -> None:
        """``seq.generated`` tokens are out; the newest is ``seq.output[seq.generated - 1]``."""

    def on_finish(self, seq: Sequence) -> None: ...


class ContextTooLong(ValueError):
    pass


class Sequence:
    """One generation: its prompt ids, its planned output pieces, and its progress and timestamps."""

    __slots__ = ("cached", "finish_reason", "generated", "id", "output", "output_ids", "prefill_left", "prompt",
                 "rank", "salt", "sink", "slot", "state", "t_arrival", "t_finish", "t_first", "t_last",
                 "t_scheduled")

    def __init__(self, prompt: list[int], output: list[str], output_ids: list[int], finish_reason: str,
                 sink: Sink) -> None:
        self.id = 0
        self.prompt = prompt
        self.output = output
        self.output_ids = output_ids
        self.finish_reason = finish_reason
        self.sink = sink
        self.slot: int | None = None  # the engine slot the request names (llama.cpp id_slot), if any
        self.salt: str | None = None  # its cache salt (vLLM's and SGLang's cache_salt), if any
        self.rank = 0  # waiting order: lower first, arrival order within a rank (priority scheduling)
        self.state = "new"  # new -> waiting -> prefill -> decode -> done | aborted
        self.cached = 0
        self.prefill_left = 0
        self.generated = 0
        self.t_arrival = self.t_scheduled = self.t_first = self.t_last = self.t_finish = 0.0

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class Scheduler:
    def __init__(self, profile: Profile, cache: PrefixCache, time_scale: float, stats: Stats,
                 lat: Latencies) -> None:
        self.profile = profile
        self.cache = cache
        self.scale = time_scale
        self.stats = stats
        self.lat = lat
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.kv_used = 0
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self.sim_now = 0.0

    # -- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests --------------------------------------------------------------------------------------------
    def check(self, prompt_len: int, output_len: int) -> None:
        limit = min(self.profile.context_length, self.profile.kv_capacity_tokens)
        if prompt_len + output_len > limit:
            raise ContextTooLong(f"{prompt_len} prompt + {output_len} output tokens > {limit}")

    def submit(self, seq: Sequence) -> None:
        seq.id = next(self._ids)
        seq.state = "waiting"
        seq.t_arrival = self.now()
        waiting = self.waiting
        if not waiting or waiting[-1].rank <= seq.rank:
            waiting.append(seq)
        else:  # ahead of every waiting sequence of a higher rank, behind those of its own
            at = len(waiting)
            while at > 0 and waiting[at - 1].rank > seq.rank:
                at -= 1
            waiting.insert(at, seq)
        self.stats.waiting = len(self.waiting)
        self.stats.peak_requests = max(self.stats.peak_requests, len(self.waiting) + len(self.running))
        self._wake.set()

    def abort(self, seq: Sequence, cancelled: bool = True) -> None:
        """Stop a sequence and free its slot/KV; ``cancelled`` counts it as a client cancellation."""
        if seq.state in ("done", "aborted", "new"):
            return
        if seq.state == "waiting":
            self.waiting.remove(seq)
        else:
            self._retire(seq)
        seq.state = "aborted"
        if cancelled:
            self.stats.cancelled += 1
            self.stats.last_cancel_time = self._loop.time()  # wall clock (loop time), for tests
        self._sync_counts()

    def now(self) -> float:
        """The simulated clock, in simulated seconds since this process started."""
        if not self.running and not self.waiting:
            self.sim_now = max(self.sim_now, (self._loop.time() - self._t0) * self.scale)
        return self.sim_now

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_used -= seq.kv_tokens
        self.cache.release(seq.id, seq.prompt + seq.output_ids[: seq.generated], seq.salt)

    def _sync_counts(self) -> None:
        self.stats.active_sequences = len(self.running)
        self.stats.waiting = len(self.waiting)

    # -- the step loop ---------------------------------------------------------------------------------------
    def _admit(self, now: float) -> None:
        p = self.profile
        i = 0
        while i < len(self.waiting) and len(self.running) < p.max_seqs:
            seq = self.waiting[i]
            if self.running and self.kv_used + seq.kv_tokens > p.kv_capacity_tokens:
                break
            cached = self.cache.admit(seq.id, seq.prompt, seq.slot, seq.salt)
            if cached is None:
                if seq.slot is not None:  # its named slot is busy: deferred, the requests behind it go on
                    i += 1
                    continue
                break
            del self.waiting[i]
            seq.cached = cached
            seq.prefill_left = len(seq.prompt) - cached
            seq.state = "prefill"
            seq.t_scheduled = now
            self.running.append(seq)
            self.kv_used += seq.kv_tokens
            self.stats.prompt_tokens += len(seq.prompt)
            self.stats.cached_tokens += cached
            self.lat.queue.observe(now - seq.t_arrival)
            self.lat.prompt_len.observe(len(seq.prompt))
        self._sync_counts()

    async def _run(self) -> None:
        loop = self._loop
        next_t = loop.time()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                next_t = loop.time()
            self._admit(self.now())
            if not self.running:
                # waiting but nothing can run (cannot happen with sane limits): back off one base step
                await asyncio.sleep(self.profile.decode_base_s / self.scale)
                continue
            p = self.profile
            budget = p.prefill_chunk_tokens
            decoding = [s for s in self.running if s.state == "decode"]
            ready: list[Sequence] = []
            used = 0
            prompt_s = 0.0
            for seq in self.running:
                if seq.state == "prefill" and budget > 0:
                    take = min(seq.prefill_left, budget)
                    prompt_s += p.prefill_seconds(take, len(seq.prompt) - seq.prefill_left)
                    seq.prefill_left -= take
                    budget -= take
                    used += take
                    if seq.prefill_left == 0:
                        ready.append(seq)
            if used:
                prompt_s += p.prefill_base_s
            ctx = sum(len(s.prompt) + s.generated for s in decoding) if p.decode_ctx_growth else 0
            sim_dt = p.decode_seconds(len(decoding), ctx) + prompt_s
            next_t += sim_dt / self.scale
            now = loop.time()
            if next_t < now - 0.05:
                next_t = now  # far behind (CPU starved): do not replay the backlog in a burst
            await asyncio.sleep(max(0.0, next_t - now))
            self._account(sim_dt, used, prompt_s)
            self.sim_now += sim_dt
            now = self.sim_now
            for seq in decoding:
                if seq.state == "decode":
                    self._emit(seq, now)
            for seq in ready:
                if seq.state == "prefill":
                    seq.state = "decode"
                    seq.t_first = now
                    self.cache.computed(seq.id, seq.prompt, seq.salt)
                    self.lat.ttft.observe(now - seq.t_arrival)
                    self._emit(seq, now)

    def _account(self, sim_dt: float, prefilled: int, prompt_s: float) -> None:
        lat = self.lat
        lat.prompt_seconds += prompt_s
        lat.decode_seconds += sim_dt - prompt_s
        lat.win_prompt_tokens += prefilled
        lat.win_prompt_seconds += prompt_s
        lat.win_decode_seconds += sim_dt - prompt_s
        lat.steps += 1
        lat.win_steps += 1
        lat.busy_slot_steps += len(self.running)
        lat.win_busy_slot_steps += len(self.running)

    def _emit(self, seq: Sequence, now: float) -> None:
        if seq.generated:
            self.lat.itl.observe(now - seq.t_last)
        seq.t_last = now
        seq.generated += 1
        self.stats.tokens_generated += 1
        self.lat.win_gen_tokens += 1
        done = seq.generated >= len(seq.output)
        if done:
            seq.state = "done"
            seq.t_finish = now
            self._retire(seq)
            self.stats.completed += 1
            self.lat.e2e.observe(now - seq.t_arrival)
            self.lat.gen_len.observe(seq.generated)
            self.lat.max_tokens_seen = max(self.lat.max_tokens_seen, seq.kv_tokens)
            self._sync_counts()
        try:
            seq.sink.on_token(seq)
            if done:
                seq.sink.on_finish(seq)
        except Exception:  # one broken client must not stop the engine
            log.exception("sink failed")
