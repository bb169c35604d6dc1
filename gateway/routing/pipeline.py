"""The pipeline runner: filters, then weighted scorers, then the picker; every plugin timed, every decision
explained by the scorer that made the difference."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.pool.backend import Backend
from gateway.routing.plugins import Filter, Picker, Scorer, hooks
from gateway.routing.request import Outcome, RouteRequest
from gateway.routing.state import RoutingState


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
    reason: str  # a plugin name (bounded: fit for a metric label), or only-candidate / tie
    detail: str  # human-readable: scores of the winner
    timings: dict[str, float] = field(default_factory=dict)  # plugin name -> seconds


@dataclass(slots=True)
class Pipeline:
    policy: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker
    state: RoutingState
    _on_routed: list[Callable[[RouteRequest, Backend], None]] = field(default_factory=list, init=False)
    _on_outcome: list[Callable[[Outcome, Backend], None]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        # the learning hooks: each plugin's own, then the shared learners the plugins attached when built
        plugins: list[object] = [*self.filters, *(s for s, _ in self.scorers), self.picker, *self.state.learners]
        for plugin in plugins:
            routed, observe = hooks(plugin)
            if routed is not None:
                self._on_routed.append(routed)
            if observe is not None:
                self._on_outcome.append(observe)

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
        if request.generations > 1:  # (not a configurable filter: what a key is charged depends on it)
            candidates = [b for b in candidates if b.spec.several_generations]
            if not candidates:
                raise NoRoute("several-generations", request)
        # (nor these: one such request slows every other on llama.cpp, sampling the whole vocabulary or following
        # its grammar's parse many ways at every token)
        for asks, takes, stage in ((request.whole_vocabulary, "whole_vocabulary", "whole-vocabulary"),
                                   (request.fanout, "many_parses", "many-parses")):
            if asks is not None:
                candidates = [b for b in candidates if getattr(b.spec, takes)]
                if not candidates:
                    raise NoRoute(stage, request)
        if request.stalled is not None:  # (it, or its key's, stalled such a loop: gateway.proxy.stall_guard)
            candidates = [b for b in candidates if not b.spec.load_waits_for_loop]
            if not candidates:
                raise NoRoute("stalled-loop", request)
        if len(candidates) == 1:  # nothing to choose: no scorer runs (their routed hooks still do)
            return Decision(ranked=[candidates[0]], policy=self.policy, reason="only-candidate",
                            detail="only one eligible backend", timings=timings)
        per_scorer: list[list[float]] = []
        totals = [0.0] * len(candidates)
        weight_sum = sum(w for _, w in self.scorers) or 1.0
        for scorer, weight in self.scorers:
            start = clock()
            values = scorer.score(request, candidates)
            timings[scorer.name] = clock() - start
            per_scorer.append(values)
            for i, value in enumerate(values):
                totals[i] += weight * value / weight_sum
        start = clock()
        ranked = self.picker.pick(request, candidates, totals)
        timings[self.picker.name] = clock() - start
        reason, detail = self._explain(candidates, ranked, per_scorer, totals)
        return Decision(ranked=ranked, policy=self.policy, reason=reason, detail=detail, timings=timings)

    def _explain(self, candidates: Sequence[Backend], ranked: list[Backend], per_scorer: list[list[float]],
                 totals: list[float]) -> tuple[str, str]:
        if len(candidates) == 1:
            return "only-candidate", "only one eligible backend"
        if not self.scorers:
            return self.picker.name, self.picker.name
        win, second = candidates.index(ranked[0]), candidates.index(ranked[1])
        margins = [w * (values[win] - values[second]) for (_, w), values in zip(self.scorers, per_scorer, strict=True)]
        best = max(range(len(margins)), key=margins.__getitem__)
        scores = " ".join(f"{s.name}={values[win]:.2f}" for (s, _), values in zip(self.scorers, per_scorer,
                                                                                   strict=True))
        if margins[best] <= 0:
            return "tie", f"tie at {totals[win]:.3f} ({scores})"
        return self.scorers[best][0].name, f"{totals[win]:.3f} over {totals[second]:.3f} ({scores})"

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        """Called for each backend the request is actually sent to."""
        for hook in self._on_routed:
            hook(request, backend)

    def observe(self, outcome: Outcome, backend: Backend) -> None:
        """Called once per finished request, with the backend that answered (or failed) last."""
        for hook in self._on_outcome:
            hook(outcome, backend)
