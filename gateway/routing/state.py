"""State that several routing plugins share: what each backend's prefix cache probably holds.

Shared state is a *learner*: it has its own hooks, called by the pipeline after a request is sent
(``routed``) and after it finished (``observe``). It is attached when the first plugin asks for it, so a
policy that uses no prefix scorer keeps no prefix index. A plugin that learns something only it reads (the
session table, the engine-shape models) keeps that state itself and has the same hooks (see
:mod:`gateway.routing.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from gateway.clock import SYSTEM, Clock
from gateway.pool.backend import Backend
from gateway.routing.plugins import Learner
from gateway.routing.prefix_index import PrefixIndexes
from gateway.routing.prompt import BLOCK_BYTES
from gateway.routing.request import POOLING_ROUTES, Outcome, RouteRequest
from gateway.routing.shape_model import ShapeProfile, load_profile_file

if TYPE_CHECKING:
    from gateway.kvcache.index import EventIndex
    from gateway.kvcache.tokenizer import PromptTokenizer


class EventStreamView(Protocol):
    """What routing reads of one engine's KV-event subscriber (:mod:`gateway.kvcache.subscriber`)."""

    @property
    def index(self) -> EventIndex: ...

    def expect_blocks(self, now: float | None = None) -> None: ...


class EventIndexes(Protocol):
    @property
    def enabled(self) -> bool:
        """Some backend's events are followed at all."""

    def live_index(self, backend: Backend, now: float | None = None) -> EventStreamView | None:
        """The backend's event stream while it is complete and current, else None."""


class Peers(Protocol):
    """The other gateway replicas, as routing sees them (``gateway.state.SharedState`` when configured with a
    shared store): what one learns it publishes, and each applies what the others published to its own
    tables."""

    def publish(self, topic: str, payload: Any) -> None: ...

    def subscribe(self, topic: str, handler: Callable[[Any], None]) -> None: ...


class NoPeers:
    """One gateway on its own."""

    def publish(self, topic: str, payload: Any) -> None:
        pass

    def subscribe(self, topic: str, handler: Callable[[Any], None]) -> None:
        pass


class PrefixLearner:
    """Keeps the per-backend prefix indexes up to date: a routed prompt is assumed cached where it went;
    what the engine then reports as cached corrects the index's size, and reported prompt tokens refine the
    bytes-per-token estimate. With peers, each replica publishes the blocks it routed (``blocks``: backend
    name and keys) and inserts the others' into the same backend's block index, so replicas agree on what
    each cache holds (llama.cpp slot indexes, which follow one replica's own placements, stay local)."""

    def __init__(self, peers: Peers | None = None) -> None:
        self.indexes = PrefixIndexes()
        self._peers = peers or NoPeers()
        self._peers.subscribe("blocks", self._remote)

    def _remote(self, payload: Any) -> None:
        backend, keys = payload
        self.indexes.remote_insert(str(backend), keys)

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        if request.route in POOLING_ROUTES:
            return
        previous = request.cached_on
        if previous is not None and previous is not backend:  # failover: the attempt there has ended
            self.indexes.release(previous, id(request))
        request.predicted_cached_blocks, request.engine_slot = self.indexes.assign(backend, request.blocks,
                                                                                   id(request))
        request.cached_on = backend
        request.predicted_cached_tokens = int(request.predicted_cached_blocks * BLOCK_BYTES
                                              / self.indexes.bytes_per_token)
        if request.blocks:
            self._peers.publish("blocks", (backend.name, request.blocks))

    def observe(self, outcome: Outcome, backend: Backend) -> None:
        request = outcome.request
        if request.cached_on is not None:
            self.indexes.release(request.cached_on, id(request))
            request.cached_on = None
        if not outcome.ok:
            return
        if outcome.prompt_tokens:
            self.indexes.learn_bytes_per_token(len(request.prompt), outcome.prompt_tokens)
        predicted = request.predicted_cached_blocks
        if predicted is not None and outcome.cached_tokens is not None:
            self.indexes.correct(backend, predicted, outcome.cached_tokens)


class RoutingState:
    """What the plugins of one gateway share. ``learners`` lists the attached shared learners."""

    def __init__(self, profile_file: Path | None = None, *, events: EventIndexes | None = None,
                 tokenizers: Mapping[str, PromptTokenizer] | None = None, clock: Clock = SYSTEM) -> None:
        self.learners: list[Learner] = []
        self.clock = clock  # the time the plugins' tables (sessions, credits) read
        # engines' KV events (backends configured with kv_events) and the models' tokenizers, for precise-prefix
        self.events = events
        self.tokenizers: Mapping[str, PromptTokenizer] = tokenizers or {}
        self._prefix: PrefixLearner | None = None
        self.peers: Peers = NoPeers()  # set before the pipeline is built (gateway.app)
        # measured speed curves per backend name (``gateway profile``), for plugins that model engine shape
        self.profile: dict[str, ShapeProfile] = load_profile_file(profile_file) if profile_file else {}
        # what plugins keep across the pipelines built on this state (a reload rebuilds them), by plugin name
        self.kept: dict[str, Any] = {}

    @property
    def prefix(self) -> PrefixIndexes:
        """The prefix indexes; asking for them attaches their learner."""
        if self._prefix is None:
            self._prefix = PrefixLearner(self.peers)
            self.learners.append(self._prefix)
        return self._prefix.indexes
