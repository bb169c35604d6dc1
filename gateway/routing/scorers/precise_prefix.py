from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from annotated_types import Ge

from gateway.kvcache.index import MIN_CHUNK_TOKENS, request_keys
from gateway.pool.backend import Backend
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.routing.scorers.prefix_affinity import Credit, PrefixAffinityScorer
from gateway.routing.state import EventIndexes, EventStreamView, RoutingState


class PrecisePrefixScorer:
    """Prefers the backend whose prefix cache holds the longest part of this prompt, as the engine's own KV
    events say (vLLM and SGLang with ``kv_events`` configured), for backends whose event stream is live;
    every other backend (llama.cpp and TabbyAPI, which publish none, or a stream that is missing, silent or
    rebuilding) is scored by the approximate ``prefix`` scorer. The prompt is tokenized with the model's
    tokenizer (``routing.tokenizers``); a model without one is scored approximately everywhere.

    Score = the fraction of the prompt's tokens held, in the engine's own reuse unit (whole blocks); the
    same load gate as ``prefix`` (a long queue, or no free slot while another candidate has one, gets no
    credit), so a hot prefix still spreads. A prompt just sent to a backend counts as held there for
    ``speculate_seconds`` (or until its events arrive), so the requests sharing it that arrive during its
    prefill follow it.

    Cache domains: a prompt is keyed under the ``cache_salt`` the engine gets with it (its cache domain's, while
    there are several: :mod:`gateway.routing.cache_domain`), as the engines announce salted prefixes, so only
    what the request's own domain cached earns credit. An engine that cannot isolate by salt (none publishes
    events today) is scored by its own domain's approximate index then, never by its events.
    """

    name = "precise-prefix"

    def __init__(self, state: RoutingState, gate_abs: Annotated[int, Ge(0)] = 12,
                 gate_rel: Annotated[float, Ge(0)] = 3.0, wait_credit: Credit = 0.5, empty_credit: Credit = 0.1,
                 speculate_seconds: Annotated[float, Ge(0)] = 5.0) -> None:
        self._approx = PrefixAffinityScorer(state, gate_abs, gate_rel, wait_credit, empty_credit)
        self._state = state
        self._speculate_seconds = speculate_seconds
        self._default_chunk = MIN_CHUNK_TOKENS  # before an engine's first event says its block size

    def _tokens(self, request: RouteRequest) -> list[int] | None:
        if not request.tokenized:
            request.tokenized = True
            tokenizer = self._state.tokenizers.get(request.model)
            if tokenizer is not None:
                if request.route == "chat":
                    request.token_ids = tokenizer.chat(request.body)
                elif request.route == "completions":
                    request.token_ids = tokenizer.completion(request.body.get("prompt"))
        return request.token_ids

    @staticmethod
    def _keys(request: RouteRequest, tokens: list[int], chunk: int, backend: Backend) -> list[bytes]:
        salt = request.engine_salt if backend.spec.cache_isolation is not None else None
        keys = request.chunk_keys if request.chunk_keys is not None else {}
        request.chunk_keys = keys
        found = keys.get((chunk, salt))
        if found is None:
            found = keys[chunk, salt] = request_keys(tokens, chunk, cache_salt=salt)
        return found

    def _held_tokens(self, request: RouteRequest, tokens: list[int], stream: EventStreamView, now: float,
                     backend: Backend) -> int:
        chunk = stream.index.chunk or self._default_chunk
        return int(stream.index.match(self._keys(request, tokens, chunk, backend), now) * chunk)

    @staticmethod
    def _stream(events: EventIndexes, request: RouteRequest, backend: Backend,
                now: float | None = None) -> EventStreamView | None:
        """The backend's live event stream, where its events can tell this request's domain apart."""
        if request.cache_domain.isolated and backend.spec.cache_isolation is None:
            return None
        return events.live_index(backend, now)

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]:
        events = self._state.events
        if events is None or not events.enabled or request.route in POOLING_ROUTES:
            return self._approx.score(request, backends)
        now = self._state.clock.monotonic()
        streams = [self._stream(events, request, b, now) for b in backends]
        if not any(streams):
            return self._approx.score(request, backends)
        tokens = self._tokens(request)
        if not tokens:
            return self._approx.score(request, backends)
        gate = self._approx.gated(backends, now)
        approx = self._approx.score(request, backends, gate) if not all(streams) else None
        long_queue, no_room = gate
        scores = []
        for i, stream in enumerate(streams):
            if stream is None:
                assert approx is not None
                scores.append(approx[i])
            elif long_queue[i] or no_room[i]:
                scores.append(0.0)
            else:
                scores.append(self._held_tokens(request, tokens, stream, now, backends[i]) / len(tokens))
        return scores

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        """Record what the events predict for the backend chosen, and tell its stream that events are due when
        the engine must store blocks it does not hold."""
        events = self._state.events
        request.events_cached_tokens = None
        if events is None or not events.enabled or request.route in POOLING_ROUTES:
            return
        stream = self._stream(events, request, backend)
        if stream is None:
            return
        tokens = self._tokens(request)  # (tokenized already, unless it was the only candidate: not scored)
        if not tokens:
            return
        index = stream.index
        chunk = index.chunk or self._default_chunk
        keys = self._keys(request, tokens, chunk, backend)
        announced = int(index.match(keys) * chunk)  # what the engine itself said, for the metrics
        request.events_cached_tokens = announced
        now = self._state.clock.monotonic()
        if announced + chunk <= len(tokens):
            stream.expect_blocks(now)
            index.speculate(keys, now + self._speculate_seconds)
