from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState
from gateway.structured import can_honour


def _offers_tools(request: RouteRequest) -> bool:
    body = request.body
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


class StructuredOutputFilter:
    """Keeps backends whose engine honours the request's structured-output constraint (natively or through a
    faithful grammar conversion). A constraint is never sent where it would be ignored, except a best-effort
    one (``Constraint.best_effort``): where no backend honours it, all are kept, and the answer is checked.
    Tools the model may call go where it can call them: not to a backend that says it cannot (a llama.cpp model
    whose chat template has no tool support), unless no other serves the model and no call is forced."""

    name = "structured-output"

    def __init__(self, state: RoutingState) -> None:
        pass

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        constraint = request.constraint
        if _offers_tools(request):  # not where the model cannot call them (llama.cpp's template says so), unless
            # nothing else serves the model and no call is forced
            callers = [b for b in backends if b.capacity.tool_calls is not False]
            if callers or (constraint is not None and constraint.kind == "tool_call"):
                backends = callers
        if constraint is None:
            return list(backends)
        able = [b for b in backends if can_honour(constraint, b.spec.structured)]
        return able if able or not constraint.best_effort else list(backends)
