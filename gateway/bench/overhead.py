"""``gateway bench overhead``: what the gateway adds to a stream, against the backend directly and against a
Rust router in front of the same backend, in the same run: SMG (Shepherd Model Gateway, PyPI ``smg``, the
SGLang router's successor) when installed, else the SGLang model gateway (PyPI ``sglang-router``).

Processes (all on this machine): the raw backend (:mod:`gateway.bench.rawbackend`: 16 tokens 5 ms apart,
almost no CPU per token), the gateway as users run it (``python -m gateway serve --config FILE``, routing policy
``default``), the Rust router (``python -m smg.launch_router`` or ``python -m sglang_router.launch_router``,
``--worker-urls URL --policy round_robin``) when installed, and the load generator (this process: aiohttp on
uvloop), and a bare TCP relay (:mod:`gateway.bench.relay`, target ``relay``; ``--no-relay`` skips it): the floor
any proxy pays here for sockets, event loop and kernel, against which the gateway's own figures can be read.
Targets are always interleaved (levels: balanced for place and predecessor, :func:`interleave_order`; the other
phases: the order rotated from round to round or level to level). Phases:

1. Latency levels (closed loop; default 1, 16, 64, 256 streams, a short prompt): added TTFT p50/p99 and added
   inter-chunk gap p50/p99/mean against direct, streamed chunks/s, CPU per request and per chunk from /proc
   (total CPU / requests and total CPU / chunks: each includes the other's costs), and per level the gateway's
   added TTFT over the Rust router's (``vs_reference``).
2. Cost (``--no-cost`` skips): a closed loop at ``--cost-concurrency`` (16) of requests with distinct ~2,000-token
   prompts (8,000 characters of seeded pseudo-words), run twice per target, with max_tokens A and B
   (``--cost-tokens 4,64``; the raw backend streams max_tokens chunks). From each target's /proc CPU and the chunk
   counts of both runs it solves ``cpu = requests * R + chunks * C``: R the CPU per request excluding chunks
   (routing to the response's end), C the CPU per streamed chunk. /proc counts CPU in ticks (10 ms): each
   per-phase reading is off by up to a tick, so the worst-case error of R and C is reported with them; a run
   needs about a second of CPU for R to be within ~10 us.
3. Saturation (``--no-saturation`` skips): long, fast streams (``--saturation-tokens`` 32, ``--saturation-gap-ms``
   1) at rising concurrency (``--saturation-levels`` 256,512,1024): chunks/s at the client and, from /proc over
   each phase, the CPU (cores) of the proxy, the backend, the client and the whole machine. The highest chunks/s
   per target, whether the proxy was saturated (at least 0.9 core) or what else limited it (``limit``: proxy,
   machine, client, backend or none), and the capacity the cost phase implies, 1e6 / C chunks/s per core.
4. Hold: ``hold`` streams (default 1,000) opened at once through each target and held for a few seconds; the
   backend reports how many it had open at once. Optionally py-spy samples the gateway under load
   (``--py-spy SECONDS``) and the report ranks its hottest functions.

``--tracing`` adds a second gateway process with OpenTelemetry tracing on (``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at a loopback OTLP/HTTP sink in its own process that answers 200 and discards every export; never a
remote collector), interleaved with the others in every phase, and reports what tracing adds per request:
TTFT p50/p99 and end-to-end p50 against the untraced gateway (microseconds, and the gateway's added TTFT over
direct with tracing / without) and CPU per request from /proc. The untraced gateway then runs with
``OTEL_SDK_DISABLED=true``, so an ``OTEL_*`` variable in the caller's environment cannot turn it on.

``--repeat N`` runs it all N times (fresh processes each time) and writes ``overhead-1.json`` ... ``overhead-N.json``
and the summary ``overhead.json``: every figure the median of the runs' (ratios: the median of each run's
ratio), the runs themselves under ``runs``, and ``targets``: each issue target (gateway CPU per chunk <= 25 us
and per request <= 150 us, >= 40,000 chunks/s from one process, added TTFT p50 within 1.5x / 1.5x / 2x / 3x of
the Rust router's at 1 / 16 / 64 / 256 streams, the held streams all complete) with its value and whether it was
met. ``overhead.png`` draws the summary (and ``overhead-N.png`` each run when N > 1); the processes' logs are
under ``--out`` (``reports/overhead``; ``run-N/`` when N > 1).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from gateway.bench.client import Target
from gateway.bench.overhead_report import plot_overhead, print_overhead
from gateway.bench.procs import ChildProcess, get_json
from gateway.bench.pyspy import start_record, top_areas, top_frames
from gateway.bench.report import build_report, write_json
from gateway.bench.runner import Arrival, RunResult, cpu_seconds, host_busy_share, host_cpu_times, run, run_sync
from gateway.bench.state_cost import (
    LIMITED,
    LIMITED_KEY,
    LIMITED_LOCAL,
    STATEFUL,
    TOKENS,
    TOKENS_LOCAL,
    limited_gateway,
    limited_port,
    redis_available,
    redis_child,
    state_counts,
    stateful_gateway,
    workers_gateway,
    workers_name,
)
from gateway.bench.stats import paired_difference, percentile
from gateway.bench.translation_cost import measure_translation
from gateway.bench.workload import BenchRequest

MODEL = "bench-model"
RELAY = "relay"  # the bare TCP relay's target name
TRACED = "gateway+tracing"
SCHEMA = "gateway-bench-overhead/2"
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01  # /proc's CPU time unit
SATURATED_CORES = 0.9  # a process using this much of a core (or more) is taken as CPU-bound
# the targets: gateway CPU per streamed chunk and per request (cost phase), chunks/s from one process,
# the gateway's added TTFT p50 over the Rust router's per level (at most this many times), the held streams
CPU_US_PER_CHUNK_TARGET = 25.0
CPU_US_PER_REQUEST_TARGET = 150.0
CHUNKS_PER_S_TARGET = 40_000.0
TTFT_X_TARGETS = {1: 1.5, 16: 1.5, 64: 2.0, 256: 3.0}
T = TypeVar("T")

STATE_TTFT_LEVEL, STATE_TTFT_US_TARGET = 16, 500.0  # the scale-out issue: Redis adds <= +0.5 ms at 16 streams
# the pairs phase (--state): (part, without shared state, with it); "state_floor" pairs two gateways that both
# keep their limits in memory (a requests/min key, a tokens/min key): what the method shows where nothing differs
STATE_PAIRS = (("state", "gateway", STATEFUL), ("state_limited", LIMITED_LOCAL, LIMITED),
               ("state_tokens", TOKENS_LOCAL, TOKENS), ("state_floor", LIMITED_LOCAL, TOKENS_LOCAL))


@dataclass
class OverheadConfig:
    levels: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    rounds: int = 3
    min_round: int = 24  # requests per target per round, at least (and at least 2x the level)
    tokens: int = 16
    gap_ms: float = 5.0
    hold: int = 1000
    hold_seconds: float = 3.0
    rust: bool = True
    relay: bool = True  # also a bare TCP relay (gateway.bench.relay): the floor any proxy pays on this machine
    reference: str = "auto"  # the Rust router: "smg", "sglang-router", or "auto" (smg when installed)
    py_spy_seconds: float = 0.0
    py_spy_concurrency: int = 64
    py_spy_target: str = "gateway"  # the target profiled: any target's name (e.g. the gateway with shared state)
    tracing: bool = False
    state: bool = False  # also a gateway with shared state in a loopback redis-server (gateway.bench.state_cost)
    state_rounds: int = 100  # with state: rounds of each pair alone at STATE_TTFT_LEVEL streams (0: no pairs phase)
    workers: int = 1  # above 1: also a gateway of that many worker processes sharing that redis-server
    base_port: int = 18500
    out: Path = Path("reports/overhead")
    repeat: int = 1
    # cost phase: two runs per target (max_tokens A and B) of ~2,000-token prompts; 0 requests skips it
    cost_requests: int = 2000  # per target per run
    cost_concurrency: int = 16
    cost_tokens: tuple[int, int] = (4, 64)
    cost_gap_ms: float = 2.0
    cost_rounds: int = 2
    cost_prompt_chars: int = 8000
    # saturation phase: long fast streams at rising concurrency; no levels skips it
    saturation_levels: list[int] = field(default_factory=lambda: [256, 512, 1024])
    saturation_requests: int = 1024  # per target per level, at least (and at least 2x the level)
    saturation_tokens: int = 32
    saturation_gap_ms: float = 1.0
    # translation phase: a translated /v1/messages stream against a native chat stream at this many streams
    translation_level: int = 16  # 0 skips it


def requests_for(n: int, tokens: int, extra: dict[str, Any] | None = None) -> list[BenchRequest]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": tokens,
                            **(extra or {})}
    return [BenchRequest(index=i, body=body, prompt_words=3, output_len=tokens) for i in range(n)]


def gateway_yaml(backend_url: str, port: int, policy: str = "default") -> str:
    """The gateway under test: one ``openai`` backend, the routing policy users run unless they choose one."""
    return (f"server:\n  host: 127.0.0.1\n  port: {port}\n"
            f"backends:\n  - name: raw\n    engine: openai\n    url: {backend_url}\n"
            f"    models: [{MODEL}]\n    max_concurrency: 4096\n"
            f"routing:\n  policy: {policy}\n")


_SYLLABLES = tuple(c + v for c in "bdfghklmnprstvz" for v in "aeiou")


def _vocabulary(size: int = 2048, seed: int = 7) -> tuple[str, ...]:
    rng = random.Random(seed)
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))))
    return tuple(sorted(words))


VOCABULARY = _vocabulary()


def prompt_text(seed: int, chars: int = 8000) -> str:
    """A deterministic prompt of ``chars`` characters (less the tail of a word at most) of pseudo-words drawn
    from a 2,048-word vocabulary: about ``chars / 4`` tokens at ~4 characters per token. Each seed its own text."""
    if chars <= 0:
        return ""
    rng = random.Random(seed)
    text = " ".join(rng.choices(VOCABULARY, k=chars // 3 + 2))
    cut = text.rfind(" ", 0, chars + 1)
    return text[: cut if cut > 0 else chars]


def cost_requests_for(n: int, tokens: int, chars: int, seed: int, gap_ms: float | None = None) -> list[BenchRequest]:
    """``n`` requests with distinct long prompts (seeds ``seed`` ... ``seed + n - 1``) and ``tokens`` max_tokens."""
    out = []
    for i in range(n):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt_text(seed + i, chars)}],
                                "max_tokens": tokens}
        if gap_ms is not None:
            body["bench_gap_ms"] = gap_ms
        out.append(BenchRequest(index=i, body=body, prompt_words=chars // 6, output_len=tokens))
    return out


def level_row(doc: dict[str, Any], direct: str) -> dict[str, Any]:
    """The figures of one level: per target, absolute and added against ``direct``."""
    out: dict[str, Any] = {}
    ref = doc["targets"][direct]
    for name, t in doc["targets"].items():
        m = t["metrics"]
        row = {
            "ok": t["ok"], "requests": t["requests"], "errors": t["errors"],
            "ttfb_ms_p50": _ms(m["ttfb_s"]["p50"]), "ttft_ms_p50": _ms(m["ttft_s"]["p50"]),
            "ttft_ms_p99": _ms(m["ttft_s"]["p99"]), "e2e_ms_p50": _ms(m.get("e2e_s", {}).get("p50")),
            "itl_ms_p50": _ms(m["itl_s"].get("p50")), "itl_ms_mean": _ms(m["itl_s"]["mean"]),
            "itl_ms_p99": _ms(m["itl_s"]["p99"]),
            "chunks_per_s": t["chunks_per_s"], "cpu_ms_per_request": t["cpu_ms_per_request"],
            "cpu_us_per_chunk": t["cpu_us_per_chunk"],
        }
        if name != direct:
            rm = ref["metrics"]
            row["added_ttft_ms_p50"] = _diff(m["ttft_s"]["p50"], rm["ttft_s"]["p50"])
            row["added_ttft_ms_p99"] = _diff(m["ttft_s"]["p99"], rm["ttft_s"]["p99"])
            row["added_itl_ms_p50"] = _diff(m["itl_s"].get("p50"), rm["itl_s"].get("p50"))
            row["added_itl_ms_p99"] = _diff(m["itl_s"]["p99"], rm["itl_s"]["p99"])
            row["added_itl_ms_mean"] = _diff(m["itl_s"]["mean"], rm["itl_s"]["mean"])
        out[name] = row
    return out


def vs_reference(levels: dict[str, Any], reference: str | None, skip: tuple[str, ...] = ("direct",)) -> dict[str, Any]:
    """Per level, each proxy's added TTFT (p50, p99) over the reference's, in this run: ``{"reference": NAME,
    "levels": {LEVEL: {NAME: {"added_ttft_p50_x", "added_ttft_p99_x"}}}}``; a ratio is null where the
    reference added nothing (or less)."""
    out: dict[str, Any] = {"reference": reference, "levels": {}}
    if reference is None:
        return out
    for level, rows in levels.items():
        ref = rows.get(reference)
        if ref is None:
            continue
        out["levels"][level] = {
            name: {"added_ttft_p50_x": _ratio(row.get("added_ttft_ms_p50"), ref.get("added_ttft_ms_p50")),
                   "added_ttft_p99_x": _ratio(row.get("added_ttft_ms_p99"), ref.get("added_ttft_ms_p99"))}
            for name, row in rows.items() if name != reference and name not in skip}
    return out


def tracing_cost(levels: dict[str, Any], untraced: str = "gateway", traced: str = TRACED) -> dict[str, Any]:
    """Per level, what the traced gateway adds over the untraced one, per request: microseconds and ratios
    (above 1: tracing costs). ``added_ttft_over_direct_x``: the gateway's added TTFT p50 over direct, with
    tracing / without."""
    out: dict[str, Any] = {}
    for level, rows in levels.items():
        off, on = rows.get(untraced), rows.get(traced)
        if off is None or on is None:
            continue
        out[level] = {
            "ttft_us_p50": _us_diff(on["ttft_ms_p50"], off["ttft_ms_p50"]),
            # the same, round by round: the rounds' drift cancels (see paired_us)
            "ttft_us_p50_paired": paired_us(off, on),
            "ttft_us_p99": _us_diff(on["ttft_ms_p99"], off["ttft_ms_p99"]),
            "e2e_us_p50": _us_diff(on.get("e2e_ms_p50"), off.get("e2e_ms_p50")),
            "ttft_p50_x": _ratio(on["ttft_ms_p50"], off["ttft_ms_p50"]),
            "e2e_p50_x": _ratio(on.get("e2e_ms_p50"), off.get("e2e_ms_p50")),
            "added_ttft_over_direct_x": _ratio(on.get("added_ttft_ms_p50"), off.get("added_ttft_ms_p50")),
            "cpu_us_per_request": _us_diff(on["cpu_ms_per_request"], off["cpu_ms_per_request"]),
            "cpu_per_request_x": _ratio(on["cpu_ms_per_request"], off["cpu_ms_per_request"]),
        }
    return out


def round_p50s(result: RunResult, metric: str, rounds: int) -> dict[str, list[float | None]]:
    """Per target, the p50 of ``metric`` (milliseconds) over each interleaved round's successful requests: the
    targets of one round ran side by side, so a round's values pair up (see :func:`paired_us`)."""
    out: dict[str, list[float | None]] = {}
    for name, results in result.results.items():
        by_round: list[list[float]] = [[] for _ in range(rounds)]
        for r in results:
            value = getattr(r, metric)
            if r.ok and 0 <= r.round < rounds and not math.isnan(value):
                by_round[r.round].append(value)
        out[name] = [_ms(percentile(values, 50)) if values else None for values in by_round]
    return out


