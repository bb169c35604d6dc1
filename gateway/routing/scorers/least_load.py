from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState

# Slots assumed for a backend that reports none and has no configured max_concurrency.
DEFAULT_SLOTS = 8


class LeastLoadScorer:
    """Prefers the backend with the fewest sequences per slot.

    Queue = the engine's running + waiting (corrected by this gateway's in-flight change since the reading,
    see ``Backend.estimated_queue``); score = slots / (slots + queue): 1 when idle, 0.5 when every slot is
    busy, and still ordered beyond saturation, where a plain utilisation score would flatten at zero.
    """

    name = "least-load"

    def __init__(self, state: RoutingState) -> None:
        self._clock = state.clock

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        now = self._clock.monotonic()
        scores = []
        for backend in backends:
            slots = backend.slots or DEFAULT_SLOTS
            scores.append(slots / (slots + backend.estimated_queue(now)))
        return scores
