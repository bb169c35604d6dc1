"""The pipeline runner: filters, then weighted scorers, then the picker; every plugin timed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.pool.backend import Backend
from gateway.routing.plugins import Filter, Picker, Scorer
from gateway.routing.request import RouteRequest


class NoRoute(Exception):
    """No backend is eligible. ``stage`` is the filter that left none."""

    def __init__(self, stage: str, request: RouteRequest) -> None:
        super().__init__(stage)
        self.stage = stage
        self.request = request


@dataclass(slots=True)
class Decision:
    ranked: list[Backend]  # best first; the rest is the failover order
    policy: str
    reason: str
    timings: dict[str, float] = field(default_factory=dict)  # plugin name -> seconds


@dataclass(slots=True)
class Pipeline:
    policy: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker

    def route(self, request: RouteRequest, backends: Sequence[Backend]) -> Decision:
        timings: dict[str, float] = {}
        clock = time.perf_counter
        candidates: Sequence[Backend] = backends
        for flt in self.filters:
            start = clock()
            candidates = flt.filter(request, candidates)
            timings[flt.name] = clock() - start
            if not candidates:
                raise NoRoute(flt.name, request)
        totals = [0.0] * len(candidates)
        weight_sum = 0.0
        for scorer, weight in self.scorers:
            start = clock()
            for i, value in enumerate(scorer.score(request, candidates)):
                totals[i] += weight * value
            timings[scorer.name] = clock() - start
            weight_sum += weight
        if weight_sum:
            totals = [t / weight_sum for t in totals]
        start = clock()
        ranked = self.picker.pick(request, candidates, totals)
        timings[self.picker.name] = clock() - start
        if self.scorers:
            best = totals[candidates.index(ranked[0])]
            reason = f"{self.policy} score={best:.3f} of {len(candidates)}"
        else:
            reason = f"{self.policy} of {len(candidates)}"
        return Decision(ranked=ranked, policy=self.policy, reason=reason, timings=timings)
