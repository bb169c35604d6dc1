"""Calibrate the llama.cpp emulator against a real ``llama-server`` on this CPU (issue 4, item 4).

    python -m gateway.llamacpp.calibrate [--out reports/calibration] [--rounds 3]

One small workload, sent with plain aiohttp streaming (not through the gateway) to a real llama-server
(the generated "large" model, 2 slots, 1 thread, no host-RAM prompt cache) and to the llama.cpp emulator:

* TTFT against prompt length (uncached prompts of exact token counts, built with each server's ``/tokenize``),
* TTFT of a prompt whose first N tokens are cached in a slot (same prefix, different tail) against uncached,
* decode speed: one stream at a short and at long contexts, two streams at once,
* slot queueing: 4 concurrent requests (sent 5 ms apart) on 2 slots, TTFT of the later two against the first two.

A probe round on the real server gives the emulator's profile (:func:`derive_overrides`: prefill tok/s, its
growth with context, fixed prefill cost, decode step time, its growth with batch and context, slots); a probe
of the emulator corrects what its own HTTP path adds (:func:`refine`). Then ``--rounds`` rounds run the workload
on both, interleaved; each measurement's best round is kept (load from other processes only adds time; ratios
from medians are in the JSON too), and the report compares shape ratios (:func:`shape_ratios`, :func:`compare`), real
against emulated, in ``calibration.json`` and ``calibration.png`` under ``--out``, and prints a table.
It is a report, not a test: absolute figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LENGTHS = (100, 250, 500, 1000, 2000)  # uncached prompt lengths; ratios are against the first
FLOOR_LENGTH = 16  # a tiny prompt: the fixed per-request cost (fit only)
CACHED_PREFIXES = (1000, 1800)  # cached prefix tokens of a prompt of max(LENGTHS) tokens
SWEEP_TOKENS = 32  # tokens generated per sweep request (also gives decode speed at that context)
DECODE_TOKENS = 64  # tokens generated in the decode measurements
QUEUE_PROMPT = 250
QUEUE_TOKENS = 32
QUEUE_REQUESTS = 4
QUEUE_STAGGER_S = 0.005  # requests leave 5 ms apart, so arrival order (and slot order) is defined
PROBE_ROUNDS = 3
SLOTS = 2
CTX_PER_SLOT = 4096
PREFILL_BATCH = 2048  # llama-server's default n_batch: prompt tokens per llama_decode call
TOLERANCE = 0.15
MODEL_NAME = "calibration"
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word"
    " but not what all were we when your can said there use an each which she do how their if will up other"
    " about out many then them these so some her would make like him into time has look two more write go see"
    " number no way could people my than first water been call who oil its now find long down day did get come"
    " made may part model token cache prefix server gateway request stream json value name list item key string"
).split()
ADJUSTMENTS = [
    "prefill_base_s (new): a fixed cost on every step that processes prompt tokens; the real server needs a few "
    "ms for a 16-token prompt, the emulator answered it at once",
    "prefill_ctx_growth (new): prefill cost per token grows with its position (attention); the real TTFT is "
    "quadratic in prompt length (2,000 tokens cost ~35x what 100 do, not 20x), and a cached prefix still slows "
    "the uncached tail that attends to it, so a 90% cached prompt saves ~80%, not 90%",
    "decode_ctx_growth (new): each decoding sequence adds step time in proportion to its context (its KV reads); "
    "the real inter-token time grows several-fold from 100 to 2,000 tokens of context",
    "the scheduler sums per-chunk prefill costs at each chunk's positions and passes the decoding sequences' "
    "context to the step time; all three new parameters default to 0 (unchanged behaviour) except in the "
    "llamacpp profiles",
    "profiles: 'llamacpp' gained modest GPU-scale context terms; 'llamacpp-cpu' holds the figures measured here "
    "(generated large model, 2 slots, 1 thread)",
]


# -- measurements ----------------------------------------------------------------------------------------------
@dataclass
class Run:
    """One streamed request as the client saw it (seconds) and as the server reported it."""

    ttft: float
    itl: float  # mean seconds per token after the first; nan with fewer than 2 tokens
    tokens: int
    prompt_tokens: int
    cached: int
    server_prompt_ms: float | None = None
    chunks: int = 0


@dataclass
class Workload:
    """One round of the workload on one server."""

    floor: Run
    sweep: dict[int, Run]
    cached: dict[int, Run]
    decode1: Run
    decode2: list[Run]
    queue: list[Run]


@dataclass
class Summary:
    """One figure per measurement over rounds (see :func:`summarize`); seconds, keyed by prompt length, cached
    prefix or context."""

    floor_ttft: float
    ttft: dict[int, float]
    itl: dict[int, float]  # single-stream inter-token time keyed by the mean context while decoding
    cached_ttft: dict[int, float]
    cached_tokens: dict[int, int]
    decode_itl_1: float
    decode_itl_2: float
    decode_ctx: int  # context of each decode-measurement stream, mid-generation
    queue_ttft: list[float]  # by rank, fastest first
    slots: int = SLOTS
    ctx_per_slot: int = CTX_PER_SLOT
    lengths_sent: dict[int, int] = field(default_factory=dict)


def _least(values: Sequence[float]) -> float:
    return min(values)


STATS: dict[str, Callable[[Sequence[float]], float]] = {"min": _least, "median": statistics.median}


def summarize(rounds: Sequence[Workload], slots: int = SLOTS, ctx_per_slot: int = CTX_PER_SLOT,
              stat: str = "min") -> Summary:
    """Each measurement's best (``min``, the default: other load on the machine only adds time) or median
    over rounds."""
    if not rounds:
        raise ValueError("no rounds")
    pick = STATS[stat]

    def _median(values: Sequence[float]) -> float:
        vals = [v for v in values if not math.isnan(v)]
        return float(pick(vals)) if vals else math.nan

    lengths = sorted(rounds[0].sweep)
    prefixes = sorted(rounds[0].cached)
    n_queue = len(rounds[0].queue)
    return Summary(
        floor_ttft=_median([w.floor.ttft for w in rounds]),
        ttft={n: _median([w.sweep[n].ttft for w in rounds]) for n in lengths},
        itl={n + SWEEP_TOKENS // 2: _median([w.sweep[n].itl for w in rounds]) for n in lengths},
        cached_ttft={n: _median([w.cached[n].ttft for w in rounds]) for n in prefixes},
        cached_tokens={n: int(_median([w.cached[n].cached for w in rounds])) for n in prefixes},
        decode_itl_1=_median([w.decode1.itl for w in rounds]),
        decode_itl_2=_median([statistics.fmean(r.itl for r in w.decode2) for w in rounds]),
        decode_ctx=FLOOR_LENGTH + DECODE_TOKENS // 2,
        queue_ttft=[_median([sorted(r.ttft for r in w.queue)[i] for w in rounds]) for i in range(n_queue)],
        slots=slots,
        ctx_per_slot=ctx_per_slot,
        lengths_sent={n: rounds[0].sweep[n].prompt_tokens for n in lengths},
    )


# -- shape ratios ----------------------------------------------------------------------------------------------
def shape_ratios(s: Summary) -> dict[str, float]:
    """Dimensionless shapes: TTFT growth with length, cached/uncached, queued/unqueued, decode slowdowns.

    ``decode_tok_s`` (single stream, short context) is the one absolute figure kept, to compare speeds too.
    """
    lengths = sorted(s.ttft)
    base, longest = lengths[0], lengths[-1]
    out: dict[str, float] = {}
    for n in lengths[1:]:
        out[f"ttft({n})/ttft({base})"] = s.ttft[n] / s.ttft[base]
    for n in sorted(s.cached_ttft):
        out[f"ttft(cached {n} of {longest})/ttft(uncached)"] = s.cached_ttft[n] / s.ttft[longest]
    q = s.queue_ttft
    half = s.slots
    if len(q) > half:
        out[f"queue ttft(3rd,4th)/ttft(1st,2nd) on {s.slots} slots"] = statistics.fmean(q[half:]) / statistics.fmean(
            q[:half])
    out["decode tok/s, 1 stream"] = 1.0 / s.decode_itl_1
    out["decode itl 2 streams / 1 stream"] = s.decode_itl_2 / s.decode_itl_1
    ctxs = sorted(s.itl)
    out[f"decode itl ctx {ctxs[-1]} / ctx {ctxs[0]}"] = s.itl[ctxs[-1]] / s.itl[ctxs[0]]
    return out


@dataclass
class Row:
    name: str
    real: float
    emulated: float

    @property
    def agreement(self) -> float:
        """emulated / real: 1.0 is perfect."""
        return self.emulated / self.real if self.real else math.nan

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return abs(self.agreement - 1.0) <= tolerance


def compare(real: dict[str, float], emulated: dict[str, float]) -> list[Row]:
    return [Row(k, real[k], emulated[k]) for k in real if k in emulated]


# -- deriving the emulator's profile ------------------------------------------------------------------------------
def least_squares(basis: Sequence[Sequence[float]], ys: Sequence[float],
                  weights: Sequence[float] | None = None) -> list[float]:
    """Coefficients minimising sum(w * (y - row . coef)^2) (normal equations, Gaussian elimination)."""
    k = len(basis[0])
    w = weights or [1.0] * len(ys)
    a = [[sum(wi * row[i] * row[j] for row, wi in zip(basis, w, strict=True)) for j in range(k)] for i in range(k)]
    b = [sum(wi * row[i] * y for row, y, wi in zip(basis, ys, w, strict=True)) for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            raise ValueError("singular fit: need more distinct points")
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, k):
            f = a[r][col] / a[col][col]
            for c in range(col, k):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * k
    for r in reversed(range(k)):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, k))) / a[r][r]
    return x


def fit_prefill(points: dict[int, float]) -> tuple[float, float, float]:
    """TTFT(L) = a + b L + c L^2, fitted on relative error, with a, c >= 0: (a, b, c)."""
    xs, ys = list(points), list(points.values())
    wts = [1.0 / (y * y) for y in ys]
    a, b, c = least_squares([[1.0, x, x * x] for x in xs], ys, wts)
    if c < 0:
        a, b = least_squares([[1.0, x] for x in xs], ys, wts)
        c = 0.0
    if a < 0:
        b, c = least_squares([[x, x * x] for x in xs], ys, wts)
        a = 0.0
    if b <= 0:
        raise ValueError(f"prefill fit has no positive linear term: {points}")
    return a, b, c


def fit_line(points: dict[int, float]) -> tuple[float, float]:
    """y = d0 + d1 x, fitted on relative error, with d1 >= 0."""
    xs, ys = list(points), list(points.values())
    d0, d1 = least_squares([[1.0, x] for x in xs], ys, [1.0 / (y * y) for y in ys])
    if d1 < 0:
        d0, d1 = statistics.fmean(ys), 0.0
    return d0, d1


def derive_overrides(s: Summary) -> dict[str, float]:
    """The emulator's llama.cpp profile from real measurements (see gateway.sim.profiles for the model).

    Prefill: the uncached TTFT curve ``a + b L + c L^2`` gives ``prefill_base_s = a``, ``prefill_tok_s = 1/b``
    and ``prefill_ctx_growth = 2c/b * 1000`` (a token at position p costs ``b + 2c p``). Decode: single-stream
    inter-token time against context, ``d0 + d1 ctx``, gives ``decode_base_s = d0`` and ``decode_ctx_growth =
    d1/d0 * 1000``; two concurrent streams give ``decode_growth``.
    """
    a, b, c = fit_prefill({FLOOR_LENGTH: s.floor_ttft, **s.ttft})
    itl_points = dict(s.itl)
    itl_points[s.decode_ctx] = s.decode_itl_1
    d0, d1 = fit_line(itl_points)
    step2_no_ctx = s.decode_itl_2 - d1 * 2 * s.decode_ctx  # two streams, each at decode_ctx
    growth = max(0.0, step2_no_ctx / d0 - 1.0) if s.slots > 1 else 0.0
    return {
        "max_seqs": s.slots,
        "prefill_tok_s": 1.0 / b,
        "prefill_ctx_growth": 2.0 * c / b * 1000.0,
        "prefill_base_s": a,
        "prefill_chunk_tokens": PREFILL_BATCH,
        "decode_base_s": d0,
        "decode_growth": growth,
        "decode_ctx_growth": d1 / d0 * 1000.0,
        "knee": s.slots,
        "knee_growth": 0.0,
        "context_length": s.ctx_per_slot,
        "kv_capacity_tokens": s.ctx_per_slot * s.slots,
    }


def refine(overrides: dict[str, float], real: Summary, emulated: Summary) -> dict[str, float]:
    """Correct for what the emulator's own path adds or loses: match the floor TTFT and the decode speed.

    The fixed prefill cost moves by the floor difference (never below 0), and the decode step time scales by
    the single-stream inter-token ratio (bounded to x0.5..x2, so one bad probe cannot run away).
    """
    out = dict(overrides)
    out["prefill_base_s"] = max(0.0, out["prefill_base_s"] + real.floor_ttft - emulated.floor_ttft)
    ratio = real.decode_itl_1 / emulated.decode_itl_1
    out["decode_base_s"] = out["decode_base_s"] * min(2.0, max(0.5, ratio))
    return out


# -- prompts of exact token counts ----------------------------------------------------------------------------------
def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Client:
    """Streams requests to one server (real or emulated) and builds prompts with its own tokenizer."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url
        # llama-server may close a connection after a stream; a fresh connection per request avoids reuse races
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                             timeout=aiohttp.ClientTimeout(total=120))

    async def close(self) -> None:
        await self.session.close()

    async def tokenize(self, text: str, pieces: bool = False) -> list[Any]:
        body = {"content": text, "add_special": not pieces, "with_pieces": pieces}
        async with self.session.post(self.url + "/tokenize", json=body) as r:
            r.raise_for_status()
            return list((await r.json())["tokens"])

    async def count(self, text: str) -> int:
        return len(await self.tokenize(text))

    async def pieces(self, text: str) -> list[str]:
        return [t["piece"] if isinstance(t["piece"], str) else "" for t in await self.tokenize(text, pieces=True)]

    async def exact(self, head: str, seed: int, target: int) -> str:
        """``head`` followed by words until the prompt is exactly ``target`` tokens (BOS included)."""
        if head and await self.count(head) >= target:
            raise ValueError("head is already too long")
        tail = await self.pieces((" " if head else "") + words(seed, target + 16))
        k = target - (await self.count(head) if head else 1)
        for _ in range(12):
            text = head + "".join(tail[: max(0, k)])
            got = await self.count(text)
            if got == target:
                return text
            k += target - got
        raise RuntimeError(f"could not build a prompt of exactly {target} tokens at {self.url}")

    async def stream(self, prompt: str, max_tokens: int) -> Run:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = last = math.nan
        chunks = 0
        final: dict[str, Any] = {}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                choices = obj.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        first = now
                    last = now
                    chunks += 1
                if "usage" in obj or "timings" in obj:
                    final.update(obj)
        usage = final.get("usage") or {}
        timings = final.get("timings") or {}
        tokens = int(usage.get("completion_tokens", chunks))
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", timings.get("cache_n", 0))
        return Run(ttft=first - t0, itl=(last - first) / (tokens - 1) if tokens > 1 and chunks > 1 else math.nan,
                   tokens=tokens, prompt_tokens=int(usage.get("prompt_tokens", 0)), cached=int(cached or 0),
                   server_prompt_ms=timings.get("prompt_ms"), chunks=chunks)


