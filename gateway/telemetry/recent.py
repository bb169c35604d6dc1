"""The last few minutes per backend, for the operator: what ``GET /admin/backends`` says of each backend's recent
TTFT, tokens/s and routing decisions, and the sparklines of the status page (``/ui``).

Prometheus keeps the long history; this keeps ``buckets`` buckets of ``step`` seconds (two minutes by default) in
a ring per backend, filled by the accounting of each finished request (:meth:`Recent.record`: a few additions)
and by a sampler that reads in-flight counts and the queue once a step (:meth:`Recent.sample`). A request's
output tokens are spread over the buckets its stream spanned, so a long stream draws a plateau, not a spike at
its end. TTFT is kept per bucket as a sum and a count, plus up to ``samples`` values for the window's
percentiles (reservoir-sampled beyond that).

Times are ``time.perf_counter()`` readings, which on Linux is the system-wide monotonic clock: the workers of
one gateway agree on bucket numbers, so :func:`merge` adds their views up.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("requests", "errors", "ttft_sum", "ttft_n", "tokens", "in_flight")


@dataclass(slots=True)
class _Ring:
    size: int
    ids: list[int] = field(init=False)
    values: dict[str, list[float]] = field(init=False)
    samples: list[list[float]] = field(init=False)
    seen: list[int] = field(init=False)
    decisions: list[dict[str, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.ids = [-1] * self.size
        self.values = {f: [0.0] * self.size for f in FIELDS}
        self.samples = [[] for _ in range(self.size)]
        self.seen = [0] * self.size
        self.decisions = [{} for _ in range(self.size)]

    def slot(self, bucket: int) -> int:
        """The ring position of ``bucket``, emptied first when it held an older one."""
        i = bucket % self.size
        if self.ids[i] != bucket:
            self.ids[i] = bucket
            for column in self.values.values():
                column[i] = 0.0
            self.samples[i] = []
            self.seen[i] = 0
            self.decisions[i] = {}
        return i


class Recent:
    def __init__(self, *, step: float = 2.0, buckets: int = 60, window: float = 60.0, samples: int = 64) -> None:
        self.step = step
        self.size = buckets
        self.window = max(1, min(buckets, round(window / step)))  # the summaries' buckets (the latest ones)
        self._samples = samples
        self._rings: dict[str, _Ring] = {}
        self._queue = _Ring(buckets)
        self._random = random.Random()

    def _ring(self, backend: str) -> _Ring:
        ring = self._rings.get(backend)
        if ring is None:
            ring = self._rings[backend] = _Ring(self.size)
        return ring

    def backends(self) -> set[str]:
        return set(self._rings)

    def forget(self, backend: str) -> None:
        """A backend gone from the pool."""
        self._rings.pop(backend, None)

    def record(self, backend: str, end: float, *, ok: bool, ttft: float | None, tokens: int,
               first: float | None = None, last: float | None = None, reason: str | None = None) -> None:
        """One finished request on ``backend`` at ``end``: its TTFT (streams), its output ``tokens`` (spread over
        ``first``..``last`` when known) and the routing decision's reason."""
        ring = self._ring(backend)
        bucket = int(end // self.step)
        i = ring.slot(bucket)
        values = ring.values
        values["requests"][i] += 1
        if not ok:
            values["errors"][i] += 1
        if ttft is not None:
            values["ttft_sum"][i] += ttft
            values["ttft_n"][i] += 1
            seen = ring.seen[i] = ring.seen[i] + 1
            kept = ring.samples[i]
            if len(kept) < self._samples:
                kept.append(ttft)
            else:
                j = self._random.randrange(seen)
                if j < self._samples:
                    kept[j] = ttft
        if reason is not None:
            decisions = ring.decisions[i]
            decisions[reason] = decisions.get(reason, 0) + 1
        if tokens > 0:
            self._spread(ring, tokens, first, last, end)

    def _spread(self, ring: _Ring, tokens: int, first: float | None, last: float | None, end: float) -> None:
        column = ring.values["tokens"]
        if first is None or last is None or last <= first:
            column[ring.slot(int(end // self.step))] += tokens
            return
        start = max(first, end - self.step * (self.size - 1))  # (what falls outside the ring is not kept)
        span = last - first
        b0, b1 = int(start // self.step), int(last // self.step)
        for bucket in range(b0, b1 + 1):
            lo, hi = max(start, bucket * self.step), min(last, (bucket + 1) * self.step)
            if hi > lo:
                column[ring.slot(bucket)] += tokens * (hi - lo) / span

    def sample(self, now: float, in_flight: dict[str, int], queued: int) -> None:
        """The sampler's reading: each backend's in-flight requests and the requests queued in admission."""
        bucket = int(now // self.step)
        for name, count in in_flight.items():
            ring = self._ring(name)
            i = ring.slot(bucket)
            ring.values["in_flight"][i] = max(ring.values["in_flight"][i], count)
        i = self._queue.slot(bucket)
        self._queue.values["in_flight"][i] = max(self._queue.values["in_flight"][i], queued)

    def raw(self, now: float) -> dict[str, Any]:
        """This process's view, oldest bucket first, ending at the bucket of ``now`` (JSON, for :func:`merge`
        and :func:`summary`)."""
        end = int(now // self.step)
        return {"step": self.step, "end": end, "window": self.window,
                "backends": {name: _columns(ring, end, self.window) for name, ring in self._rings.items()},
                "queued": _columns(self._queue, end, self.window)["in_flight"]}


def _columns(ring: _Ring, end: int, window: int) -> dict[str, Any]:
    out: dict[str, Any] = {f: [] for f in FIELDS}
    samples: list[float] = []
    decisions: dict[str, int] = {}
    for bucket in range(end - ring.size + 1, end + 1):
        i = bucket % ring.size
        live = ring.ids[i] == bucket
        for f in FIELDS:
            out[f].append(ring.values[f][i] if live else 0.0)
        if live and bucket > end - window:
            samples += ring.samples[i]
            for reason, n in ring.decisions[i].items():
                decisions[reason] = decisions.get(reason, 0) + n
    out["ttft_samples"] = samples
    out["decisions"] = decisions
    return out


def empty(size: int) -> dict[str, Any]:
    """The columns of a backend nothing was recorded for."""
    return {**{f: [0.0] * size for f in FIELDS}, "ttft_samples": [], "decisions": {}}


def merge(views: list[dict[str, Any]]) -> dict[str, Any]:
    """Several processes' :meth:`Recent.raw` views added up, aligned on their buckets (ending at the latest)."""
    base = views[0]
    end, size = max(view["end"] for view in views), len(base["queued"])
    merged: dict[str, Any] = {"step": base["step"], "end": end, "window": base["window"], "backends": {},
                              "queued": [0.0] * size}

    def add(into: list[float], values: list[float], shift: int) -> None:
        for i, v in enumerate(values):
            j = i - shift
            if 0 <= j < size:
                into[j] += v

    for view in views:
        shift = end - view["end"]  # a view taken a bucket earlier or later
        add(merged["queued"], view["queued"], shift)
        for name, cols in view["backends"].items():
            into = merged["backends"].get(name)
            if into is None:
                into = merged["backends"][name] = empty(size)
            for f in FIELDS:
                add(into[f], cols[f], shift)
            into["ttft_samples"] += cols["ttft_samples"]
            for reason, n in cols["decisions"].items():
                into["decisions"][reason] = into["decisions"].get(reason, 0) + n
    return merged


def summary(cols: dict[str, Any], step: float, window: int) -> dict[str, Any]:
    """One backend's last ``window`` buckets: requests, errors, TTFT p50/p95 (ms, streams), output tokens/s and
    routing decisions by reason."""
    n = max(1, min(len(cols["requests"]), window))
    recent = {f: cols[f][-n:] for f in FIELDS}
    samples = sorted(cols["ttft_samples"])
    return {
        "window_seconds": n * step,
        "requests": int(sum(recent["requests"])),
        "errors": int(sum(recent["errors"])),
        "ttft_p50_ms": _ms(_quantile(samples, 0.5)),
        "ttft_p95_ms": _ms(_quantile(samples, 0.95)),
        "tokens_per_second": round(sum(recent["tokens"]) / (n * step), 2),
        "decisions": dict(sorted(cols["decisions"].items(), key=lambda kv: -kv[1])),
    }


def series(cols: dict[str, Any], step: float) -> dict[str, list[float | None]]:
    """Per bucket, oldest first: requests, mean TTFT (ms; None where no stream began), output tokens/s and
    the most requests in flight the sampler saw."""
    return {
        "requests": [int(v) for v in cols["requests"]],
        "ttft_ms": [_ms(s / c) if c else None for s, c in zip(cols["ttft_sum"], cols["ttft_n"], strict=True)],
        "tokens_per_second": [round(v / step, 2) for v in cols["tokens"]],
        "in_flight": [int(v) for v in cols["in_flight"]],
    }


def _quantile(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
