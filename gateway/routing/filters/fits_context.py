from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from annotated_types import Gt

from gateway.pool.backend import Backend
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.routing.state import RoutingState


class FitsContextFilter:
    """Keeps backends whose context (when known) can hold the prompt plus ``max_tokens``; on an engine that stops
    generating at the end of its context rather than refusing (``EngineSpec.output_in_context`` False:
    llama.cpp), the prompt alone.

    The prompt's token count is estimated from its bytes with a deliberately generous bytes-per-token ratio,
    so the estimate errs low: a backend is dropped only when the request surely does not fit (a borderline
    request is left for the engine to judge, and its 400 comes back as it is).
    """

    name = "fits-context"

    def __init__(self, state: RoutingState, bytes_per_token: Annotated[float, Gt(0)] = 6.0) -> None:
        self._bytes_per_token = bytes_per_token

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]:
        if request.route in POOLING_ROUTES:
            return list(backends)
        prompt = int(len(request.prompt) / self._bytes_per_token)
        needed = prompt + (request.max_tokens or 1)
        request.estimated_tokens = needed
        return [b for b in backends if b.capacity.context_length is None
                or (needed if b.spec.output_in_context else prompt + 1) <= b.capacity.context_length]