async def run_workload(client: Client, round_no: int, lengths: Sequence[int] = LENGTHS,
                       prefixes: Sequence[int] = CACHED_PREFIXES) -> Workload:
    """One round. Seeds depend on the round, so no prompt is cached from an earlier round."""
    seed = 1_000_003 * (round_no + 10)
    longest = max(lengths)
    floor = await client.stream(await client.exact("", seed, FLOOR_LENGTH), SWEEP_TOKENS)
    sweep: dict[int, Run] = {}
    for i, n in enumerate(lengths):
        sweep[n] = await client.stream(await client.exact("", seed + 10 + i, n), SWEEP_TOKENS)
    cached: dict[int, Run] = {}
    for i, n in enumerate(prefixes):
        head = await client.exact("", seed + 100 + i, n)
        first = await client.exact(head, seed + 200 + i, longest)
        second = await client.exact(head, seed + 300 + i, longest)
        await client.stream(first, 2)
        cached[n] = await client.stream(second, SWEEP_TOKENS)
    decode1 = await client.stream(await client.exact("", seed + 400, FLOOR_LENGTH), DECODE_TOKENS)
    pair = [await client.exact("", seed + 410 + i, FLOOR_LENGTH) for i in range(2)]
    decode2 = list(await asyncio.gather(*(client.stream(p, DECODE_TOKENS) for p in pair)))
    batch = [await client.exact("", seed + 500 + i, QUEUE_PROMPT) for i in range(QUEUE_REQUESTS)]
    async def later(i: int, prompt: str) -> Run:
        await asyncio.sleep(i * QUEUE_STAGGER_S)
        return await client.stream(prompt, QUEUE_TOKENS)  # TTFT from its own send time

    queue = list(await asyncio.gather(*(later(i, p) for i, p in enumerate(batch))))
    return Workload(floor=floor, sweep=sweep, cached=cached, decode1=decode1, decode2=decode2, queue=queue)