def paired_us(off: dict[str, Any], on: dict[str, Any], key: str = "ttft_ms_p50_by_round") -> dict[str, Any]:
    """What ``on`` adds over ``off`` in microseconds, round by round (each round's p50 against the other's in
    the same round): the median difference and its bootstrap 90% interval (:func:`paired_difference`)."""
    a, b = off.get(key), on.get(key)
    if not a or not b or len(a) != len(b):
        return {"median": None, "low": None, "high": None, "pairs": 0}
    nan = math.nan
    return paired_difference([nan if x is None else 1000 * x for x in a], [nan if y is None else 1000 * y for y in b])


def _us_diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 1000 * (a - b)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000 * v


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 1000 * (a - b)


async def _measure(targets: list[Target], cfg: OverheadConfig, log: Any) -> dict[str, Any]:
    levels: dict[str, Any] = {}
    for level in cfg.levels:
        per_round = max(cfg.min_round, 2 * level)
        reqs = requests_for(per_round * cfg.rounds, cfg.tokens)
        started = time.perf_counter()
        result = await run(targets, reqs, Arrival(concurrency=level), round_size=per_round, warmup=level,
                           request_timeout=120)
        doc = build_report(result, {"level": level}, include_requests=False)
        levels[str(level)] = level_row(doc, targets[0].name)
        for name, p50s in round_p50s(result, "ttft", cfg.rounds).items():
            levels[str(level)][name]["ttft_ms_p50_by_round"] = p50s
        log(f"  {level:>4} streams: {time.perf_counter() - started:5.1f} s  " + "  ".join(
            f"{n}: ttft p50 {r['ttft_ms_p50']:.2f} ms" for n, r in levels[str(level)].items()
            if r["ttft_ms_p50"] is not None))
    return levels


