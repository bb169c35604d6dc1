"""Percentiles and summaries of measured values (pure functions, no I/O)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default).

    ``nan`` for no values. ``values`` need not be sorted.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


def summarize(values: Iterable[float]) -> dict[str, float]:
    """``count``, ``mean``, ``min``, ``p50``, ``p90``, ``p99``, ``max`` of the values (``nan`` when empty)."""
    data = sorted(v for v in values if not math.isnan(v))
    out: dict[str, float] = {"count": float(len(data))}
    out["mean"] = sum(data) / len(data) if data else math.nan
    out["min"] = data[0] if data else math.nan
    for q in QUANTILES:
        out[f"p{q}"] = percentile(data, q)
    out["max"] = data[-1] if data else math.nan
    return out


def ratio(value: float, reference: float) -> float:
    """``value / reference``; ``nan`` when either is missing or the reference is zero."""
    if math.isnan(value) or math.isnan(reference) or reference == 0:
        return math.nan
    return value / reference


def finite_or_none(value: float) -> float | None:
    """For JSON: NaN and infinities become ``null``."""
    return value if math.isfinite(value) else None


def paired_difference(a: Sequence[float], b: Sequence[float], *, resamples: int = 2000, confidence: float = 0.9,
                      seed: int = 1) -> dict[str, float | int | None]:
    """What ``b`` adds over ``a``, from paired measurements taken side by side (``a[i]`` and ``b[i]`` in the same
    interleaved round): the median of the differences ``b[i] - a[i]`` and a bootstrap ``confidence`` interval of
    that median (percentile method, ``resamples`` draws, seeded: the same data gives the same interval).

    Pairing cancels what drifts between rounds (the machine's speed, other processes), which on a shared 2-core
    machine moves two targets' pooled medians by more than the difference sought. Pairs with a NaN are dropped;
    ``pairs`` says how many were used. All None with fewer than 3 pairs."""
    diffs = [y - x for x, y in zip(a, b, strict=True) if not (math.isnan(x) or math.isnan(y))]
    if len(diffs) < 3:
        return {"median": None, "low": None, "high": None, "pairs": len(diffs)}
    rng = random.Random(seed)
    n = len(diffs)
    medians = sorted(percentile([diffs[rng.randrange(n)] for _ in range(n)], 50) for _ in range(resamples))
    tail = (1 - confidence) / 2 * 100
    return {"median": percentile(diffs, 50), "low": percentile(medians, tail),
            "high": percentile(medians, 100 - tail), "pairs": n}
