from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.prompt import BLOCK_BYTES
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class EngineShapeScorer:
    """Prefers the backend predicted to finish this request first, knowing each engine's shape.

    predicted = queue wait + uncached prefill + planned tokens x per-token time at (current sequences + 1):
    * per-token time comes from the backend's :class:`ShapeModel` (fast alone vs fast in a crowd);
    * uncached prefill uses the prefix index's view of this backend's cache and its learned prefill speed;
    * when every slot is taken, the wait is the sequences ahead beyond the slots, each holding a slot for
      about one planned request's decode time, shared across the slots.
    Score = best prediction / this prediction, so the best backend scores 1.
    """

    name = "engine-shape"
    uses_prefix = True

    def __init__(self, state: RoutingState) -> None:
        self._state = state

    def predict(self, request: RouteRequest, backend: Backend, now: float) -> float:
        model = self._state.shape(backend)
        prefix = self._state.prefix
        queue = backend.estimated_queue(now)
        slots = backend.slots or 1
        running = min(queue + 1, slots)
        per_token = model.token_seconds(running)
        planned = request.planned_tokens
        wait = 0.0
        if queue + 1 > slots:
            wait = (queue + 1 - slots) * planned * per_token / slots
        prompt_tokens = len(request.prompt) / prefix.bytes_per_token
        cached_tokens = prefix.match(backend, request.blocks) * BLOCK_BYTES / prefix.bytes_per_token
        prefill = max(0.0, prompt_tokens - cached_tokens) / model.prefill_tok_s
        return wait + prefill + planned * per_token

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        now = time.monotonic()
        predictions = [self.predict(request, b, now) for b in backends]
        request.notes["predicted_seconds"] = dict(zip((b.name for b in backends), predictions, strict=True))
        best = min(predictions)
        return [best / p if p > 0 else 1.0 for p in predictions]
