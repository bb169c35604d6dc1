"""Arrival processes and the interleaved, round-by-round run over one or several targets.

A run splits the workload into rounds; in every round each target gets the round's requests in turn
(a *phase*), in an order balanced over the rounds (:func:`interleave_order`: each target in each place, and after
each other target, equally often), so that machine noise and warm-up hit every target alike. Within a phase
requests arrive:

* closed loop: ``concurrency`` workers, each sending its next request when the previous one ends;
* open loop: Poisson arrivals at ``rate`` requests/s (the same offsets for every target), optionally capped
  at ``concurrency`` in flight.

A run ends when the requests are used up or, between phases, when ``duration`` has passed (a single target
also stops issuing inside its phase at the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from gateway.bench.client import RequestResult, Target, new_session, resolve_model, send_streaming
from gateway.bench.workload import BenchRequest


@dataclass(frozen=True)
class Arrival:
    concurrency: int | None = 8
    rate: float | None = None  # requests/s; set -> open loop
    duration: float | None = None  # seconds
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is None and not self.concurrency:
            raise ValueError("closed loop needs a concurrency of at least 1 (or give a rate)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of ``n`` Poisson arrivals at ``rate``/s, the first at 0."""
    rng = random.Random(seed)
    out = [0.0]
    for _ in range(n - 1):
        out.append(out[-1] + rng.expovariate(rate))
    return out[:n]


def interleave_order(n_targets: int, n_rounds: int) -> list[list[int]]:
    """Per round, the order in which targets run: the rows of a Williams square (a Latin square balanced for
    carry-over, as crossover trials use). Over every ``n`` rounds (``2n`` for an odd ``n``) each target runs once
    in each place and follows each other target equally often, so neither a place in the round nor what ran just
    before (a warm cache, a busy core, a backlog the previous target left) favours one target. A plain rotation
    balances places only: each target then always follows the same one."""
    if n_targets <= 0:
        return [[] for _ in range(n_rounds)]
    first, low, high = [0], 1, n_targets - 1
    for i in range(1, n_targets):  # 0, 1, n-1, 2, n-2, ...
        if i % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    square = [[(k + r) % n_targets for k in first] for r in range(n_targets)]
    if n_targets % 2:
        square += [row[::-1] for row in square]  # (an odd square balances carry-over with its mirror)
    return [square[r % len(square)] for r in range(n_rounds)]