async def _state_pairs(pairs: list[tuple[str, Target, Target]], cfg: OverheadConfig, log: Any) -> dict[str, Any]:
    """Each comparison on its own: the two gateways of a pair (without shared state, with it) and nothing else,
    ``state_rounds`` rounds at ``STATE_TTFT_LEVEL`` streams, in the order A B, B A, A B... so that each runs
    first, and after the other, as often (the pairs' own order rotates from run to run of a ``--repeat``). In
    the levels phase six more gateways share the cores (and, before its order was balanced, each target followed
    the same one in every round): there, identical gateways came out up to 1.5 ms apart at 16 streams. Per pair:
    the median of the rounds' paired TTFT p50 differences (B - A) and its bootstrap 90% interval, in
    microseconds."""
    level = STATE_TTFT_LEVEL
    per_round = max(cfg.min_round, 2 * level)
    out: dict[str, Any] = {}
    for part, off, on in pairs:
        started = time.perf_counter()
        reqs = requests_for(per_round * cfg.state_rounds, cfg.tokens)
        result = await run([off, on], reqs, Arrival(concurrency=level), round_size=per_round, warmup=level,
                           request_timeout=120)
        p50s = round_p50s(result, "ttft", cfg.state_rounds)
        paired = paired_us({"ttft_ms_p50_by_round": p50s[off.name]}, {"ttft_ms_p50_by_round": p50s[on.name]})
        errors = {t: sum(1 for r in rs if not r.ok) for t, rs in result.results.items()}
        out[part] = {"off": off.name, "on": on.name, "level": level, "rounds": cfg.state_rounds,
                     "ttft_us_p50_paired": paired, "errors": errors}
        log(f"  {part}: {on.name} over {off.name} at {level} streams, {cfg.state_rounds} rounds: TTFT p50 "
            f"{_f(paired['median'], 0)} us (90% {_f(paired['low'], 0)} to {_f(paired['high'], 0)}) "
            f"[{time.perf_counter() - started:.0f} s]")
    return out


