from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class BelowMaxConcurrencyFilter:
    """Keeps backends with fewer of this gateway's requests in flight than their configured
    ``max_concurrency`` (a backend without one is never full). With shared state the slot itself is taken
    atomically after routing, across every replica (``gateway.state``): this filter then only drops what this
    replica alone already fills."""

    name = "below-max-concurrency"

    def __init__(self, state: RoutingState) -> None:
        pass

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        return [b for b in backends if b.max_concurrency is None or b.in_flight < b.max_concurrency]