# -- the report -----------------------------------------------------------------------------------------------------
def table(rows: Sequence[Row], tolerance: float = TOLERANCE) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'shape':<{width}}  {'real':>10}  {'emulated':>10}  {'emu/real':>8}  ok",
             "-" * (width + 40)]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.real:>10.3f}  {r.emulated:>10.3f}  {r.agreement:>8.3f}  "
                     f"{'yes' if r.ok(tolerance) else 'NO'}")
    return "\n".join(lines)


def measured_figures(s: Summary) -> dict[str, float]:
    """Headline figures of one server, for the report."""
    longest = max(s.ttft)
    out = {f"ttft {n} tokens (ms)": 1000 * v for n, v in s.ttft.items()}
    out["ttft 16 tokens (ms)"] = 1000 * s.floor_ttft
    out[f"prefill tok/s at {longest} tokens"] = longest / s.ttft[longest]
    for n, v in s.cached_ttft.items():
        out[f"cached {n} of {longest}: ttft (ms)"] = 1000 * v
        out[f"cached {n} of {longest}: saving (%)"] = 100 * (1 - v / s.ttft[longest])
        out[f"cached {n} of {longest}: cached tokens reported"] = s.cached_tokens[n]
    out["decode tok/s, 1 stream, short context"] = 1 / s.decode_itl_1
    out["decode tok/s per stream, 2 streams"] = 1 / s.decode_itl_2
    for ctx, v in s.itl.items():
        out[f"decode tok/s at context {ctx}"] = 1 / v
    for i, v in enumerate(s.queue_ttft):
        out[f"queue request {i + 1} ttft (ms)"] = 1000 * v
    return out


