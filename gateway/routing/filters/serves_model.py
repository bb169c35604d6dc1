from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class ServesModelFilter:
    """Keeps backends that serve (or, while down, last served) the requested model, on an engine that serves
    the request's route."""

    name = "serves-model"

    def __init__(self, state: RoutingState) -> None:
        pass

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        agent = request.agent  # an agent API request some engines cannot serve at all (count_tokens)
        return [b for b in backends if request.model in b.models and request.route in b.spec.routes
                and (agent is None or agent.servable(b.spec))]
