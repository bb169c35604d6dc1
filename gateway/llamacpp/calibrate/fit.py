"""From measurements to figures: summaries, shape ratios, least-squares fits, and emulator parameters."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.llamacpp.calibrate.common import (
    CTX_PER_SLOT,
    DECODE_TOKENS,
    FLOOR_LENGTH,
    PREFILL_BATCH,
    SLOTS,
    SWEEP_TOKENS,
    TOLERANCE,
    Summary,
    Workload,
)


def least(values: Sequence[float]) -> float:
    return min(values)


STATS: dict[str, Callable[[Sequence[float]], float]] = {"min": least, "median": statistics.median}


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
