from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState
from gateway.structured import can_honour


class StructuredOutputFilter:
    """Keeps backends whose engine honours the request's structured-output constraint (natively or through a
    faithful grammar conversion). A constraint is never sent where it would be ignored, except a best-effort
    one (``Constraint.best_effort``): where no backend honours it, all are kept, and the answer is checked."""

    name = "structured-output"

    def __init__(self, state: RoutingState) -> None:
        pass

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        constraint = request.constraint
        if constraint is None:
            return list(backends)
        able = [b for b in backends if can_honour(constraint, b.spec.structured)]
        return able if able or not constraint.best_effort else list(backends)
