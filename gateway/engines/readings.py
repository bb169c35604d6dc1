"""What one figure of an engine's load, capacity, model list or usage is worth: checked, or no reading at all.

The engines are the operator's and are trusted not to lie on purpose, but their answers can be garbage: ``NaN``
or ``+Inf`` in ``/metrics`` (a gauge divided by zero), a negative count, a string or a boolean where a number
belongs, a number too large to mean anything (``1e308``, or an integer of hundreds of digits, which Python's
JSON reads and ``float()`` then refuses). Each such figure becomes ``None``, exactly what an engine that exposes
nothing gives, so routing falls back to the gateway's own in-flight count and nothing downstream (rounding,
sums, the metrics exposition) ever raises on it.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

T = TypeVar("T")

# no engine runs or queues more sequences than this; a larger figure is garbage
MAX_COUNT = 1 << 24
# tokens of context or of KV cache: ~10^12, past any GPU's memory
MAX_TOKENS = 1 << 40
# models one backend may list: a server "serving" more is broken (or a model directory, not a server); the
# rest are left out, so /v1/models and routing stay small whatever one backend answers
MAX_MODELS = 1000
# characters in a model's name (Hugging Face ids are at most 96; a local path to a GGUF file is longer)
MAX_MODEL_NAME = 1024
# tokens one request's usage may say, in any one figure: past any context window times any n a request may ask for
MAX_USAGE_TOKENS = 1 << 27
# bytes of one answer to a health, load, capacity or models request: the largest /metrics an engine writes
# (vLLM with data parallelism and many LoRA adapters) is a few hundred KiB
MAX_ANSWER_BYTES = 4 << 20


def number(value: Any) -> float | None:
    """A finite JSON or exposition number (never a boolean or a string), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if -MAX_TOKENS <= value <= MAX_TOKENS else None
    return value if math.isfinite(value) else None


def count(value: Any, limit: int = MAX_COUNT) -> int | None:
    """A non-negative whole count (requests, sequences, slots) of at most ``limit``, else None. A gauge read as
    ``5.0`` is 5; ``4.6`` (an engine averaging) rounds to 5."""
    found = number(value)
    if found is None or not 0 <= found <= limit:
        return None
    return round(found)


def positive(value: Any, limit: int = MAX_TOKENS) -> int | None:
    """A count that must be at least 1 to mean anything (slots, a context length, a cache size), else None."""
    found = count(value, limit)
    return found if found else None


def fraction(value: Any) -> float | None:
    """A share in [0, 1] (KV cache in use), else None."""
    found = number(value)
    return found if found is not None and 0.0 <= found <= 1.0 else None


def total(values: list[Any], limit: int = MAX_COUNT) -> int | None:
    """The sum of per-rank counts; None when there is none or any of them is garbage (a partial sum would
    pass for a whole one)."""
    counts = [count(v, limit) for v in values]
    if not counts or any(c is None for c in counts):
        return None
    return count(sum(c for c in counts if c is not None), limit)


def histogram(
    found: tuple[tuple[tuple[str, float], ...], float, float] | None,
) -> tuple[tuple[tuple[str, float], ...], float, float] | None:
    """An engine's queue-time histogram whose every figure is finite and non-negative, else None."""
    if found is None:
        return None
    buckets, summed, counted = found
    figures = [summed, counted, *(c for _, c in buckets)]
    if all(math.isfinite(f) and 0 <= f <= MAX_TOKENS for f in figures):
        return found
    return None


def usage_figure(value: Any) -> int | None:
    """A usage figure (prompt, completion, cached or reasoning tokens) as the engine should write it: a whole number
    in [0, MAX_USAGE_TOKENS], else None, no reading (a float, a string, a boolean, null, an object, a negative or
    larger number). A backend reporting ``prompt_tokens: -1000000`` refilled the key's token bucket by a million;
    one reporting ``"12"`` or ``1e30`` was charged nothing."""
    if type(value) is not int:  # (a bool's type is bool; an int subclass from JSON there is none)
        return None
    return value if 0 <= value <= MAX_USAGE_TOKENS else None


def usage_tokens(value: Any) -> int:
    """A usage figure as the metrics count it: :func:`usage_figure`, 0 where it is no reading."""
    found = usage_figure(value)
    return 0 if found is None else found


def model_name(value: Any) -> str | None:
    """A model's name as listed: a non-empty string of at most ``MAX_MODEL_NAME`` printable characters, else None
    (a name with a line break in it broke every answer naming it: it goes into the ``x-gateway-model`` header)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_MODEL_NAME and value.isprintable():
        return value
    return None


class Figures:
    """The figures of one load reading, each checked as above; the names of those that were there but garbage
    are kept in ``rejected`` (the pool logs and counts them: an engine reporting NaN is worth an operator's look,
    but never worth a failed reading)."""

    __slots__ = ("rejected",)

    def __init__(self) -> None:
        self.rejected: list[str] = []

    def count(self, name: str, value: Any) -> int | None:
        return self._noted(name, value, count(value))

    def fraction(self, name: str, value: Any) -> float | None:
        return self._noted(name, value, fraction(value))

    def total(self, name: str, values: list[Any]) -> int | None:
        return self._noted(name, values or None, total(values))

    def histogram(self, name: str, found: tuple[tuple[tuple[str, float], ...], float, float] | None,
                  ) -> tuple[tuple[tuple[str, float], ...], float, float] | None:
        return self._noted(name, found, histogram(found))

    def _noted(self, name: str, value: object, checked: T) -> T:
        if checked is None and value is not None:
            self.rejected.append(name)
        return checked
