"""The routing plugins beyond the baseline: prefix affinity, sessions, engine shape, consistent hashing,
context and concurrency filters, and profiles assembled from YAML."""

from __future__ import annotations

import collections

import pytest

from gateway.config import ConfigError, settings_from_mapping
from gateway.engines.registry import ENGINES
from gateway.pool.state import Health, Probe
from gateway.routing.pipeline import NoRoute
from gateway.routing.policies import build_pipeline, check_settings
from gateway.routing.prompt import BLOCK_BYTES, block_hashes, render
from gateway.routing.request import Outcome
from gateway.routing.scorers import EngineShapeScorer
from gateway.routing.state import RoutingState
from tests.routing.helpers import backend, chat

pytestmark = pytest.mark.unit

SYSTEM = "You are a careful assistant for the operators of a fleet of inference servers. " * 30  # ~2.4 KB


def routing(policy: str, **extra: object) -> object:
    return settings_from_mapping({"routing": {"policy": policy, **extra}}).routing


def test_canonical_prompt_covers_every_message_and_tools() -> None:
    a = render("chat", chat("sys", "hello").body)
    assert b"<system>" in a and b"sys" in a and b"<user>" in a and b"hello" in a
    with_tools = render("chat", {**chat("sys", "hello").body, "tools": [{"type": "function", "function": {
        "name": "f"}}]})
    assert with_tools.startswith(b"<tools>") and with_tools.endswith(a)
    # chained: a shared prefix shares its leading hashes, the model seeds them
    long_a, long_b = (render("chat", chat(SYSTEM, q * 40).body) for q in ("first question ", "second one "))
    ha, hb = block_hashes("m", long_a), block_hashes("m", long_b)
    shared = len(SYSTEM) // BLOCK_BYTES
    assert ha[:shared] == hb[:shared] and ha[-1] != hb[-1]
    assert block_hashes("other", long_a)[0] != ha[0]


def test_prefix_goes_where_it_is_cached_and_spreads_when_hot() -> None:
    pipeline = build_pipeline(routing("prefix"))  # type: ignore[arg-type]
    backends = [backend(n, slots=8) for n in "abcd"]
    first = pipeline.route(chat(SYSTEM, "q0"), backends)
    home = first.ranked[0]
    pipeline.routed(chat(SYSTEM, "q0"), home)
    for i in range(1, 6):
        decision = pipeline.route(chat(SYSTEM, f"question {i}"), backends)
        assert decision.ranked[0] is home and decision.reason == "prefix"
    # the home backend gets busy: past the load gate, affinity no longer pins the prefix there
    home.in_flight = 20
    decision = pipeline.route(chat(SYSTEM, "question 7"), backends)
    assert decision.ranked[0] is not home


def test_prefix_index_is_bounded_by_the_cache_and_corrected_by_reports() -> None:
    state = RoutingState()
    pipeline = build_pipeline(routing("prefix"), state)  # type: ignore[arg-type]
    small = backend("small", cache_tokens=320)  # 320 tokens x 4 bytes = 10 blocks, floored at 64 blocks
    index = state.prefix.for_backend(small)
    assert index.capacity == 64
    request = chat(SYSTEM * 4, "x")  # ~75 blocks
    pipeline.routed(request, small)
    assert len(index) == 64
    assert index.match(request.blocks) == 0, "the oldest (leading) blocks were evicted first"

    big = backend("big", cache_tokens=1_000_000)
    request = chat(SYSTEM, "y")
    pipeline.routed(request, big)
    again = chat(SYSTEM, "y")
    pipeline.routed(again, big)
    assert again.predicted_cached_blocks == len(again.blocks)
    before = state.prefix.for_backend(big).capacity
    pipeline.observe(Outcome(request=again, backend="big", concurrency=1, ok=True, prompt_tokens=600,
                          cached_tokens=0), big)
    assert state.prefix.for_backend(big).capacity < before, "a predicted hit reported as a miss shrinks it"

    big.record_probe(Probe(Health.DOWN))
    big.record_probe(Probe(Health.READY))  # restarted: its cache is empty
    assert state.prefix.match(big, again.blocks) == 0


def test_session_sticks_until_its_backend_is_overloaded() -> None:
    pipeline = build_pipeline(routing("session"))  # type: ignore[arg-type]
    backends = [backend(n) for n in "abc"]
    chosen = pipeline.route(chat("s", "hi", session="s1"), backends).ranked[0]
    pipeline.routed(chat("s", "hi", session="s1"), chosen)
    chosen.in_flight = 2  # busier than the others, but not overloaded (4 slots)
    for _ in range(5):
        decision = pipeline.route(chat("s", "more", session="s1"), backends)
        assert decision.ranked[0] is chosen and decision.reason == "session"
    chosen.in_flight = 7  # > 1.5 x 4 slots
    assert pipeline.route(chat("s", "more", session="s1"), backends).ranked[0] is not chosen