async def _hold(targets: list[Target], backend_url: str, cfg: OverheadConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gap = 1000 * cfg.hold_seconds / cfg.tokens
    reqs = requests_for(cfg.hold, cfg.tokens, {"bench_gap_ms": gap})
    for target in targets:
        get_json(backend_url + "/stats/reset", method="POST")
        result = await run([target], reqs, Arrival(concurrency=cfg.hold), request_timeout=120)
        stats = get_json(backend_url + "/stats")
        rs = result.results[target.name]
        ok = sum(1 for r in rs if r.ok and r.chunks == cfg.tokens)
        errors = sorted({r.error or "incomplete" for r in rs if not (r.ok and r.chunks == cfg.tokens)})[:3]
        out[target.name] = {"streams": len(rs), "complete": ok, "errors": len(rs) - ok, "error_samples": errors,
                            "backend_peak_open": stats["peak_streams"] if isinstance(stats, dict) else None,
                            "wall_s": result.wall(target.name)}
    return out


@dataclass(frozen=True)
class CostRun:
    """One target's totals over one run of the cost phase (all its rounds)."""

    requests: int
    chunks: int
    cpu_s: float | None
    cpu_error_s: float = 0.0  # the most the CPU figure can be off: a /proc tick per reading


COST_NONE: dict[str, float | None] = {"cpu_us_per_request": None, "cpu_us_per_chunk": None,
                                      "cpu_us_per_request_error": None, "cpu_us_per_chunk_error": None}


def solve_cost(a: CostRun, b: CostRun) -> dict[str, float | None]:
    """Solve ``cpu = requests * R + chunks * C`` from two runs that stream different numbers of chunks per
    request: R the CPU per request excluding its chunks, C the CPU per chunk (microseconds), and the worst-case
    error of each from the runs' ``cpu_error_s``. All None when the runs cannot separate the two (no CPU figure,
    no requests, or as many chunks per request in both)."""
    if a.cpu_s is None or b.cpu_s is None or a.requests <= 0 or b.requests <= 0:
        return dict(COST_NONE)
    det = a.requests * b.chunks - b.requests * a.chunks
    scale = a.requests * b.chunks + b.requests * a.chunks
    if det == 0 or abs(det) <= 1e-9 * scale:
        return dict(COST_NONE)
    r = (a.cpu_s * b.chunks - b.cpu_s * a.chunks) / det
    c = (a.requests * b.cpu_s - b.requests * a.cpu_s) / det
    dr = (abs(b.chunks) * a.cpu_error_s + abs(a.chunks) * b.cpu_error_s) / abs(det)
    dc = (a.requests * b.cpu_error_s + b.requests * a.cpu_error_s) / abs(det)
    return {"cpu_us_per_request": 1e6 * r, "cpu_us_per_chunk": 1e6 * c,
            "cpu_us_per_request_error": 1e6 * dr, "cpu_us_per_chunk_error": 1e6 * dc}


def _rotated(items: list[T], k: int) -> list[T]:
    if not items:
        return items
    k %= len(items)
    return items[k:] + items[:k]


async def _cost(targets: list[Target], cfg: OverheadConfig, log: Any) -> dict[str, Any]:
    """Two runs per target, max_tokens A and B, of requests with distinct long prompts; interleaved: in each
    round A then B (B then A in odd rounds), every target in turn, the order rotated by one each round."""
    tok_a, tok_b = cfg.cost_tokens
    rounds = max(1, min(cfg.cost_rounds, cfg.cost_requests))
    arrival = Arrival(concurrency=cfg.cost_concurrency)
    sizes = [len(r) for r in _split(cfg.cost_requests, rounds)]
    acc = {t.name: {tok: {"requests": 0, "ok": 0, "chunks": 0, "cpu_s": 0.0, "wall_s": 0.0, "readings": 0,
                          "cpu_known": True} for tok in (tok_a, tok_b)} for t in targets}
    started = time.perf_counter()
    # warm-up (not recorded): every target's connections and code paths, with prompts of their own
    warm = cost_requests_for(cfg.cost_concurrency, tok_a, cfg.cost_prompt_chars, 10**9, cfg.cost_gap_ms)
    await run(targets, warm, arrival, request_timeout=120)
    seed = 0
    for r, n in enumerate(sizes):
        for tokens in ((tok_a, tok_b) if r % 2 == 0 else (tok_b, tok_a)):
            reqs = cost_requests_for(n, tokens, cfg.cost_prompt_chars, seed, cfg.cost_gap_ms)
            seed += n
            result = await run(_rotated(targets, r), reqs, arrival, request_timeout=120)
            for phase in result.phases:
                a = acc[phase.target][tokens]
                a["requests"] += phase.requests
                a["chunks"] += phase.chunks
                a["wall_s"] += phase.wall
                a["readings"] += 1
                if phase.cpu_s is None:
                    a["cpu_known"] = False
                else:
                    a["cpu_s"] += phase.cpu_s
            for name, rs in result.results.items():
                acc[name][tokens]["ok"] += sum(1 for x in rs if x.ok)
    out: dict[str, Any] = {}
    for t in targets:
        runs: dict[str, Any] = {}
        fits: list[CostRun] = []
        for tok in (tok_a, tok_b):
            a = acc[t.name][tok]
            cpu = a["cpu_s"] if a["cpu_known"] else None
            runs[f"max_tokens_{tok}"] = {
                "max_tokens": tok, "requests": a["requests"], "ok": a["ok"], "chunks": a["chunks"],
                "chunks_per_request": a["chunks"] / a["requests"] if a["requests"] else None,
                "cpu_s": cpu, "wall_s": a["wall_s"], "readings": a["readings"],
                "cpu_us_per_request": 1e6 * cpu / a["requests"] if cpu is not None and a["requests"] else None,
                "cpu_us_per_chunk": 1e6 * cpu / a["chunks"] if cpu is not None and a["chunks"] else None}
            fits.append(CostRun(int(a["requests"]), int(a["chunks"]), cpu, a["readings"] * TICK_S))
        fit = solve_cost(fits[0], fits[1])
        c = fit["cpu_us_per_chunk"]
        out[t.name] = {**fit, "capacity_chunks_per_s": 1e6 / c if c is not None and c > 0 else None, "runs": runs}
        log(f"  cost {t.name}: {_f(fit['cpu_us_per_request'], 0)} +- {_f(fit['cpu_us_per_request_error'], 0)} us "
            f"per request, {_f(c, 1)} +- {_f(fit['cpu_us_per_chunk_error'], 1)} us per chunk (CPU "
            + " / ".join(_f(r["cpu_s"], 2) + " s" for r in runs.values()) + ")")
    log(f"  cost phase: {time.perf_counter() - started:5.1f} s")
    return {"config": {"concurrency": cfg.cost_concurrency, "max_tokens": [tok_a, tok_b],
                       "requests": cfg.cost_requests, "rounds": rounds, "gap_ms": cfg.cost_gap_ms,
                       "prompt_chars": cfg.cost_prompt_chars, "prompt_tokens_approx": cfg.cost_prompt_chars // 4,
                       "tick_s": TICK_S, "model": "cpu_s = requests * R + chunks * C"},
            "targets": out}


def _split(n: int, parts: int) -> list[range]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _f(v: float | None, d: int) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def _cpu(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        return cpu_seconds(pid)
    except OSError:
        return None


def saturation_limit(proxy_cores: float | None, backend_cores: float | None, client_cores: float | None,
                     host_busy: float | None) -> str:
    """What limited a saturation phase: ``proxy`` (its process used at least 0.9 core: saturated),
    ``machine`` (every core at least 90% busy: client, backend and proxy share them), ``client``, ``backend``,
    or ``none`` (nothing ran out: the offered load was below every capacity)."""
    def at(v: float | None, limit: float) -> bool:
        return v is not None and v >= limit

    if at(proxy_cores, SATURATED_CORES):
        return "proxy"
    if at(host_busy, 0.9):
        return "machine"
    if at(client_cores, SATURATED_CORES):
        return "client"
    if at(backend_cores, SATURATED_CORES):
        return "backend"
    return "none"


def _saturation_row(result: RunResult, name: str, wall: float, before: tuple[Any, ...],
                    after: tuple[Any, ...], processes: int = 1) -> dict[str, Any]:
    """``processes``: how many processes the proxy's CPU reading adds up (a supervisor's workers): it is
    saturated when each of them uses most of a core."""
    rs = result.results[name]

    def cores(i: int) -> float | None:
        return None if before[i] is None or after[i] is None or wall <= 0 else (after[i] - before[i]) / wall

    chunks = sum(r.chunks for r in rs)
    busy = host_busy_share(before[3], after[3])
    row: dict[str, Any] = {"requests": len(rs), "ok": sum(1 for r in rs if r.ok), "chunks": chunks, "wall_s": wall,
           "chunks_per_s": chunks / wall if wall > 0 else None, "proxy_cores": cores(0), "backend_cores": cores(1),
           "client_cores": cores(2), "host_busy": busy,
           "host_busy_cores": None if busy is None else busy * (os.cpu_count() or 1)}
    proxy = row["proxy_cores"]
    row["limit"] = saturation_limit(None if proxy is None else proxy / processes, row["backend_cores"],
                                    row["client_cores"], busy)
    return row


async def _saturate(targets: list[Target], backend_pid: int, cfg: OverheadConfig, log: Any) -> dict[str, Any]:
    """Per level (rising concurrency), each target in turn (the order rotated by one per level) streams
    ``max(saturation_requests, 2 * level)`` requests of ``saturation_tokens`` chunks ``saturation_gap_ms``
    apart; chunks/s at the client, and CPU (cores) of the proxy, backend, client and machine over the phase."""
    levels: dict[str, Any] = {}
    me = os.getpid()
    for i, level in enumerate(cfg.saturation_levels):
        n = max(cfg.saturation_requests, 2 * level)
        reqs = requests_for(n, cfg.saturation_tokens, {"bench_gap_ms": cfg.saturation_gap_ms})
        rows: dict[str, Any] = {}
        for t in _rotated(targets, i):
            before = (_cpu(t.pid), _cpu(backend_pid), _cpu(me), host_cpu_times())
            t0 = time.perf_counter()
            result = await run([t], reqs, Arrival(concurrency=level), request_timeout=120)
            wall = time.perf_counter() - t0
            after = (_cpu(t.pid), _cpu(backend_pid), _cpu(me), host_cpu_times())
            rows[t.name] = _saturation_row(result, t.name, wall, before, after,
                                           cfg.workers if t.name == workers_name(cfg.workers) else 1)
        levels[str(level)] = {t.name: rows[t.name] for t in targets}
        log(f"  saturation {level:>5} streams: " + "  ".join(
            f"{name}: {_f(r['chunks_per_s'], 0)} chunks/s ({_f(r['proxy_cores'], 2)} cores, {r['limit']})"
            for name, r in levels[str(level)].items()))
    return {"config": {"levels": list(cfg.saturation_levels), "requests": cfg.saturation_requests,
                       "max_tokens": cfg.saturation_tokens, "gap_ms": cfg.saturation_gap_ms,
                       "cores": os.cpu_count(), "saturated_at_cores": SATURATED_CORES},
            "levels": levels}


def saturation_summary(levels: dict[str, Any], capacity: dict[str, float | None]) -> dict[str, Any]:
    """Per target: its highest chunks/s over the levels, where, the proxy's cores and the limit there, whether it
    was saturated, and the cost phase's capacity (1e6 / C: chunks/s one fully used core carries)."""
    out: dict[str, Any] = {}
    names = list(dict.fromkeys(n for rows in levels.values() for n in rows))
    for name in names:
        best_level, best = None, None
        for level, rows in levels.items():
            row = rows.get(name)
            if row is not None and row.get("chunks_per_s") is not None and (
                    best is None or row["chunks_per_s"] > best["chunks_per_s"]):
                best_level, best = level, row
        out[name] = {"max_chunks_per_s": None if best is None else best["chunks_per_s"],
                     "at_level": None if best_level is None else int(best_level),
                     "proxy_cores": None if best is None else best.get("proxy_cores"),
                     "limit": None if best is None else best.get("limit"),
                     "saturated": bool(best is not None and (best.get("proxy_cores") or 0) >= SATURATED_CORES),
                     "capacity_chunks_per_s": capacity.get(name)}
    return out


def _target(value: float | None, target: float, op: str, unit: str, what: str, **extra: Any) -> dict[str, Any]:
    met = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"what": what, "value": value, "target": target, "op": op, "unit": unit, "met": met, **extra}


def evaluate_targets(doc: dict[str, Any], gateway: str = "gateway") -> dict[str, Any]:
    """The issue's targets for ``gateway`` (against the Rust router, where the run had one): value, target,
    and met (true/false; null where the run has no figure). From a run's figures or from the medians."""
    ref = (doc.get("vs_reference") or {}).get("reference")
    cost = (doc.get("cost") or {}).get("targets") or {}
    g, r = cost.get(gateway) or {}, (cost.get(ref) or {}) if ref else {}
    floor = cost.get(RELAY) or {}  # the bare relay's, where the run has one: what no proxy here goes under
    out: dict[str, Any] = {
        "cpu_us_per_chunk": _target(g.get("cpu_us_per_chunk"), CPU_US_PER_CHUNK_TARGET, "<=", "us",
                                    "gateway CPU per streamed chunk (cost phase, /proc)",
                                    error=g.get("cpu_us_per_chunk_error"), reference=r.get("cpu_us_per_chunk"),
                                    relay=floor.get("cpu_us_per_chunk")),
        "cpu_us_per_request": _target(g.get("cpu_us_per_request"), CPU_US_PER_REQUEST_TARGET, "<=", "us",
                                      "gateway CPU per request, routing to response end, excluding chunks "
                                      "(cost phase, /proc)", error=g.get("cpu_us_per_request_error"),
                                      reference=r.get("cpu_us_per_request"), relay=floor.get("cpu_us_per_request")),
    }
    sat = (doc.get("saturation") or {}).get("targets") or {}
    gs, rs = sat.get(gateway) or {}, (sat.get(ref) or {}) if ref else {}
    out["chunks_per_s"] = _target(gs.get("max_chunks_per_s"), CHUNKS_PER_S_TARGET, ">=", "chunks/s",
                                  "chunks/s one gateway process streams (saturation phase, at the client)",
                                  saturated=gs.get("saturated"), limit=gs.get("limit"),
                                  capacity_chunks_per_s=gs.get("capacity_chunks_per_s"),
                                  reference=rs.get("max_chunks_per_s"),
                                  relay=(sat.get(RELAY) or {}).get("max_chunks_per_s"))
    ratios = (doc.get("vs_reference") or {}).get("levels") or {}
    for level, limit in TTFT_X_TARGETS.items():
        if str(level) not in (doc.get("levels") or {}):
            continue
        row = (ratios.get(str(level)) or {}).get(gateway) or {}
        out[f"added_ttft_p50_x_at_{level}"] = _target(
            row.get("added_ttft_p50_x"), limit, "<=", "x",
            f"gateway's added TTFT p50 over {ref or 'the Rust router'}'s at {level} streams (one run's ratio)")
    for part, what in (("state", "shared state (slots)"), ("state_limited", "shared state, a requests/min key"),
                       ("state_tokens", "shared state, a tokens/min key")):
        row = ((doc.get(part) or {}).get("levels") or {}).get(str(STATE_TTFT_LEVEL))
        alone = ((doc.get("state_pairs") or {}).get(part) or {}).get("ttft_us_p50_paired") or {}
        if alone.get("median") is not None:
            # judged on the pair run alone (see _state_pairs), where the run has it
            out[f"{part}_ttft_us_p50_at_{STATE_TTFT_LEVEL}"] = _target(
                alone["median"], STATE_TTFT_US_TARGET, "<=", "us",
                f"TTFT p50 that {what} in a loopback redis-server adds at {STATE_TTFT_LEVEL} streams (the pair "
                "alone: median of the rounds' paired differences)",
                pooled=row.get("ttft_us_p50") if row is not None else None,
                ci90=[alone.get("low"), alone.get("high")], rounds=alone.get("pairs"), phase="state_pairs")
        elif row is not None:
            # judged on the round-by-round difference where the run has one (the pooled p50s' difference moves
            # with the machine's drift between the two targets' turns); its 90% interval says how sure that is
            paired = row.get("ttft_us_p50_paired") or {}
            value = paired.get("median") if paired.get("median") is not None else row.get("ttft_us_p50")
            out[f"{part}_ttft_us_p50_at_{STATE_TTFT_LEVEL}"] = _target(
                value, STATE_TTFT_US_TARGET, "<=", "us",
                f"TTFT p50 that {what} in a loopback redis-server adds at {STATE_TTFT_LEVEL} streams "
                "(median of the rounds' paired differences)", pooled=row.get("ttft_us_p50"),
                ci90=[paired.get("low"), paired.get("high")], rounds=paired.get("pairs"), phase="levels")
    hold = (doc.get("hold") or {}).get(gateway)
    if hold is not None:
        want = (doc.get("config") or {}).get("hold") or hold.get("streams")
        out["hold_complete"] = _target(hold.get("complete"), want, ">=", "streams",
                                       f"{want} concurrent streams through the gateway complete")
    return out


def median_of(values: list[Any]) -> Any:
    """The median of several runs' figures, recursively: numbers the median of those present (ints stay ints
    where the median is whole), booleans the majority, dicts key by key; anything else (strings, lists) the first
    run's."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    if all(isinstance(v, dict) for v in present):
        keys = list(dict.fromkeys(k for v in present for k in v))
        return {k: median_of([v.get(k) for v in present]) for k in keys}
    if all(isinstance(v, bool) for v in present):
        return 2 * sum(present) > len(present)
    if all(v == present[0] and type(v) is type(present[0]) for v in present):
        return present[0]  # the same in every run (a setting, a count): as it was
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        finite = [v for v in present if not (isinstance(v, float) and math.isnan(v))]
        if not finite:
            return None
        median = statistics.median(finite)
        return int(median) if all(isinstance(v, int) for v in finite) and median == int(median) else median
    return present[0]


SUMMARY_KEYS = ("levels", "max_chunks_per_s", "vs_reference", "translation", "cost", "saturation", "hold",
                "tracing", "state", "state_limited", "state_tokens", "state_pairs", "workers")


def summarize_runs(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of ``docs`` (one per run): each figure the median of the runs' (a ratio: of each run's
    ratio), ``targets`` evaluated on the medians with each run's value under ``runs``, the runs under ``runs``."""
    if not docs:
        raise ValueError("no runs")
    out: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "config": docs[0].get("config", {}), "repeat": len(docs),
                           "summary": f"median of {len(docs)} run{'s' if len(docs) > 1 else ''}"}
    for key in SUMMARY_KEYS:
        if any(key in d for d in docs):
            out[key] = median_of([d.get(key) for d in docs])
    spy = next((d["py_spy"] for d in reversed(docs) if "py_spy" in d), None)
    if spy is not None:
        out["py_spy"] = spy
    out["targets"] = evaluate_targets(out)
    for key, entry in out["targets"].items():
        entry["runs"] = [((d.get("targets") or {}).get(key) or {}).get("value") for d in docs]
    out["runs"] = docs
    return out


