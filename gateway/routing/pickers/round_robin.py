from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class RoundRobinPicker:
    """Takes eligible backends in turn, ignoring scores. The rotation is over backend names, so a backend
    leaving or rejoining shifts the turn by at most one."""

    name = "round-robin"

    def __init__(self, state: RoutingState) -> None:
        self._turn = 0

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        ordered = sorted(backends, key=lambda b: b.name)
        if not ordered:
            return []
        start = self._turn % len(ordered)
        self._turn += 1
        return ordered[start:] + ordered[:start]