def test_engine_shape_sends_one_user_to_the_fast_alone_engine_and_a_crowd_to_the_batching_one() -> None:
    pipeline = build_pipeline(routing("engine-shape"))  # type: ignore[arg-type]
    exl = backend("exl", engine="tabbyapi", slots=64)
    vllm = backend("vllm", engine="vllm", slots=256)
    assert pipeline.route(chat("s", "q", max_tokens=200), [exl, vllm]).ranked[0] is exl
    exl.in_flight = 8  # 9 users on ExLlama: each at ~1/8 speed; vLLM alone barely slower than alone
    decision = pipeline.route(chat("s", "q", max_tokens=200), [exl, vllm])
    assert decision.ranked[0] is vllm and decision.reason == "engine-shape"


def test_engine_shape_learns_from_observed_speed() -> None:
    state = RoutingState()
    pipeline = build_pipeline(routing("engine-shape"), state)  # type: ignore[arg-type]
    a, b = backend("a", engine="vllm"), backend("b", engine="vllm")
    request = chat("s", "q", max_tokens=100)
    for _ in range(5):  # "a" turns out 4x slower than the vLLM default
        pipeline.observe(Outcome(request=request, backend="a", concurrency=1, ok=True, ttft=0.01,
                              decode_seconds=99 * 4 / 175, prompt_tokens=10, completion_tokens=100), a)
    assert pipeline.route(chat("s", "q", max_tokens=100), [a, b]).ranked[0] is b
    shape = next(s for s, _ in pipeline.scorers if isinstance(s, EngineShapeScorer))
    assert shape.model(a).token_seconds(1) == pytest.approx(4 / 175, rel=0.05)


def test_consistent_hash_replicas_agree_without_sharing_state_and_spill_when_hot() -> None:
    replica_1 = build_pipeline(routing("consistent-prefix"))  # type: ignore[arg-type]
    replica_2 = build_pipeline(routing("consistent-prefix"))  # type: ignore[arg-type]
    backends = [backend(n, slots=8) for n in ("b0", "b1", "b2", "b3")]
    homes = collections.Counter()
    for g in range(40):
        prefix = f"group {g} " * 100
        one = replica_1.route(chat(prefix, "q1"), backends).ranked[0]
        two = replica_2.route(chat(prefix, "another question"), list(reversed(backends))).ranked[0]
        assert one is two
        homes[one.name] += 1
    assert len(homes) == 4 and min(homes.values()) >= 4, homes
    # a hot home spills to the next backend on the ring, the same one on every replica
    prefix = "group 0 " * 100
    home = replica_1.route(chat(prefix, "q"), backends).ranked[0]
    home.in_flight = 10
    spill_1 = replica_1.route(chat(prefix, "q"), backends).ranked[0]
    spill_2 = replica_2.route(chat(prefix, "q"), backends).ranked[0]
    assert spill_1 is spill_2 and spill_1 is not home
    # removing another backend does not move this prefix
    home.in_flight = 0
    others = [b for b in backends if b is not home and b is not spill_1]
    assert replica_1.route(chat(prefix, "q"), [home, spill_1, others[0]]).ranked[0] is home


def test_context_and_concurrency_filters() -> None:
    pipeline = build_pipeline(routing("least-load"))  # type: ignore[arg-type]
    short, long = backend("short", context=1024), backend("long", context=32768)
    assert pipeline.route(chat("s", "q", max_tokens=4000), [short, long]).ranked == [long]
    with pytest.raises(NoRoute) as err:
        pipeline.route(chat("s", "q", max_tokens=100_000), [short, long])
    assert err.value.stage == "fits-context"
    full = backend("full", max_concurrency=2, in_flight=2)
    free = backend("free", max_concurrency=2, in_flight=1)
    assert pipeline.route(chat("s", "q"), [full, free]).ranked == [free]
    with pytest.raises(NoRoute) as err:
        pipeline.route(chat("s", "q"), [full])
    assert err.value.stage == "below-max-concurrency"


