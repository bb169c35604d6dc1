"""Each backend's performance shape, learned online: per-token decode time as a function of how many
sequences share the engine, and prefill speed.

Seeded from a profile file written by ``gateway profile`` when one is configured, else from the engine's
spec (``shape`` in ``gateway/engines/<engine>.py``: an engine kind's typical curve, not this deployment's).
Observed requests then pull the curve towards this deployment's reality: each concurrency bucket (powers of
two) keeps its own moving average, and a global correction factor moves the unobserved rest with it.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from gateway.pool.state import ShapeSeed

# one backend's measured curve: per-token seconds by concurrency, and prefill tokens/s when measured
ShapeProfile = tuple[dict[int, float], float | None]


ALPHA = 0.2  # weight of a new observation in the moving averages


def _bucket(concurrency: int) -> int:
    return max(0, math.ceil(math.log2(max(1, concurrency))))


class ShapeModel:
    """Per-token decode seconds at a concurrency, and prefill tokens/s, for one backend."""

    __slots__ = ("_buckets", "_counts", "correction", "learned", "prefill_tok_s", "seed", "table")

    def __init__(self, seed: ShapeSeed, table: dict[int, float] | None = None) -> None:
        self.seed = seed
        self.table = table or {}  # concurrency -> per-token seconds, from a profile file
        self.prefill_tok_s = seed.prefill_tok_s
        self.correction = 1.0
        self.learned = False  # has observed this backend's own requests
        self._buckets: dict[int, float] = {}
        self._counts: dict[int, int] = {}

    def _prior(self, concurrency: int) -> float:
        if self.table:
            levels = sorted(self.table)
            if concurrency <= levels[0]:
                return self.table[levels[0]]
            for low, high in itertools.pairwise(levels):
                if low <= concurrency <= high:
                    share = (concurrency - low) / (high - low)
                    return self.table[low] + share * (self.table[high] - self.table[low])
            top = levels[-1]
            return self.table[top] * concurrency / top  # beyond the measured range: assume saturation
        return (1.0 + self.seed.growth * (concurrency - 1)) / self.seed.tok_s

    def token_seconds(self, concurrency: int) -> float:
        bucket = _bucket(concurrency)
        if self._counts.get(bucket, 0) >= 3:
            # the bucket's own average, moved along the prior's slope within the bucket
            centre = 2**bucket
            return self._buckets[bucket] * self._prior(concurrency) / self._prior(centre)
        return self._prior(concurrency) * self.correction

    def observe_decode(self, concurrency: int, token_seconds: float) -> None:
        if token_seconds <= 0 or not math.isfinite(token_seconds):
            return
        self.learned = True
        bucket = _bucket(concurrency)
        centred = token_seconds * self._prior(2**bucket) / self._prior(concurrency)
        if bucket in self._buckets:
            self._buckets[bucket] += ALPHA * (centred - self._buckets[bucket])
        else:
            self._buckets[bucket] = centred
        self._counts[bucket] = self._counts.get(bucket, 0) + 1
        ratio = token_seconds / self._prior(concurrency)
        self.correction += ALPHA * (ratio - self.correction)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= 64 and seconds > 0:
            self.learned = True
            self.prefill_tok_s += ALPHA * (tokens / seconds - self.prefill_tok_s)


def load_profile_file(path: Path) -> dict[str, ShapeProfile]:
    """Read a ``gateway profile`` file: per backend name, per-token seconds by concurrency and prefill tok/s.

    The schema is ``gateway-engine-profile/1`` (see ``gateway/bench/profile.py``): ``{"backends": {NAME:
    {"levels": [{"concurrency": C, "per_user_decode_tok_s": X, "prefill_tok_s": Y | null,
    "host_saturated": bool}, ...]}}}``. Levels measured on a saturated load generator are skipped. Prefill
    speed is taken from the lowest level that measured it: at higher levels requests queue for a slot, and
    that wait would read as slow prefill (a 1-slot llama-server measured 13,000 tokens/s alone, 665 at 8 users).
    """
    doc: Any = json.loads(path.read_text())
    out: dict[str, ShapeProfile] = {}
    backends = doc.get("backends") if isinstance(doc, dict) else None
    if not isinstance(backends, dict):
        raise ValueError(f"{path}: no 'backends' object")
    for name, entry in backends.items():
        table: dict[int, float] = {}
        prefill: dict[int, float] = {}
        for level in entry.get("levels", []):
            if level.get("host_saturated"):
                continue
            c, speed = level.get("concurrency"), level.get("per_user_decode_tok_s")
            if isinstance(c, int) and c > 0 and isinstance(speed, int | float) and speed > 0:
                table[c] = 1.0 / speed
            p = level.get("prefill_tok_s")
            if isinstance(c, int) and c > 0 and isinstance(p, int | float) and p > 0:
                prefill[c] = float(p)
        if table:
            out[name] = (table, prefill[min(prefill)] if prefill else None)
    return out
