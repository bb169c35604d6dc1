from __future__ import annotations

from collections.abc import Sequence

from gateway.pool.backend import Backend
from gateway.routing.prompt import BLOCK_BYTES
from gateway.routing.request import Outcome, RouteRequest
from gateway.routing.shape_model import ShapeModel, ShapeProfile
from gateway.routing.state import RoutingState


class EngineShapeScorer:
    """Prefers the backend predicted to finish this request first, knowing each engine's shape.

    predicted = queue wait + uncached prefill + planned tokens x per-token time at (current sequences + 1):
    * per-token time comes from the backend's :class:`ShapeModel` (fast alone vs fast in a crowd), seeded
      from a ``gateway profile`` measurement of that backend when configured, else its engine's shape seed;
    * uncached prefill uses the prefix index's view of this backend's cache and its learned prefill speed;
    * when every slot is taken, the wait is the sequences ahead beyond the slots, each holding a slot for
      about one planned request's decode time, shared across the slots.
    Score = best prediction / this prediction, so the best backend scores 1.

    Learns in its ``observe`` hook: each finished request's decode and prefill speed move that backend's
    model towards this deployment's reality. A backend that has served nothing yet is predicted at the more
    optimistic of its own seed and what its peers (same engine and seed, no profile) learned: with its seed
    alone, two identical llama-servers on a fast machine looked unequal (the one that had served learned the
    machine's real speed, the idle one kept the engine's typical 186 tok/s), and requests queued on the busy
    one's slots while the other stayed idle; optimism, not the peers' figures alone, keeps a backend that a
    slow peer's speed would hide worth a first try.
    """

    name = "engine-shape"

    def __init__(self, state: RoutingState) -> None:
        self._prefix = state.prefix  # attaches the shared prefix learner
        self._clock = state.clock
        self._profile: dict[str, ShapeProfile] = state.profile
        self._models: dict[str, ShapeModel] = {}

    def model(self, backend: Backend) -> ShapeModel:
        model = self._models.get(backend.name)
        if model is None:
            table, prefill = self._profile.get(backend.name, ({}, None))
            model = self._models[backend.name] = ShapeModel(backend.spec.shape, table)
            if prefill:
                model.prefill_tok_s = prefill
        return model

    def _peers(self, model: ShapeModel) -> list[ShapeModel]:
        """Learned models of backends like the one ``model`` is for, which has learned nothing itself."""
        return [m for m in self._models.values()
                if m.learned and m.seed is model.seed and not m.table and m is not model]

    def predict(self, request: RouteRequest, backend: Backend, now: float) -> float:
        model = self.model(backend)
        prefix = self._prefix
        queue = backend.estimated_queue(now)
        slots = backend.slots or 1
        running = min(queue + 1, slots)
        per_token = model.token_seconds(running)
        prefill_tok_s = model.prefill_tok_s
        if not model.learned and not model.table:
            for peer in self._peers(model):
                per_token = min(per_token, peer.token_seconds(running))
                prefill_tok_s = max(prefill_tok_s, peer.prefill_tok_s)
        planned = request.planned_tokens
        wait = 0.0
        if queue + 1 > slots:
            wait = (queue + 1 - slots) * planned * per_token / slots
        prompt_tokens = len(request.prompt) / prefix.bytes_per_token
        cached_tokens = prefix.match(backend, request.blocks) * BLOCK_BYTES / prefix.bytes_per_token
        prefill = max(0.0, prompt_tokens - cached_tokens) / prefill_tok_s
        return wait + prefill + planned * per_token

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        now = self._clock.monotonic()
        predictions = [self.predict(request, b, now) for b in backends]
        best = min(predictions)
        return [best / p if p > 0 else 1.0 for p in predictions]

    def observe(self, outcome: Outcome, backend: Backend) -> None:
        if not outcome.ok:
            return
        model = self.model(backend)
        if outcome.decode_seconds and outcome.completion_tokens and outcome.completion_tokens >= 4:
            model.observe_decode(outcome.concurrency, outcome.decode_seconds / (outcome.completion_tokens - 1))
        if outcome.ttft and outcome.prompt_tokens and outcome.concurrency <= (backend.slots or 1):
            # (a request that queued tells nothing about prefill speed)
            uncached = outcome.prompt_tokens - (outcome.cached_tokens or 0)
            model.observe_prefill(uncached, outcome.ttft)