def chart(path: Path, real: Summary, emu: Summary) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    for s, label, style in ((real, "real llama-server", "o-"), (emu, "emulator", "s--")):
        xs = [FLOOR_LENGTH, *sorted(s.ttft)]
        ax.plot(xs, [1000 * s.floor_ttft] + [1000 * s.ttft[n] for n in sorted(s.ttft)], style, label=label)
    ax.set(title="TTFT vs prompt length (uncached)", xlabel="prompt tokens", ylabel="ms")
    ax.legend()
    ax = axes[0][1]
    longest = max(real.ttft)
    names = ["uncached"] + [f"{n} cached" for n in sorted(real.cached_ttft)]
    rv = [1000 * real.ttft[longest]] + [1000 * real.cached_ttft[n] for n in sorted(real.cached_ttft)]
    ev = [1000 * emu.ttft[longest]] + [1000 * emu.cached_ttft[n] for n in sorted(emu.cached_ttft)]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], rv, 0.4, label="real")
    ax.bar([x + 0.2 for x in xs], ev, 0.4, label="emulator")
    ax.set_xticks(xs, names)
    ax.set(title=f"TTFT of a {longest}-token prompt, prefix cached", ylabel="ms")
    ax.legend()
    ax = axes[1][0]
    xs = list(range(1, len(real.queue_ttft) + 1))
    ax.bar([x - 0.2 for x in xs], [1000 * v for v in real.queue_ttft], 0.4, label="real")
    ax.bar([x + 0.2 for x in xs], [1000 * v for v in emu.queue_ttft], 0.4, label="emulator")
    ax.set(title=f"{len(xs)} concurrent requests on {real.slots} slots ({QUEUE_PROMPT}-token prompts)",
           xlabel="request (by TTFT)", ylabel="TTFT ms")
    ax.legend()
    ax = axes[1][1]
    for s, label, style in ((real, "real llama-server", "o-"), (emu, "emulator", "s--")):
        pts = {**s.itl, s.decode_ctx: s.decode_itl_1}
        ax.plot(sorted(pts), [1000 * pts[c] for c in sorted(pts)], style, label=label)
    ax.set(title="inter-token time vs context (1 stream)", xlabel="context tokens", ylabel="ms per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gateway llamacpp calibrate",
                                     description="compare the llama.cpp emulator with a real llama-server")
    parser.add_argument("--out", type=Path, default=Path("reports/calibration"), help="report directory")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, real then emulated")
    parser.add_argument("--threads", type=int, default=1, help="llama-server CPU threads")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    from gateway.llamacpp.build import BuildError, build
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer
    from gateway.sim import FleetThread

    try:
        binary = build()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = model_path("large")

    def say(msg: str) -> None:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)

    server = LlamaServer(binary, model, _free_port(), slots=SLOTS, ctx=CTX_PER_SLOT, threads=args.threads,
                         cache_ram_mib=0)
    with server:
        say(f"real llama-server at {server.url} ({model.name}, {SLOTS} slots, {args.threads} thread(s))")
        report = asyncio.run(_calibrate(server.url, args.rounds, say, FleetThread))
    report["setup"].update({"model": str(model), "binary": str(binary), "threads": args.threads})
    args.out.mkdir(parents=True, exist_ok=True)
    real = Summary(**report.pop("_real"))
    emu = Summary(**report.pop("_emulated"))
    (args.out / "calibration.json").write_text(json.dumps(_no_nan(report), indent=2) + "\n")
    chart(args.out / "calibration.png", real, emu)
    rows = [Row(**r) for r in report["ratios"]]
    print(table(rows))
    agree = sum(r.ok() for r in rows)
    print(f"\n{agree}/{len(rows)} shapes agree within {TOLERANCE:.0%}; report: {args.out / 'calibration.json'}, "
          f"chart: {args.out / 'calibration.png'}")
    return 0


