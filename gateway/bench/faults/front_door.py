"""Fault scenarios at the gateway's front door: a client sending a 64 MiB header, and thousands of idle
connections, each while other clients stream through the gateway. The target, per scenario: the others'
time to first token at p99 rises by no more than 2x, and no backend is ever marked down.

The attacker runs in a child process: on a thread of this one it would compete for the interpreter lock with
the gateway and its clients (an idle flood opened here doubled the clients' TTFT p99; from a child process
the same flood raised it by a tenth), and the figure would measure the benchmark, not the gateway.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from gateway.bench.faults.fakes import HugeHeaderResult, IdleFlood, send_huge_header
from gateway.bench.faults.harness import (
    GatewayThread,
    Outcome,
    ScenarioReport,
    chat_body,
    client_session,
    fleet_and_gateway,
    never_failed,
    request,
)
from gateway.pool.state import Health
from gateway.server_limits import raise_nofile_limit
from gateway.sim import SimSpec


def _p99_ms(samples: list[float]) -> float:
    if len(samples) < 2:
        return round(1000 * samples[0], 2) if samples else float("nan")
    return round(1000 * statistics.quantiles(samples, n=100)[98], 2)


def _ttfts(outcomes: list[Outcome]) -> list[float]:
    return [o.first_byte - o.started for o in outcomes if o.first_byte is not None]


class _Watch:
    """Samples, every 20 ms on a thread, whether every backend is ready and how many connections are open."""

    def __init__(self, gw: GatewayThread) -> None:
        self.gw = gw
        self.down_seen = False
        self.most_connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.down_seen |= any(b.health is not Health.READY for b in self.gw.gateway.pool.backends)
            self.most_connections = max(self.most_connections, len(self.gw.server.server_state.connections))

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def marked_down(self) -> int:
        return sum(b.marked_down for b in self.gw.gateway.pool.backends)


def _attacker_ready() -> None:
    """Run first in the child, so that its start and imports are over before the clock runs."""
    raise_nofile_limit()


def _under_attack(name: str, attack: Callable[[int, float], dict[str, Any]], *, concurrency: int,
                  max_tokens: int, phase_s: float, server: dict[str, Any], timeout: float) -> ScenarioReport:
    """``concurrency`` clients stream back to back for ``phase_s`` (before), then for ``phase_s`` more while
    ``attack(port, phase_s)`` runs in a child process (during); the report compares the two phases.
    ``attack`` must be picklable (a module-level function, or a partial of one)."""
    report = ScenarioReport(name)
    t0 = time.monotonic()
    raise_nofile_limit()
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=20.0)]
    child = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with child, fleet_and_gateway(specs, server=server) as (_, gw), _Watch(gw) as watch:
        child.submit(_attacker_ready).result(timeout=60)
        url = gw.url + "/v1/chat/completions"
        body = chat_body(max_tokens)

        async def phase(session: Any, seconds: float, base: int) -> list[Outcome]:
            end = time.monotonic() + seconds

            async def client(c: int) -> list[Outcome]:
                out: list[Outcome] = []
                while time.monotonic() < end:
                    out.append(await request(session, url, body, base + c * 100_000 + len(out), timeout))
                return out

            return [o for outs in await asyncio.gather(*(client(c) for c in range(concurrency))) for o in outs]

        async def drive() -> tuple[list[Outcome], list[Outcome], dict[str, Any]]:
            async with client_session() as session:
                await phase(session, 0.5, 9_000_000)  # warm-up: connections open, caches warm
                before = await phase(session, phase_s, 0)
                attacker = asyncio.wrap_future(child.submit(attack, gw.port, phase_s))
                during = await phase(session, phase_s, 1_000_000)
                return before, during, await attacker

        before, during, figures = asyncio.run(drive())
        report.add([*before, *during], never_failed)
        p99_before, p99_during = _p99_ms(_ttfts(before)), _p99_ms(_ttfts(during))
        report.checks["streams_before"], report.checks["streams_during"] = len(before), len(during)
        report.checks["ttft_ms_p50_before"] = round(1000 * statistics.median(_ttfts(before)), 2)
        report.checks["ttft_ms_p50_during"] = round(1000 * statistics.median(_ttfts(during)), 2)
        report.checks["ttft_ms_p99_before"], report.checks["ttft_ms_p99_during"] = p99_before, p99_during
        report.checks["ttft_p99_ratio"] = round(p99_during / p99_before, 2)
        report.checks["ttft_p99_rises_by_no_more_than_2x"] = p99_during <= 2 * p99_before
        report.checks["backends_marked_down"] = watch.marked_down()
        report.checks["backend_never_down"] = not watch.down_seen and watch.marked_down() == 0
        report.checks["most_open_connections"] = watch.most_connections
        report.checks.update(figures)
    report.seconds = time.monotonic() - t0
    return report


def huge_header(concurrency: int = 8, max_tokens: int = 16, phase_s: float = 3.0, header_mib: int = 64,
                timeout: float = 30.0) -> ScenarioReport:
    """While the others stream, one client after another sends ``GET /health`` with a ``header_mib`` MiB
    header (before the limit existed, one such header held the event loop for seconds). Also reported: the
    431's latency from the moment the limit was crossed, and how much the sender got in before the close."""
    limit = 64 * 1024
    attack = functools.partial(_send_huge_headers, limit=limit, size=header_mib << 20, timeout=timeout)
    return _under_attack("huge_header", attack, concurrency=concurrency, max_tokens=max_tokens, phase_s=phase_s,
                         server={"max_header_bytes": limit}, timeout=timeout)