def _traced_gateway(cfg: OverheadConfig, backend_url: str, logs: Path) -> tuple[ChildProcess, ChildProcess, str]:
    """The gateway again, on ``base_port + 3``, with tracing exported to an OTLP sink on ``base_port + 4``."""
    py = sys.executable
    port, sink_port = cfg.base_port + 3, cfg.base_port + 4
    sink_url = f"http://127.0.0.1:{sink_port}"
    code = f"from gateway.bench.overhead import otlp_sink; otlp_sink({sink_port})"
    sink = ChildProcess("otlp sink", [py, "-c", code], logs / "otlp-sink.log")
    config_file = logs / "gateway-tracing.yaml"
    config_file.write_text(gateway_yaml(backend_url, port))
    env = ["env", "OTEL_SDK_DISABLED=false", "OTEL_TRACES_EXPORTER=otlp", f"OTEL_EXPORTER_OTLP_ENDPOINT={sink_url}",
           f"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={sink_url}/v1/traces", "OTEL_SERVICE_NAME=llm-gateway-bench"]
    traced = ChildProcess(TRACED, [*env, py, "-m", "gateway", "serve", "--config", str(config_file),
                                   "--log-level", "warning"], logs / "gateway-tracing.log")
    return traced, sink, sink_url


def otlp_sink(port: int) -> None:
    """An OTLP/HTTP endpoint on 127.0.0.1:``port`` that answers every POST with 200 and an empty body and
    keeps nothing; ``GET /stats`` says how many exports (and bytes) it received. Runs until killed."""
    import json

    counts = {"exports": 0, "bytes": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path = [*head[0].split(" "), "", ""][:2]
                length = next((int(v) for k, _, v in (h.partition(":") for h in head[1:])
                               if k.strip().lower() == "content-length"), 0)
                body = await reader.readexactly(length) if length else b""
                payload, kind = b"", b"application/x-protobuf"
                if method == "GET" and path == "/stats":
                    payload, kind = json.dumps(counts).encode(), b"application/json"
                else:
                    counts["exports"] += 1
                    counts["bytes"] += len(body)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (kind, len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


async def _profile_gateway(target: Target, cfg: OverheadConfig, logs: Path) -> dict[str, Any]:
    out_file = logs / f"{target.name}-pyspy.txt"
    assert target.pid is not None
    proc = start_record(target.pid, cfg.py_spy_seconds, out_file)
    if proc is None:
        return {"error": "py-spy is not installed"}
    await asyncio.sleep(1.0)  # py-spy attaches
    reqs = requests_for(100_000, cfg.tokens)
    arrival = Arrival(concurrency=cfg.py_spy_concurrency, duration=cfg.py_spy_seconds)
    result = await run([target], reqs, arrival, request_timeout=120)
    _, err = await asyncio.to_thread(proc.communicate)
    if proc.returncode != 0 or not out_file.exists():
        return {"error": f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}"}
    text = out_file.read_text()
    return {
        "file": str(out_file), "target": target.name, "concurrency": cfg.py_spy_concurrency,
        "requests": len(result.results[target.name]),
        "top_areas": [{"area": area, "self_samples": k, "self_share": share} for area, k, share in top_areas(text)],
        "top_self": [asdict(f) for f in top_frames(text, 25, by="self")],
        "top_total": [asdict(f) for f in top_frames(text, 40, by="total")],
    }


REFERENCES = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}


def rust_reference(py: str, wanted: str) -> tuple[str, str] | None:
    """(name, module) of the Rust router to measure against: ``wanted``, or with "auto" SMG when installed,
    else sglang-router; None when it is not installed."""
    bindir = Path(py).parent
    for name in (["smg", "sglang-router"] if wanted == "auto" else [wanted]):
        if shutil.which(name) is not None or (bindir / name).exists():
            return name, REFERENCES[name]
    return None


def run_once(cfg: OverheadConfig, log: Any = print, logs: Path | None = None, run_index: int = 0) -> dict[str, Any]:
    """One run of every phase with fresh processes; their logs (and configuration files) under ``logs``."""
    logs = logs or cfg.out
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    backend_port, gateway_port, router_port = cfg.base_port, cfg.base_port + 1, cfg.base_port + 2
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(backend_port),
                                           "--tokens", str(cfg.tokens), "--gap-ms", str(cfg.gap_ms),
                                           "--model", MODEL], logs / "backend.log")
    config_file = logs / "gateway.yaml"
    config_file.write_text(gateway_yaml(backend_url, gateway_port))
    # with --tracing, the untraced gateway is made sure to be untraced whatever OTEL_* the caller has set
    untraced_env = ["env", "OTEL_SDK_DISABLED=true"] if cfg.tracing else []
    gateway = ChildProcess("gateway", [*untraced_env, py, "-m", "gateway", "serve", "--config", str(config_file),
                                       "--log-level", "warning"], logs / "gateway.log")
    traced, sink, sink_url = _traced_gateway(cfg, backend_url, logs) if cfg.tracing else (None, None, "")
    redis = stateful = limited = tokens = limited_local = tokens_local = None
    stateful_url = limited_url = tokens_url = limited_local_url = tokens_local_url = ""
    if cfg.state:
        if not redis_available():
            raise RuntimeError("--state needs redis-server (Debian: apt-get install redis-server)")
        redis, stateful, stateful_url = stateful_gateway(cfg.base_port, gateway_yaml(backend_url, cfg.base_port + 7),
                                                         logs, py)
        def limited_one(limit: Literal["requests_per_minute", "tokens_per_minute"],
                        shared: bool) -> tuple[ChildProcess, str]:
            port = limited_port(cfg.base_port, limit, shared)
            return limited_gateway(cfg.base_port, gateway_yaml(backend_url, port), logs, py, limit, shared)

        limited, limited_url = limited_one("requests_per_minute", True)
        tokens, tokens_url = limited_one("tokens_per_minute", True)
        # (the same keys without Redis: what each limited gateway's shared state is measured against)
        limited_local, limited_local_url = limited_one("requests_per_minute", False)
        tokens_local, tokens_local_url = limited_one("tokens_per_minute", False)
    several: ChildProcess | None = None
    several_url = ""
    if cfg.workers > 1:
        if not redis_available():
            raise RuntimeError("--workers needs redis-server (Debian: apt-get install redis-server)")
        if redis is None:
            redis = redis_child(cfg.base_port + 6, logs)
        several, several_url = workers_gateway(cfg.base_port, gateway_yaml(backend_url, cfg.base_port + 8), logs, py,
                                               cfg.workers)
    relay: ChildProcess | None = None
    relay_url = f"http://127.0.0.1:{cfg.base_port + 13}"
    if cfg.relay:
        relay = ChildProcess(RELAY, [py, "-m", "gateway.bench.relay", "--port", str(cfg.base_port + 13),
                                     "--upstream", f"127.0.0.1:{backend_port}"], logs / "relay.log")
    router: ChildProcess | None = None
    reference = rust_reference(py, cfg.reference) if cfg.rust else None
    if cfg.rust and reference is None:
        log(f"no Rust router installed (pip install smg, or sglang-router) for --reference {cfg.reference}: "
            "running without the Rust reference")
    if reference is not None:
        name, module = reference
        router = ChildProcess(name, [py, "-m", module, "--host", "127.0.0.1", "--port", str(router_port),
                                     "--worker-urls", backend_url, "--policy", "round_robin", "--log-level", "warn",
                                     # its metrics on base + 5, not on the default 0.0.0.0:29000 that another
                                     # router (another run of this benchmark) may hold
                                     "--prometheus-host", "127.0.0.1", "--prometheus-port", str(cfg.base_port + 5)],
                              logs / "router.log")
    probe = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' % MODEL.encode()
    started = time.perf_counter()
    try:
        backend.start().wait_http(backend_url + "/health")
        gateway.start().wait_http(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", method="POST", body=probe)
        targets = [Target("direct", backend_url, MODEL, pid=backend.pid),
                   Target("gateway", f"http://127.0.0.1:{gateway_port}", MODEL, pid=gateway.pid)]
        if traced is not None and sink is not None:
            sink.start().wait_http(sink_url + "/stats")
            traced_url = f"http://127.0.0.1:{cfg.base_port + 3}"
            traced.start().wait_http(traced_url + "/v1/chat/completions", method="POST", body=probe)
            targets.append(Target(TRACED, traced_url, MODEL, pid=traced.pid))
        if redis is not None:
            redis.start()
        if stateful is not None:
            stateful.start().wait_http(stateful_url + "/v1/chat/completions", method="POST", body=probe)
            targets.append(Target(STATEFUL, stateful_url, MODEL, pid=stateful.pid))
        for proc, url in ((limited_local, limited_local_url), (limited, limited_url),
                          (tokens_local, tokens_local_url), (tokens, tokens_url)):
            if proc is not None:
                proc.start().wait_http(url + "/v1/chat/completions", method="POST", body=probe,
                                       headers={"Authorization": f"Bearer {LIMITED_KEY}"})
                targets.append(Target(proc.name, url, MODEL, api_key=LIMITED_KEY, pid=proc.pid))
        if several is not None:
            several.start().wait_http(several_url + "/v1/chat/completions", method="POST", body=probe)
            _wait_workers(several_url, cfg.workers)
            # (its pid is the supervisor's: its CPU readings add up the workers under it)
            targets.append(Target(several.name, several_url, MODEL, pid=several.pid))
        if relay is not None:
            relay.start().wait_http(relay_url + "/health")
            targets.append(Target(RELAY, relay_url, MODEL, pid=relay.pid))
        if router is not None:
            router.start().wait_http(f"http://127.0.0.1:{router_port}/v1/chat/completions", method="POST",
                                     body=probe)
            targets.append(Target(router.name, f"http://127.0.0.1:{router_port}", MODEL, pid=router.pid))
        log(f"targets: {', '.join(t.name for t in targets)}; levels {cfg.levels}, {cfg.rounds} rounds")
        profiled = next((t for t in targets if t.name == cfg.py_spy_target), None)
        if cfg.py_spy_seconds > 0 and profiled is None:  # (said before the phases, not after them)
            raise RuntimeError(f"--py-spy-target {cfg.py_spy_target}: no such target (these run: "
                               f"{', '.join(t.name for t in targets)})")
        doc: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}}
        doc["levels"] = run_sync(_measure(targets, cfg, log))
        max_cps = {t.name: max((r[t.name]["chunks_per_s"] or 0) for r in doc["levels"].values()) for t in targets}
        doc["max_chunks_per_s"] = max_cps
        doc["vs_reference"] = vs_reference(doc["levels"], router.name if router is not None else None)
        if cfg.translation_level > 0:
            level = cfg.translation_level
            per_round = max(cfg.min_round, 2 * level)
            doc["translation"] = run_sync(measure_translation(targets[0], targets[1], requests_for(
                per_round * cfg.rounds, cfg.tokens), level, per_round, log))
        by_name = {t.name: t for t in targets}
        pairs = [(part, by_name[off], by_name[on]) for part, off, on in STATE_PAIRS
                 if off in by_name and on in by_name]
        # (the first pair runs right after the levels phase: each run of a --repeat starts with another one)
        pairs = _rotated(pairs, run_index)
        if cfg.state and cfg.state_rounds > 0 and pairs:
            log(f"state pairs: each pair alone, {cfg.state_rounds} rounds at {STATE_TTFT_LEVEL} streams")
            doc["state_pairs"] = run_sync(_state_pairs(pairs, cfg, log))
        if cfg.cost_requests > 0:
            log(f"cost: {cfg.cost_requests} requests per target with {cfg.cost_prompt_chars}-character prompts, "
                f"max_tokens {cfg.cost_tokens[0]} and {cfg.cost_tokens[1]}, {cfg.cost_concurrency} streams")
            doc["cost"] = run_sync(_cost(targets, cfg, log))
        if cfg.saturation_levels:
            log(f"saturation: {cfg.saturation_tokens} chunks {cfg.saturation_gap_ms} ms apart at "
                f"{cfg.saturation_levels} streams")
            doc["saturation"] = run_sync(_saturate(targets, backend.pid, cfg, log))
            capacity = {n: v.get("capacity_chunks_per_s") for n, v in (doc.get("cost") or {}).get("targets",
                                                                                                  {}).items()}
            doc["saturation"]["targets"] = saturation_summary(doc["saturation"]["levels"], capacity)
        if cfg.hold:
            log(f"holding {cfg.hold} streams for ~{cfg.hold_seconds:.0f} s through each target")
            doc["hold"] = run_sync(_hold(targets, backend_url, cfg))
        if cfg.py_spy_seconds > 0:
            assert profiled is not None
            log(f"py-spy on {profiled.name} for {cfg.py_spy_seconds:.0f} s at {cfg.py_spy_concurrency} streams")
            doc["py_spy"] = run_sync(_profile_gateway(profiled, cfg, logs))
        if stateful is not None:
            # (tracing_cost compares any two gateways' rows: here with shared state against without)
            doc["state"] = {"store": "redis-server on loopback; every request holds a slot of the backend's "
                                     "max_concurrency (taken from the replica's kept slots when it has one)",
                            "levels": tracing_cost(doc["levels"], "gateway", STATEFUL),
                            **state_counts(stateful_url)}
        if limited is not None:
            doc["state_limited"] = {"store": "the same redis-server; the key has a requests_per_minute limit: its "
                                             "requests are leased a few at a time",
                                    "against": LIMITED_LOCAL,
                                    "levels": tracing_cost(doc["levels"], LIMITED_LOCAL, LIMITED),
                                    **state_counts(limited_url)}
        if tokens is not None:
            doc["state_tokens"] = {"store": "the same redis-server; the key has a tokens_per_minute limit: its "
                                            "tokens are leased a few reservations at a time",
                                   "against": TOKENS_LOCAL,
                                   "levels": tracing_cost(doc["levels"], TOKENS_LOCAL, TOKENS),
                                   **state_counts(tokens_url)}
        if several is not None:
            baseline = STATEFUL if stateful is not None else "gateway"
            sat = (doc.get("saturation") or {}).get("levels") or {}
            doc["workers"] = {
                "count": cfg.workers, "against": baseline, "cores": os.cpu_count(),
                "levels": tracing_cost(doc["levels"], baseline, several.name),
                "saturation": {level: {name: {k: rows[name].get(k) for k in ("chunks_per_s", "proxy_cores", "limit")}
                                       for name in (baseline, several.name) if name in rows}
                               for level, rows in sat.items()}}
        if traced is not None:
            doc["tracing"] = {"exporter": "OTLP/HTTP (protobuf) to a loopback sink that discards",
                              "levels": tracing_cost(doc["levels"]), "sink": get_json(sink_url + "/stats")}
    finally:
        if router is not None:
            _stop_soon(router, 1.0)  # SMG drains for 5 s on SIGTERM; nothing of it is measured any more
        for proc in (traced, sink, several, stateful, limited, tokens, limited_local, tokens_local, redis, relay,
                     gateway, backend):
            if proc is not None:
                proc.stop()
    doc["wall_s"] = time.perf_counter() - started
    doc["targets"] = evaluate_targets(doc)
    return doc