def _no_nan(obj: Any) -> Any:
    """JSON has no NaN: missing figures become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_no_nan(v) for v in obj]
    return obj


async def _calibrate(real_url: str, rounds: int, say: Any, fleet_thread: Any) -> dict[str, Any]:
    from gateway.sim import SimSpec

    real_client = Client(real_url)
    try:
        say(f"probe: {PROBE_ROUNDS} rounds on the real server")
        probe = summarize([await run_workload(real_client, -1 - i) for i in range(PROBE_ROUNDS)])
        derived = derive_overrides(probe)
        say("derived: " + ", ".join(f"{k}={v:.6g}" for k, v in derived.items()))
        spec = SimSpec(engine="llamacpp", model=MODEL_NAME, overrides=derived, time_scale=1.0)
        with fleet_thread([spec]) as ft:
            emu_client = Client(ft.fleet.servers[0].url)
            try:
                say(f"probe: {PROBE_ROUNDS} rounds on the emulator")
                emu_probe = summarize([await run_workload(emu_client, -1 - i) for i in range(PROBE_ROUNDS)])
                refined = refine(derived, probe, emu_probe)
                say("refined: " + ", ".join(f"{k}={v:.6g}" for k, v in refined.items() if refined[k] != derived[k]))
            finally:
                await emu_client.close()
        spec = SimSpec(engine="llamacpp", model=MODEL_NAME, overrides=refined, time_scale=1.0)
        real_rounds: list[Workload] = []
        emu_rounds: list[Workload] = []
        with fleet_thread([spec]) as ft:
            emu_client = Client(ft.fleet.servers[0].url)
            try:
                for i in range(1, rounds + 1):
                    say(f"round {i}/{rounds}: real")
                    real_rounds.append(await run_workload(real_client, i))
                    say(f"round {i}/{rounds}: emulated")
                    emu_rounds.append(await run_workload(emu_client, i))
            finally:
                await emu_client.close()
    finally:
        await real_client.close()
    real = summarize(real_rounds)
    emu = summarize(emu_rounds)
    rows = compare(shape_ratios(real), shape_ratios(emu))
    median_rows = compare(shape_ratios(summarize(real_rounds, stat="median")),
                          shape_ratios(summarize(emu_rounds, stat="median")))
    per_round = [
        {"round": i + 1, "real": shape_ratios(summarize([r])), "emulated": shape_ratios(summarize([e]))}
        for i, (r, e) in enumerate(zip(real_rounds, emu_rounds, strict=True))
    ]
    return {
        "setup": {"lengths": list(LENGTHS), "floor_length": FLOOR_LENGTH, "cached_prefixes": list(CACHED_PREFIXES),
                  "sweep_tokens": SWEEP_TOKENS, "decode_tokens": DECODE_TOKENS, "queue_prompt": QUEUE_PROMPT,
                  "queue_tokens": QUEUE_TOKENS, "queue_requests": QUEUE_REQUESTS, "slots": SLOTS,
                  "ctx_per_slot": CTX_PER_SLOT, "rounds": rounds, "tolerance": TOLERANCE,
                  "loadavg_at_end": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "derived_overrides": derived,
        "refined_overrides": refined,
        "emulator_adjustments": ADJUSTMENTS,
        "real": measured_figures(real),
        "emulated": measured_figures(emu),
        "ratios": [{"name": r.name, "real": r.real, "emulated": r.emulated} for r in rows],
        "agreement": {r.name: {"emu/real": r.agreement, "ok": r.ok()} for r in rows},
        "ratios_from_medians": [{"name": r.name, "real": r.real, "emulated": r.emulated,
                                 "emu/real": r.agreement} for r in median_rows],
        "all_agree": all(r.ok() for r in rows),
        "per_round_ratios": per_round,
        "probe": {"real": asdict(probe), "emulated": asdict(emu_probe)},
        "rounds_raw": {"real": [asdict(w) for w in real_rounds], "emulated": [asdict(w) for w in emu_rounds]},
        "_real": asdict(real),
        "_emulated": asdict(emu),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
