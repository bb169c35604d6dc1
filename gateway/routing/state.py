"""State the routing plugins of one gateway share and learn into: prefix indexes, sessions, engine shapes."""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

from gateway.pool.backend import Backend
from gateway.routing.prefix_index import PrefixIndexes
from gateway.routing.request import Outcome, RouteRequest
from gateway.routing.shape_model import ENGINE_SEEDS, ShapeModel, load_profile_file


class SessionTable:
    """Session key -> backend name, least recently used first out, entries idle past ``ttl`` forgotten."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 3600.0) -> None:
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.max_entries = max_entries
        self.ttl = ttl

    def get(self, key: str) -> str | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if time.monotonic() - entry[1] > self.ttl:
            del self._entries[key]
            return None
        return entry[0]

    def put(self, key: str, backend: str) -> None:
        self._entries[key] = (backend, time.monotonic())
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)


class RoutingState:
    def __init__(self, profile_file: Path | None = None) -> None:
        self.prefix = PrefixIndexes()
        self.sessions = SessionTable()
        self._shapes: dict[str, ShapeModel] = {}
        self._profile = load_profile_file(profile_file) if profile_file else {}

    def shape(self, backend: Backend) -> ShapeModel:
        model = self._shapes.get(backend.name)
        if model is None:
            seed = ENGINE_SEEDS.get(backend.engine, ENGINE_SEEDS["openai"])
            table, prefill = self._profile.get(backend.name, ({}, None))
            model = self._shapes[backend.name] = ShapeModel(seed, table)
            if prefill:
                model.prefill_tok_s = prefill
        return model

    def routed(self, request: RouteRequest, backend: Backend, track_prefix: bool) -> None:
        """The request goes to ``backend``: afterwards its cache holds the prompt; the session sticks."""
        if track_prefix and request.route != "embeddings":
            index = self.prefix.for_backend(backend)
            request.notes["predicted_blocks"] = index.match(request.blocks)
            index.insert(request.blocks)
        if request.session_key:
            self.sessions.put(request.session_key, backend.name)

    def observe(self, outcome: Outcome, backend: Backend) -> None:
        """Learn from a finished request: bytes per token, cache reality, decode and prefill speed."""
        if not outcome.ok:
            return
        request = outcome.request
        if outcome.prompt_tokens:
            self.prefix.learn_bytes_per_token(len(request.prompt), outcome.prompt_tokens)
        predicted = request.notes.get("predicted_blocks")
        if isinstance(predicted, int) and outcome.cached_tokens is not None:
            self.prefix.correct(backend, predicted, outcome.cached_tokens)
        model = self.shape(backend)
        if outcome.decode_seconds and outcome.completion_tokens and outcome.completion_tokens >= 4:
            model.observe_decode(outcome.concurrency, outcome.decode_seconds / (outcome.completion_tokens - 1))
        if outcome.ttft and outcome.prompt_tokens and outcome.concurrency <= (backend.slots or 1):
            # (a request that queued tells nothing about prefill speed)
            uncached = outcome.prompt_tokens - (outcome.cached_tokens or 0)
            model.observe_prefill(uncached, outcome.ttft)
