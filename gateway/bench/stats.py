"""Percentiles and summaries of measured values (pure functions, no I/O)."""

from __future__ import annotations

import math
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