def test_profiles_from_yaml_with_parameters_and_clear_errors() -> None:
    custom = {"profiles": {"mine": {"filters": ["serves-model", "healthy"],
                                    "scorers": [{"name": "prefix", "weight": 2, "gate_abs": 1},
                                                {"name": "least-load", "weight": 1}],
                                    "picker": {"name": "consistent-hash", "vnodes": 8}}}}
    pipeline = build_pipeline(routing("mine", **custom))  # type: ignore[arg-type]
    assert [f.name for f in pipeline.filters] == ["serves-model", "healthy"]
    assert [(s.name, w) for s, w in pipeline.scorers] == [("prefix", 2.0), ("least-load", 1.0)]
    assert pipeline.picker.name == "consistent-hash"
    for profile, message in [
        ({"scorers": [{"name": "prefx"}]},
         "unknown scorer 'prefx'; known: engine-shape, least-load, precise-prefix, prefix"),
        ({"scorers": [{"name": "prefix", "gate": 3}]}, "scorer 'prefix'"),
        ({"filters": ["healthy", "fast"]}, "unknown filter 'fast'"),
        ({"picker": "best"}, "unknown picker 'best'"),
    ]:
        settings = settings_from_mapping({"routing": {"policy": "bad", "profiles": {"bad": profile}}})
        with pytest.raises(ConfigError, match=message):
            check_settings(settings)


def test_a_plugin_that_learns_gets_its_own_hooks_and_shared_state_is_kept_only_when_used() -> None:
    from gateway.routing.plugins import SCORERS

    seen: list[tuple[str, str]] = []

    class Counting:
        name = "counting"

        def __init__(self, state: RoutingState) -> None:
            pass

        def score(self, request: object, backends: list[object]) -> list[float]:
            return [0.0] * len(backends)

        def routed(self, request: object, backend: object) -> None:
            seen.append(("routed", backend.name))  # type: ignore[attr-defined]

        def observe(self, outcome: Outcome, backend: object) -> None:
            seen.append(("observe", outcome.backend))

    SCORERS["counting"] = Counting
    try:
        state = RoutingState()
        pipeline = build_pipeline(routing("mine", profiles={"mine": {"scorers": [{"name": "counting"}]}}), state)  # type: ignore[arg-type]
        a = backend("a")
        request = chat(SYSTEM, "q")
        pipeline.routed(request, a)
        pipeline.observe(Outcome(request=request, backend="a", concurrency=1, ok=True), a)
        assert seen == [("routed", "a"), ("observe", "a")]
        assert state.learners == [], "no plugin asked for the prefix index, so none is kept"
        assert request.predicted_cached_blocks is None
    finally:
        del SCORERS["counting"]
    state = RoutingState()
    build_pipeline(routing("default"), state)  # type: ignore[arg-type]
    assert len(state.learners) == 1, "prefix and engine-shape share one prefix learner"


def test_a_profile_gives_prefill_speed_from_its_lowest_level_where_nothing_queued(tmp_path: object) -> None:
    import json
    import pathlib

    from gateway.routing.shape_model import load_profile_file

    path = pathlib.Path(str(tmp_path)) / "profile.json"
    levels = [{"concurrency": 8, "per_user_decode_tok_s": 5.0, "prefill_tok_s": 665.0},
              {"concurrency": 1, "per_user_decode_tok_s": 40.0, "prefill_tok_s": 13_000.0},
              {"concurrency": 2, "per_user_decode_tok_s": 20.0, "prefill_tok_s": 4_000.0, "host_saturated": True}]
    path.write_text(json.dumps({"backends": {"one-slot": {"levels": levels}}}))
    table, prefill = load_profile_file(path)["one-slot"]
    assert table == {8: 1 / 5.0, 1: 1 / 40.0} and prefill == 13_000.0


def test_engine_shape_gives_an_idle_backend_what_its_peers_learned_when_that_is_faster() -> None:
    """Two identical llama-servers on a machine faster than the engine's typical figures (found on real ones):
    the one that had served learned the real speed, the idle one kept the seed's, looked ten times slower, and
    requests queued on the busy one's two slots while the other stayed idle."""
    state = RoutingState()
    pipeline = build_pipeline(routing("engine-shape"), state)  # type: ignore[arg-type]
    a, b = backend("a", engine="llamacpp", slots=2), backend("b", engine="llamacpp", slots=2)
    request = chat("s", "q", max_tokens=32)
    seed = ENGINES["llamacpp"].shape
    for _ in range(5):  # "a" decodes and prefills ten times faster than the seed says
        pipeline.observe(Outcome(request=request, backend="a", concurrency=1, ok=True,
                                 ttft=1000 / seed.prefill_tok_s / 10, decode_seconds=31 / seed.tok_s / 10,
                                 prompt_tokens=1000, completion_tokens=32), a)
    shape = next(s for s, _ in pipeline.scorers if isinstance(s, EngineShapeScorer))
    now = 1000.0  # (the same moment for both: neither has a load reading to be fresh or stale)
    assert shape.predict(request, b, now) == pytest.approx(shape.predict(request, a, now))  # alike, both idle
    a.in_flight = 2  # its slots full: the next one would queue there
    assert pipeline.route(chat("s", "q", max_tokens=32), [a, b]).ranked[0] is b
    assert not shape.model(b).learned, "b's own model is untouched: it learns from its own requests"
