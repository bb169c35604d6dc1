"""Fault injection for one emulated server, set from code, the CLI or ``POST /sim/faults``."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

_SETTABLE = {
    "error_rate": float, "error_status": int, "added_latency_s": float, "drop_mid_stream_after_tokens": int,
    "loading": bool, "error_mid_stream_after_tokens": int,
}


@dataclass
class Faults:
    """``error_rate``: share of generation requests answered ``error_status`` (500 or 503) in the engine's error
    shape. ``added_latency_s``: real seconds added before any answer. ``hang_before_first_byte``: True hangs
    forever, a number hangs that many real seconds. ``drop_mid_stream_after_tokens``: close the connection
    after N streamed tokens. ``error_mid_stream_after_tokens``: after N tokens send the engine's in-stream error
    event (then ``[DONE]`` where the engine does). ``loading``: answer as the engine does while loading.
    ``crash()``: the process dies."""

    error_rate: float = 0.0
    error_status: int = 500
    added_latency_s: float = 0.0
    hang_before_first_byte: bool | float = False
    drop_mid_stream_after_tokens: int | None = None
    error_mid_stream_after_tokens: int | None = None
    loading: bool = False
    _crash: Callable[[], None] | None = field(default=None, repr=False)
    _rng: random.Random = field(default_factory=lambda: random.Random(0), repr=False)

    def crash(self) -> None:
        if self._crash is not None:
            self._crash()

    def should_fail(self) -> bool:
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def hang_seconds(self) -> float | None:
        """None: no hang; ``inf``: hang until the client leaves."""
        h = self.hang_before_first_byte
        if h is True:
            return float("inf")
        if h is False or not h:
            return None
        return float(h)

    def as_dict(self) -> dict[str, Any]:
        return {
            "error_rate": self.error_rate, "error_status": self.error_status,
            "added_latency_s": self.added_latency_s, "hang_before_first_byte": self.hang_before_first_byte,
            "drop_mid_stream_after_tokens": self.drop_mid_stream_after_tokens,
            "error_mid_stream_after_tokens": self.error_mid_stream_after_tokens, "loading": self.loading,
        }

    def update(self, changes: Mapping[str, Any]) -> None:
        """Apply a JSON object of changes; raises ValueError naming a bad key or value."""
        for key, value in changes.items():
            if key == "hang_before_first_byte":
                if not isinstance(value, bool | int | float):
                    raise ValueError("hang_before_first_byte: bool or seconds")
                self.hang_before_first_byte = value
            elif key in _SETTABLE:
                if value is None and key.endswith("_after_tokens"):
                    setattr(self, key, None)
                    continue
                setattr(self, key, _SETTABLE[key](value))
            else:
                raise ValueError(f"unknown fault {key!r}; known: {sorted([*_SETTABLE, 'hang_before_first_byte'])}")
        if self.error_status not in (500, 503):
            raise ValueError("error_status must be 500 or 503")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
