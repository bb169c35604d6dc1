"""Filters, the least-load scorer, both pickers and the pipeline runner, on hand-made backend states."""

from __future__ import annotations

import collections
import random
import time

import pytest

from gateway.pool.backend import Backend
from gateway.pool.state import Capacity, Health, LoadRecord, Probe
from gateway.routing.pickers import MaxScorePicker, RoundRobinPicker
from gateway.routing.pipeline import NoRoute
from gateway.routing.policies import build_pipeline
from gateway.routing.request import RouteRequest
from gateway.routing.scorers import LeastLoadScorer
from gateway.routing.state import RoutingState

pytestmark = pytest.mark.unit


def backend(name: str, *, models: tuple[str, ...] = ("m",), health: Health = Health.READY,
            slots: int | None = 4, running: int | None = None, waiting: int | None = None,
            in_flight: int = 0, age: float = 0.0) -> Backend:
    b = Backend(name, "vllm", f"http://{name}", stale_after=5.0)
    b.models = frozenset(models)
    b.record_probe(Probe(health))
    b.capacity = Capacity(slots=slots)
    if running is not None or waiting is not None:
        b.record_load(LoadRecord(running, waiting, None, time.monotonic() - age))
    b.in_flight = in_flight
    return b


def request(model: str = "m") -> RouteRequest:
    return RouteRequest(route="chat", model=model, stream=False, max_tokens=None, body={})


def test_unknown_model_stops_at_serves_model_and_down_backends_at_healthy() -> None:
    pipeline = build_pipeline("least-load")
    with pytest.raises(NoRoute) as unknown:
        pipeline.route(request("other"), [backend("a")])
    assert unknown.value.stage == "serves-model"
    with pytest.raises(NoRoute) as down:
        pipeline.route(request(), [backend("a", health=Health.DOWN), backend("b", health=Health.LOADING)])
    assert down.value.stage == "healthy"


def test_least_load_prefers_fewer_sequences_per_slot() -> None:
    busy = backend("busy", slots=4, running=4, waiting=2)
    big = backend("big", slots=64, running=10)
    idle = backend("idle", slots=4)
    decision = build_pipeline("least-load").route(request(), [busy, big, idle])
    assert [b.name for b in decision.ranked] == ["idle", "big", "busy"]
    assert decision.policy == "least-load" and decision.reason == "least-load"
    assert set(decision.timings) == {"serves-model", "structured-output", "healthy", "fits-context",
                                     "below-max-concurrency", "least-load", "max-score"}


def test_engine_reading_is_corrected_by_our_own_in_flight_change() -> None:
    b = backend("a", slots=4, running=3, waiting=0)  # read while we had 0 in flight
    b.in_flight = 2  # two more sent since the reading
    assert b.estimated_queue() == 5
    stale = backend("s", slots=4, running=3, in_flight=1, age=10.0)
    assert stale.estimated_queue() == 1, "a stale reading falls back to our own in-flight count"
    tabby = backend("t", in_flight=2)  # never has a reading
    assert tabby.estimated_queue() == 2


def test_least_load_score_stays_ordered_past_saturation() -> None:
    scores = LeastLoadScorer(RoutingState()).score(request(), [backend("a", running=8), backend("b", running=16),
                                                 backend("c", running=0)])
    assert scores[2] == 1.0 and 1.0 > scores[0] > scores[1] > 0.0


