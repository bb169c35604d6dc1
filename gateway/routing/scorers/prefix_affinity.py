from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class PrefixAffinityScorer:
    """Prefers the backend whose prefix cache probably holds the longest part of this prompt.

    Score = the fraction of the prompt's blocks the backend's index holds (see ``prefix_index``). A load
    gate keeps a hot prefix from piling onto one backend: a backend whose queue exceeds the least loaded
    candidate's by more than ``gate_abs`` sequences *and* by more than ``gate_rel`` times gets no affinity
    credit, so load-aware scorers decide instead (the prefix then spreads to a second backend's cache).
    """

    name = "prefix"

    def __init__(self, state: RoutingState, gate_abs: int = 12, gate_rel: float = 3.0) -> None:
        self._prefix = state.prefix  # attaches the shared prefix learner
        self._gate_abs = gate_abs
        self._gate_rel = gate_rel

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        blocks = request.blocks
        if not blocks:
            return [0.0] * len(backends)
        now = time.monotonic()
        queues = [b.estimated_queue(now) for b in backends]
        lightest = min(queues)
        prefix = self._prefix
        scores = []
        for backend, queue in zip(backends, queues, strict=True):
            if queue - lightest > self._gate_abs and queue > self._gate_rel * max(lightest, 1):
                scores.append(0.0)
            else:
                scores.append(prefix.match(backend, blocks) / len(blocks))
        return scores