def _wait_workers(url: str, count: int, timeout: float = 30.0) -> None:
    """Until the gateway's /metrics adds up ``count`` workers (each has started and answers its siblings)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                if f"gateway_workers {float(count)}" in resp.read().decode():
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url}: not all of its {count} workers answered within {timeout:.0f} s")


def _stop_soon(child: ChildProcess, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds (by the child's own pid)."""
    proc = child.proc
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def run_overhead(cfg: OverheadConfig, log: Any = print) -> dict[str, Any]:
    """``cfg.repeat`` runs (fresh processes each); writes ``overhead-N.json`` per run and the summary
    ``overhead.json`` (medians, the runs under ``runs``) and ``overhead.png``; returns the summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(1, max(1, cfg.repeat) + 1):
        if cfg.repeat > 1:
            log(f"run {i} of {cfg.repeat}")
        doc = run_once(cfg, log, cfg.out / f"run-{i}" if cfg.repeat > 1 else cfg.out, run_index=i - 1)
        doc["run"] = i
        write_json(doc, cfg.out / f"overhead-{i}.json")
        if cfg.repeat > 1:
            plot_overhead(doc, cfg.out / f"overhead-{i}.png")
        docs.append(doc)
    summary = summarize_runs(docs)
    write_json(summary, cfg.out / "overhead.json")
    plot_overhead(summary, cfg.out / "overhead.png")
    return summary


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,16,64,256", help="concurrency levels (default 1,16,64,256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-round", type=int, default=24, help="requests per target per round, at least")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--hold", type=int, default=1000, help="streams held at once at the end (0: skip)")
    p.add_argument("--hold-seconds", type=float, default=3.0)
    p.add_argument("--no-rust", action="store_true", help="without the Rust router reference")
    p.add_argument("--no-relay", action="store_true",
                   help="without the bare TCP relay (port base+13), the floor of any proxy's cost on this machine")
    p.add_argument("--reference", choices=["auto", *REFERENCES], default="auto",
                   help="the Rust router to measure against (auto: smg when installed, else sglang-router)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS", help="profile the gateway under load")
    p.add_argument("--py-spy-concurrency", type=int, default=64)
    p.add_argument("--py-spy-target", default="gateway",
                   help="the target profiled: gateway (default), or another target of the run by name (e.g. "
                        f"{STATEFUL} with --state)")
    p.add_argument("--tracing", action="store_true",
                   help="also a gateway with OpenTelemetry tracing on, exporting to a loopback OTLP sink that "
                        "discards (ports base+3 and base+4); reports what tracing adds per request")
    p.add_argument("--state", action="store_true",
                   help="also a gateway with its limits and slots in a loopback redis-server (ports base+6 and "
                        "base+7); reports what shared state adds per request")
    p.add_argument("--state-rounds", type=int, default=100, metavar="N",
                   help="with --state: rounds of each pair (a gateway without shared state and with it) run alone "
                        "at 16 streams, the figure the scale-out target is judged on (0: skip)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="also a gateway of N worker processes (server.workers) sharing a loopback redis-server "
                        "(ports base+6 and base+8); reports what they change per level and at saturation")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything N times (fresh processes each); overhead.json holds the medians")
    g = p.add_argument_group("cost phase (CPU per request and per chunk, solved from two runs)")
    g.add_argument("--cost-requests", type=int, default=2000, help="requests per target per run (0: skip)")
    g.add_argument("--no-cost", action="store_true", help="skip the cost phase")
    g.add_argument("--cost-concurrency", type=int, default=16)
    g.add_argument("--cost-tokens", default="4,64", help="max_tokens of the two runs, A,B (default 4,64)")
    g.add_argument("--cost-gap-ms", type=float, default=2.0, help="between chunks (default 2)")
    g.add_argument("--cost-rounds", type=int, default=2, help="interleaved rounds per run (default 2)")
    g.add_argument("--cost-prompt-chars", type=int, default=8000, help="prompt length (default 8000: ~2,000 tokens)")
    p.add_argument("--translation-level", type=int, default=16,
                   help="streams of the translation phase: a translated /v1/messages stream against a native "
                        "chat stream through the gateway (0: skip)")
    g = p.add_argument_group("saturation phase (chunks/s one process streams)")
    g.add_argument("--saturation-levels", default="256,512,1024", help="concurrency levels ('' or 0: skip)")
    g.add_argument("--no-saturation", action="store_true", help="skip the saturation phase")
    g.add_argument("--saturation-requests", type=int, default=1024,
                   help="requests per target per level, at least (and at least 2x the level)")
    g.add_argument("--saturation-tokens", type=int, default=32)
    g.add_argument("--saturation-gap-ms", type=float, default=1.0)
    p.add_argument("--base-port", type=int, default=18500,
                   help="backend, gateway, router on 3 consecutive ports; +3, +4 with --tracing; +5 the router's "
                        "metrics")
    p.add_argument("--out", type=Path, default=Path("reports/overhead"))
    a = p.parse_args(argv)
    cost_tokens = _ints(a.cost_tokens)
    if len(cost_tokens) != 2 or cost_tokens[0] == cost_tokens[1] or min(cost_tokens) < 1:
        p.error("--cost-tokens: two different max_tokens, A,B")
    cfg = OverheadConfig(levels=_ints(a.levels), rounds=a.rounds, min_round=a.min_round,
                         tokens=a.tokens, gap_ms=a.gap_ms, hold=a.hold, hold_seconds=a.hold_seconds,
                         rust=not a.no_rust, relay=not a.no_relay, reference=a.reference, py_spy_seconds=a.py_spy,
                         py_spy_concurrency=a.py_spy_concurrency, py_spy_target=a.py_spy_target,
                         tracing=a.tracing, state=a.state, state_rounds=max(0, a.state_rounds),
                         workers=max(1, a.workers),
                         base_port=a.base_port, out=a.out,
                         repeat=max(1, a.repeat),
                         cost_requests=0 if a.no_cost else max(0, a.cost_requests),
                         cost_concurrency=a.cost_concurrency, cost_tokens=(cost_tokens[0], cost_tokens[1]),
                         cost_gap_ms=a.cost_gap_ms, cost_rounds=a.cost_rounds, cost_prompt_chars=a.cost_prompt_chars,
                         saturation_levels=[] if a.no_saturation else [x for x in _ints(a.saturation_levels) if x > 0],
                         saturation_requests=a.saturation_requests, saturation_tokens=a.saturation_tokens,
                         saturation_gap_ms=a.saturation_gap_ms, translation_level=max(0, a.translation_level))
    doc = run_overhead(cfg)
    print_overhead(doc)
    print(f"wrote {cfg.out / 'overhead.json'} (and overhead-1.json ...) and {cfg.out / 'overhead.png'}")
    return 0
