"""The precise-prefix scorer: the engines' events where a backend's stream is live, the approximate index per
backend where not, and the same load gate."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.kvcache.index import EventIndex
from gateway.kvcache.tokenizer import PromptTokenizer
from gateway.kvcache.wire import Batch, BlockStored
from gateway.pool.backend import Backend
from gateway.routing.cache_domain import CacheDomain
from gateway.routing.policies import BUILTIN, build_pipeline
from gateway.routing.request import RouteRequest
from gateway.routing.scorers.precise_prefix import PrecisePrefixScorer
from gateway.routing.scorers.prefix_affinity import PrefixAffinityScorer
from gateway.routing.state import RoutingState
from tests.clock import ManualClock
from tests.routing.helpers import backend, chat

pytestmark = pytest.mark.unit

SYSTEM = "the quick brown fox jumps over the lazy dog " * 12


class View:
    def __init__(self) -> None:
        self.index = EventIndex()
        self.expected = 0

    def expect_blocks(self, now: float | None = None) -> None:
        self.expected += 1


class Hub:
    def __init__(self) -> None:
        self.views: dict[str, View] = {}
        self.down: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.views)

    def live_index(self, b: Backend, now: float | None = None) -> View | None:
        return None if b.name in self.down else self.views.get(b.name)


def holding(tokens: list[int], count: int) -> View:
    """A view whose engine announced the first ``count`` tokens (whole 16-token blocks)."""
    view = View()
    n = count // 16 * 16
    view.index.apply(Batch(0, 0.0, (BlockStored(tuple(range(1, n // 16 + 1)), None, tuple(tokens[:n]), 16),)))
    return view


def setup(model_dir: Path) -> tuple[RoutingState, Hub, PromptTokenizer]:
    hub = Hub()
    tok = PromptTokenizer.from_dir(model_dir)
    return RoutingState(events=hub, tokenizers={"m": tok}), hub, tok


def test_the_backend_whose_events_hold_the_longest_prefix_scores_highest(model_dir: Path) -> None:
    state, hub, tok = setup(model_dir)
    request = chat(SYSTEM, "hello")
    tokens = tok.chat(request.body)
    assert tokens is not None and len(tokens) > 64
    hub.views = {"a": holding(tokens, 32), "b": holding(tokens, 64), "c": View()}
    scores = PrecisePrefixScorer(state).score(request, [backend("a"), backend("b"), backend("c")])
    assert scores == [32 / len(tokens), 64 / len(tokens), 0.0]


def test_backends_without_a_live_stream_are_scored_by_the_approximate_index(model_dir: Path) -> None:
    state, hub, tok = setup(model_dir)
    a, b = backend("a"), backend("b", engine="llamacpp")
    scorer = PrecisePrefixScorer(state)
    first = chat(SYSTEM, "one")
    state.prefix.assign(b, first.blocks, owner=1)  # b was sent this prompt before (approximate index)
    tokens = tok.chat(first.body)
    assert tokens is not None
    hub.views = {"a": holding(tokens, 48)}
    request = chat(SYSTEM, "one")
    approx = PrefixAffinityScorer(state).score(request, [a, b])
    scores = scorer.score(request, [a, b])
    assert scores[0] == 48 / len(tokens) and scores[1] == approx[1] > 0.5
    hub.down = {"a"}  # a's stream went stale: approximate for it too
    assert scorer.score(chat(SYSTEM, "one"), [a, b]) == PrefixAffinityScorer(state).score(chat(SYSTEM, "one"), [a, b])


def test_a_model_without_a_tokenizer_is_scored_approximately(model_dir: Path) -> None:
    state, hub, _ = setup(model_dir)
    hub.views = {"a": View(), "b": View()}
    request = chat(SYSTEM, "x", model="other")
    bs = [backend("a", models=("other",)), backend("b", models=("other",))]
    assert PrecisePrefixScorer(state).score(request, bs) == PrefixAffinityScorer(state).score(request, bs)
    assert request.tokenized and request.token_ids is None


def test_the_load_gate_applies_to_event_scores(model_dir: Path) -> None:
    state, hub, tok = setup(model_dir)
    request = chat(SYSTEM, "hello")
    tokens = tok.chat(request.body)
    assert tokens is not None
    hub.views = {"a": holding(tokens, 64), "b": View()}
    busy = backend("a", running=40, waiting=10)
    idle = backend("b", running=1, waiting=0)
    assert PrecisePrefixScorer(state).score(request, [busy, idle]) == [0.0, 0.0]


def test_routed_records_the_events_prediction_and_expects_new_blocks(model_dir: Path) -> None:
    state, hub, tok = setup(model_dir)
    request = chat(SYSTEM, "hello")
    tokens = tok.chat(request.body)
    assert tokens is not None
    whole = len(tokens) // 16 * 16
    hub.views = {"a": holding(tokens, whole), "b": holding(tokens, 16)}
    scorer = PrecisePrefixScorer(state)
    a, b = backend("a"), backend("b")
    scorer.score(request, [a, b])
    scorer.routed(request, b)
    assert request.events_cached_tokens == 16 and hub.views["b"].expected == 1
    scorer.routed(request, a)
    assert request.events_cached_tokens == whole and hub.views["a"].expected == 0  # nothing new to store


def test_the_default_policy_uses_events_and_without_them_routes_as_prefix(model_dir: Path) -> None:
    names = [s.name for s in BUILTIN["default"].scorers]
    assert "precise-prefix" in names and "prefix" not in names
    plain = build_pipeline("default", RoutingState())
    prefix = build_pipeline("prefix", RoutingState())
    bs = [backend("a"), backend("b", engine="sglang")]
    for pipeline in (plain, prefix):
        first = chat(SYSTEM, "q")
        pipeline.routed(first, bs[1])
    req = chat(SYSTEM, "q")
    assert plain.route(req, bs).ranked[0] is bs[1] and prefix.route(chat(SYSTEM, "q"), bs).ranked[0] is bs[1]


def test_a_prompt_just_routed_counts_as_held_until_its_events_are_due(model_dir: Path) -> None:
    state, hub, _ = setup(model_dir)
    state.clock = clock = ManualClock()
    hub.views = {"a": View(), "b": View()}
    a, b = backend("a"), backend("b")
    scorer = PrecisePrefixScorer(state, speculate_seconds=0.2)
    first = chat(SYSTEM, "one")
    scorer.score(first, [a, b])
    scorer.routed(first, b)  # its prefill has not finished: no event yet
    assert first.events_cached_tokens == 0 and hub.views["b"].expected == 1
    follower = scorer.score(chat(SYSTEM, "two"), [a, b])
    assert follower[0] == 0.0 and follower[1] > 0.5  # the shared system prompt follows the first request
    clock.advance(0.25)
    assert scorer.score(chat(SYSTEM, "three"), [a, b]) == [0.0, 0.0]  # never announced: forgotten


def salted(tokens: list[int], count: int, salt: str) -> View:
    """A view whose engine announced the first ``count`` tokens under ``salt`` (the chain's first block says it)."""
    view = View()
    n = count // 16 * 16
    view.index.apply(Batch(0, 0.0, (BlockStored(tuple(range(1, n // 16 + 1)), None, tuple(tokens[:n]), 16,
                                                cache_salt=salt),)))
    return view


def test_only_what_the_requests_own_cache_domain_cached_earns_credit(model_dir: Path) -> None:
    """Several domains: a prompt is keyed under the salt the engine gets with it, so blocks another domain's
    salted request stored (or an unsalted one) earn nothing, and the domain's own do; a backend whose engine
    cannot isolate is scored by the domain's own approximate index, never by its events."""
    state, hub, tok = setup(model_dir)
    a_domain, b_domain = CacheDomain("a", "salt-a"), CacheDomain("b", "salt-b")

    def request(domain: CacheDomain) -> RouteRequest:
        r = chat(SYSTEM, "hello")
        r.cache_domain = domain
        return r

    tokens = tok.chat(request(a_domain).body)
    assert tokens is not None and len(tokens) > 64
    hub.views = {"v": salted(tokens, 64, "salt-a"), "w": holding(tokens, 64)}
    v, w = backend("v"), backend("w", engine="sglang")
    scorer = PrecisePrefixScorer(state)
    assert scorer.score(request(a_domain), [v, w]) == [64 / len(tokens), 0.0]
    assert scorer.score(request(b_domain), [v, w]) == [0.0, 0.0]
    assert scorer.score(chat(SYSTEM, "hello"), [v, w]) == [0.0, 64 / len(tokens)]  # one domain: unsalted, as before

    unsalted_engine = backend("x", engine="openai")  # (none publishes events today; a live stream is ignored)
    hub.views["x"] = holding(tokens, 64)
    assert scorer.score(request(b_domain), [v, unsalted_engine])[1] == 0.0
