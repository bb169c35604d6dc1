from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class HealthyFilter:
    """Keeps backends whose last health check said ready (not loading, not down, not failed since)."""

    name = "healthy"

    def __init__(self, state: RoutingState) -> None:
        pass

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        return [b for b in backends if b.routable]
