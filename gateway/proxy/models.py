"""The ``models`` section at request time: which served model a requested name goes to (aliases and weighted
splits, sticky per session) and which models to fall back on when none of its backends can serve.

A split picks by weighted rendezvous hashing: each target scores ``weight / -ln(u)`` with ``u`` uniform in
(0, 1), the highest wins, which picks each target with probability weight / total. With a session key, ``u``
comes from hashing the session and the target, so a session keeps its target (and moves only when the
targets change); without one it is random.
"""

from __future__ import annotations

import hashlib
import math
import random

from gateway.config import ModelSettings

# the refusals a fallback model may answer instead: no backend of the model can serve it now, or in time, or
# can hold its prompt; all raised before the request took anything (a key's shared budget, a slot), so the
# fallback's own admission charges it once. Never a refusal of the request itself (bad input, a key's limit),
# nor a failure after it was sent (upstream_failed: the attempts have already failed over between backends)
FALLBACK_CODES = frozenset({"no_backend_available", "backends_at_capacity", "queue_full", "queue_deadline",
                            "queue_timeout", "context_length_exceeded"})


class ModelMap:
    def __init__(self, models: dict[str, ModelSettings]) -> None:
        self._targets = {name: [(t.model, t.weight) for t in m.targets] for name, m in models.items() if m.targets}
        self._fallbacks = {name: list(m.fallbacks) for name, m in models.items() if m.fallbacks}
        self._random = random.Random()

    def __bool__(self) -> bool:
        return bool(self._targets or self._fallbacks)

    def resolve(self, name: str, session: str | None = None) -> str:
        """The served model a request for ``name`` goes to (``name`` itself when it is no alias)."""
        targets = self._targets.get(name)
        if targets is None:
            return name
        if len(targets) == 1:
            return targets[0][0]
        best, best_score = targets[0][0], -1.0
        for model, weight in targets:
            if session is None:
                u = self._random.random() or 0.5
            else:
                digest = hashlib.blake2b(f"{session}\0{model}".encode(), digest_size=8).digest()
                u = (int.from_bytes(digest, "big") + 0.5) / 2**64
            score = weight / -math.log(u)
            if score > best_score:
                best, best_score = model, score
        return best

    def fallbacks(self, name: str) -> list[str]:
        """The names to try, in order, when ``name`` cannot be served."""
        return self._fallbacks.get(name, [])

    def describe(self) -> dict[str, dict[str, object]]:
        """Every configured name: its split (``targets``, weights as shares of 1) and its ``fallbacks``."""
        names = sorted({*self._targets, *self._fallbacks})
        out: dict[str, dict[str, object]] = {}
        for name in names:
            targets = self._targets.get(name, [])
            total = sum(w for _, w in targets) or 1.0
            out[name] = {"targets": [{"model": m, "weight": w, "share": round(w / total, 4)} for m, w in targets],
                         "fallbacks": self._fallbacks.get(name, [])}
        return out

    def aliases(self) -> dict[str, list[str]]:
        """Alias -> the served models it splits over."""
        return {name: [m for m, _ in targets] for name, targets in self._targets.items()}