def test_round_robin_takes_turns_and_ignores_load() -> None:
    backends = [backend("b", running=100), backend("a"), backend("c")]
    pipeline = build_pipeline("round-robin")
    firsts = [pipeline.route(request(), backends).ranked[0].name for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    ranked = RoundRobinPicker(RoutingState()).pick(request(), backends, [0.0] * 3)
    assert sorted(b.name for b in ranked) == ["a", "b", "c"], "the rest is the failover order"


def test_max_score_breaks_ties_by_in_flight_then_spreads_them() -> None:
    picker = MaxScorePicker(RoutingState(), random.Random(1))
    a, b = backend("a", in_flight=1), backend("b")
    assert picker.pick(request(), [a, b], [0.5, 0.5])[0] is b
    c, d = backend("c"), backend("d")
    counts = collections.Counter(picker.pick(request(), [c, d], [0.5, 0.5])[0].name for _ in range(200))
    assert min(counts.values()) > 50


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'.*least-load"):
        build_pipeline("fastest")


def test_ties_are_broken_alike_by_every_replica_and_spread_over_prompts() -> None:
    """Two pickers (two gateway replicas) given the same tied request pick the same backend; different
    prompts spread over the tied backends; fewer in flight still comes first."""
    from gateway.routing.pickers.max_score import MaxScorePicker
    from gateway.routing.state import RoutingState
    from tests.routing.helpers import backend, chat

    bs = [backend(n) for n in "abcd"]
    a, b = MaxScorePicker(RoutingState()), MaxScorePicker(RoutingState())
    firsts = set()
    for i in range(40):
        req = chat(f"system prompt number {i}" + " of some length" * 10, "hi")
        pick = a.pick(req, bs, [0.5] * 4)[0]
        assert b.pick(chat(f"system prompt number {i}" + " of some length" * 10, "hi"), bs, [0.5] * 4)[0] is pick
        firsts.add(pick.name)
    assert len(firsts) == 4
    for other in (bs[0], bs[2], bs[3]):
        other.in_flight = 1  # b has fewer in flight than the others: wins every tie
    assert a.pick(chat("x", "y"), bs, [0.5] * 4)[0] is bs[1]


@pytest.mark.parametrize("policy", ["default", "round-robin", "prefix"])
def test_a_request_of_several_generations_goes_only_where_they_are_charged_and_scheduled(policy: str) -> None:
    """llama.cpp answers n choices (or a completions list of prompts) with the usage of one and runs each in a slot
    of its own (sweep 19: 8x to ~490x a key's token budget, every slot taken as one request): a request of several
    generations goes to another engine serving the model, under every policy (this is no configurable filter);
    where none serves it, it is refused (the dispatcher says why)."""
    from tests.routing.helpers import backend as engine_backend

    pipeline = build_pipeline(policy)
    llama, vllm = engine_backend("l", engine="llamacpp"), engine_backend("v", engine="vllm")
    plain = engine_backend("o", engine="openai")  # (llama-server may be one: sweep 20)
    several = RouteRequest(route="chat", model="m", stream=False, max_tokens=8, body={"n": 2}, generations=2)
    for _ in range(5):
        assert [b.name for b in pipeline.route(several, [llama, vllm, plain]).ranked] == ["v"]
    with pytest.raises(NoRoute) as refused:
        pipeline.route(several, [llama, plain])
    assert refused.value.stage == "several-generations"
    one = RouteRequest(route="chat", model="m", stream=False, max_tokens=8, body={})
    assert pipeline.route(one, [llama]).ranked[0] is llama


@pytest.mark.parametrize("policy", ["default", "round-robin", "prefix"])
def test_a_request_sampling_the_whole_vocabulary_never_goes_to_llamacpp(policy: str) -> None:
    """llama.cpp samples every slot's token on the main loop all slots share: top_k 0, a sampler chain with top_p
    or typical_p before top_k, or mirostat sorts the whole vocabulary at every token (sweep 21: other keys' streams
    at an eighth of their pace with a 128k vocabulary). Such a request goes to another engine, under every policy;
    where none serves the model, it is refused (the dispatcher says why)."""
    from tests.routing.helpers import backend as engine_backend

    pipeline = build_pipeline(policy)
    llama, vllm = engine_backend("l", engine="llamacpp"), engine_backend("v", engine="vllm")
    plain = engine_backend("o", engine="openai")
    whole = RouteRequest(route="chat", model="m", stream=False, max_tokens=8, body={"top_k": 0},
                         whole_vocabulary="top_k")
    for _ in range(5):
        assert [b.name for b in pipeline.route(whole, [llama, vllm, plain]).ranked] == ["v"]
    with pytest.raises(NoRoute) as refused:
        pipeline.route(whole, [llama, plain])
    assert refused.value.stage == "whole-vocabulary"


@pytest.mark.parametrize("policy", ["default", "round-robin", "prefix"])
def test_a_request_whose_grammar_goes_many_ways_at_once_never_goes_to_llamacpp(policy: str) -> None:
    """llama.cpp checks every candidate token against each way its grammar's parse may go, on the main loop
    (sweep 22: 1,831 ways, 649 ms a token with a 128k vocabulary). A request whose constraint or tools would have it
    follow too many (RouteRequest.fanout) goes to another engine, under every policy, or is refused."""
    from tests.routing.helpers import backend as engine_backend

    pipeline = build_pipeline(policy)
    llama, vllm = engine_backend("l", engine="llamacpp"), engine_backend("v", engine="vllm")
    plain = engine_backend("o", engine="openai")
    many = RouteRequest(route="chat", model="m", stream=False, max_tokens=8, body={},
                        fanout="the grammar of grammar has a parse that may go 120 ways at once")
    for _ in range(5):
        assert [b.name for b in pipeline.route(many, [llama, vllm, plain]).ranked] == ["v"]
    with pytest.raises(NoRoute) as refused:
        pipeline.route(many, [llama, plain])
    assert refused.value.stage == "many-parses"


@pytest.mark.parametrize(("body", "field"), [
    ({}, None),
    ({"top_k": 40, "typical_p": 0.9}, None),
    ({"top_k": 1000}, None),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 1001}, "top_k"),
    ({"top_k": 40.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"samplers": "edskypmxt"}, None),  # (llama.cpp's default chain)
    ({"samplers": ["penalties", "DRY", "top-n-sigma", "TopK", "typ_p", "nucleus", "min_p", "xtc", "temp"]}, None),
    ({"samplers": "t"}, None),  # (a linear pass, then the token drawn)
    # sweep 24: a dynamic temperature range sorts every candidate (to weigh their entropy) where it is
    ({"samplers": ["temperature", "top_k"], "dynatemp_range": 0.5}, "dynatemp_range"),
    ({"samplers": "tk", "dynatemp_range": 2}, "dynatemp_range"),
    ({"samplers": "tk", "dynatemp_range": True}, "dynatemp_range"),  # (llama.cpp reads true as 1.0: sweep 25)
    ({"samplers": "kt", "dynatemp_range": 0.5}, None),  # (after top_k: what it sorts is top_k's)
    ({"samplers": "tk", "dynatemp_range": 0}, None),
    ({"dynatemp_range": 0.5}, None),  # (the default chain: temperature last)
    ({"samplers": ""}, None),
    ({"samplers": "a"}, None),
    ({"samplers": "y"}, "samplers"),
    ({"samplers": "tpk"}, "samplers"),
    ({"samplers": ["Typ", "top_k"]}, "samplers"),
    # (a name llama.cpp 0.3.36 skips may be a sampler of another version: counted as one that sorts)
    ({"samplers": ["typical_p", "top_k"]}, "samplers"),
    ({"samplers": "m"}, "samplers"),
    ({"mirostat": 2}, "mirostat"),
    ({"mirostat": 1, "top_k": 40}, "mirostat"),
    ({"mirostat": 0, "samplers": "kp"}, None),
])
def test_which_requests_sample_the_whole_vocabulary(body: dict[str, object], field: str | None) -> None:
    from gateway.engines.sampling import whole_vocabulary

    assert whole_vocabulary(body) == field