def idle_flood(concurrency: int = 8, max_tokens: int = 16, phase_s: float = 3.0, idle: int = 3000,
               max_connections: int = 2000, timeout: float = 30.0) -> ScenarioReport:
    """While the others stream, ``idle`` connections open and stay silent for the rest of the phase, against
    a cap of ``max_connections`` (below ``idle``, so that the cap bites); they are closed at the end."""

    attack = functools.partial(_open_idle_connections, count=idle, cap=max_connections)
    report = _under_attack("idle_flood", attack, concurrency=concurrency, max_tokens=max_tokens, phase_s=phase_s,
                           server={"max_connections": max_connections}, timeout=timeout)
    report.checks["cap_honoured"] = report.checks["most_open_connections"] <= max_connections
    return report


# -- the attacks, each run in the child process -------------------------------------------------------------
def _send_huge_headers(port: int, seconds: float, *, limit: int, size: int, timeout: float) -> dict[str, Any]:
    end = time.monotonic() + seconds
    results: list[HugeHeaderResult] = []
    while time.monotonic() < end:
        results.append(send_huge_header(port, limit, size, timeout=timeout))
    latencies = [r.seconds_after_limit for r in results]
    return {
        "huge_headers_sent": len(results),
        "huge_header_statuses": sorted({r.status or 0 for r in results}),
        "all_answered_431": all(r.status == 431 for r in results),
        "ms_431_after_limit_p50": round(1000 * statistics.median(latencies), 2),
        "ms_431_after_limit_max": round(1000 * max(latencies), 2),
        "ms_431_p50_within_100": statistics.median(latencies) <= 0.1,
        "mib_sent_before_close_max": round(max(r.bytes_sent for r in results) / 2**20, 1),
    }


def _open_idle_connections(port: int, seconds: float, *, count: int, cap: int) -> dict[str, Any]:
    flood = IdleFlood(port, count)
    t0 = time.monotonic()
    try:
        flood.open()
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        refused, closed = flood.refused(), flood.closed()
    finally:
        flood.close()
    return {
        "idle_connections": count,
        "idle_opened_in_s": round(flood.opened_in_s, 2),
        "connection_cap": cap,
        "refused_at_once_503": refused,
        "closed_by_header_timeout": closed,
        "held_open": count - refused - closed,
    }
