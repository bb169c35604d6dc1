"""Prometheus text exposition, written by hand (the emulators own no registry): families and histograms."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


def _labels(labels: Mapping[str, str], extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    return repr(float(value))


class Exposition:
    """Collects families and renders the text format the way prometheus_client does."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        self.lines: list[str] = []

    def _head(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, value: float, help_text: str, labels: Mapping[str, str] | None = None) -> None:
        self._head(name, "gauge", help_text)
        self.lines.append(f"{name}{_labels({**self.labels, **(labels or {})})} {_num(value)}")

    def counter(self, name: str, value: float, help_text: str) -> None:
        """``name`` ends in ``_total``; the family is declared under that name as prometheus_client does."""
        self._head(name, "counter", help_text)
        self.lines.append(f"{name}{_labels(self.labels)} {_num(value)}")

    def histogram(self, name: str, hist: Histogram, help_text: str) -> None:
        self._head(name, "histogram", help_text)
        running = 0
        for bound, count in zip(hist.bounds, hist.counts, strict=False):
            running += count
            le = 'le="' + _num(bound) + '"'
            self.lines.append(f"{name}_bucket{_labels(self.labels, le)} {_num(running)}")
        running += hist.counts[-1]
        inf = 'le="+Inf"'
        self.lines.append(f"{name}_bucket{_labels(self.labels, inf)} {_num(running)}")
        self.lines.append(f"{name}_count{_labels(self.labels)} {_num(running)}")
        self.lines.append(f"{name}_sum{_labels(self.labels)} {_num(hist.sum)}")

    def render(self) -> bytes:
        return ("\n".join(self.lines) + "\n").encode()
