from __future__ import annotations

import random
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class MaxScorePicker:
    """Highest score first; ties go to the backend with fewer of our requests in flight, then at random
    (so equal idle backends share a burst instead of the first one in the list taking it all)."""

    name = "max-score"

    def __init__(self, state: RoutingState, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        keyed = [
            (-score, backend.in_flight, self._rng.random(), index)
            for index, (backend, score) in enumerate(zip(backends, scores, strict=True))
        ]
        keyed.sort()
        return [backends[item[3]] for item in keyed]