def split_rounds(n_requests: int, round_size: int) -> list[range]:
    if round_size < 1:
        raise ValueError("round size must be at least 1")
    return [range(s, min(s + round_size, n_requests)) for s in range(0, n_requests, round_size)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and of its live descendants (a supervisor's workers), from /proc
    (Linux). A descendant that ended between two readings takes its time with it: read over a phase in which
    none does."""
    ticks, pending = _ticks(pid), _children(pid)
    while pending:
        child = pending.pop()
        with contextlib.suppress(OSError):  # ended meanwhile
            ticks += _ticks(child)
            pending += _children(child)
    return ticks / os.sysconf("SC_CLK_TCK")


def _ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return found


def host_cpu_times() -> tuple[float, float] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat; None where unavailable."""
    try:
        with open("/proc/stat") as fh:
            fields = [float(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


def host_busy_share(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Share (0-1) of the machine's CPU time that was busy between two :func:`host_cpu_times` readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


@dataclass
class Phase:
    target: str
    round: int
    wall: float
    requests: int
    chunks: int
    cpu_s: float | None = None  # of the target's process, when its pid is known


@dataclass
class RunResult:
    targets: list[Target]
    results: dict[str, list[RequestResult]] = field(default_factory=dict)
    phases: list[Phase] = field(default_factory=list)

    def wall(self, target: str) -> float:
        return sum(p.wall for p in self.phases if p.target == target)

    def cpu(self, target: str) -> float | None:
        values = [p.cpu_s for p in self.phases if p.target == target]
        return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


T = TypeVar("T")
ProgressFn = Callable[[RequestResult], None]


async def run_phase(session: aiohttp.ClientSession, target: Target, model: str, requests: Sequence[BenchRequest],
                    arrival: Arrival, t0: float, round_no: int = 0, deadline: float | None = None,
                    offsets: Sequence[float] | None = None, on_done: ProgressFn | None = None,
                    request_timeout: float = 600.0) -> list[RequestResult]:
    """Send ``requests`` to ``target`` under ``arrival``; results in request order (only those sent)."""
    results: list[RequestResult] = []

    async def one(req: BenchRequest) -> None:
        result = RequestResult(index=req.index, target=target.name, round=round_no, start=time.perf_counter() - t0)
        results.append(result)
        await send_streaming(session, target, model, req, result, request_timeout)
        if on_done is not None:
            on_done(result)

    def expired() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    if arrival.rate is None:
        queue = list(reversed(requests))

        async def worker() -> None:
            while queue and not expired():
                await one(queue.pop())

        assert arrival.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(min(arrival.concurrency, len(requests)))))
    else:
        times = list(offsets) if offsets is not None else poisson_offsets(len(requests), arrival.rate, arrival.seed)
        base = times[0] if times else 0.0
        cap = asyncio.Semaphore(arrival.concurrency) if arrival.concurrency else None
        start = time.perf_counter()
        tasks = []

        async def capped(req: BenchRequest) -> None:
            if cap is None:
                await one(req)
                return
            async with cap:
                await one(req)

        for req, at in zip(requests, times, strict=True):
            delay = start + (at - base) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if expired():
                break
            tasks.append(asyncio.create_task(capped(req)))
        await asyncio.gather(*tasks)
    results.sort(key=lambda r: r.index)
    return results


async def run(targets: Sequence[Target], requests: Sequence[BenchRequest], arrival: Arrival, *,
              round_size: int | None = None, on_done: ProgressFn | None = None, request_timeout: float = 600.0,
              warmup: int = 0) -> RunResult:
    """Run the workload against every target, interleaved round by round (see the module docstring).

    ``round_size`` None: one round (every request to the first target, then to the next...). ``warmup``
    requests go to each target first and are not recorded.
    """
    if not targets:
        raise ValueError("no targets")
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"target names must be unique: {names}")
    out = RunResult(targets=list(targets), results={t.name: [] for t in targets})
    rounds = split_rounds(len(requests), round_size or len(requests) or 1)
    offsets = (poisson_offsets(len(requests), arrival.rate, arrival.seed) if arrival.rate is not None else None)
    sessions = {t.name: new_session() for t in targets}
    try:
        models = {t.name: await resolve_model(sessions[t.name], t) for t in targets}
        if warmup:
            for t in targets:
                await run_phase(sessions[t.name], t, models[t.name], requests[:warmup],
                                Arrival(concurrency=arrival.concurrency or 8), time.perf_counter(),
                                request_timeout=request_timeout)
        t0 = time.perf_counter()
        deadline = t0 + arrival.duration if arrival.duration else None
        single = len(targets) == 1
        for r, order in enumerate(interleave_order(len(targets), len(rounds))):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            chunk = [requests[i] for i in rounds[r]]
            chunk_offsets = [offsets[i] for i in rounds[r]] if offsets is not None else None
            for k in order:
                target = targets[k]
                cpu0 = cpu_seconds(target.pid) if target.pid else None
                started = time.perf_counter()
                results = await run_phase(sessions[target.name], target, models[target.name], chunk, arrival, t0,
                                          r, deadline if single else None, chunk_offsets, on_done, request_timeout)
                wall = time.perf_counter() - started
                cpu = cpu_seconds(target.pid) - cpu0 if target.pid and cpu0 is not None else None
                out.results[target.name].extend(results)
                out.phases.append(Phase(target.name, r, wall, len(results), sum(x.chunks for x in results), cpu))
    finally:
        for s in sessions.values():
            await s.close()
    return out


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on uvloop when installed (the load generator's loop must not be the
    bottleneck), else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
