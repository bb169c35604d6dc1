from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest


class HealthyFilter:
    """Keeps backends whose last health check said ready (not loading, not down, not failed since)."""

    name = "healthy"

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        return [b for b in backends if b.routable]
