"""llama.cpp's slots as the gateway models them (one prompt per slot, placed by llama.cpp's rule), and the
placements that follow: each prefix keeps a slot, a busy prefix waits for its slot rather than evicting
another, and the request names the slot so the engine places it as predicted."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.app import create_app
from gateway.config import BackendSettings, settings_from_mapping
from gateway.engines.base import EngineAdapter
from gateway.pool.state import Capacity
from gateway.proxy.transport import MockRequest, MockResponse, MockTransport
from gateway.routing.policies import build_pipeline
from gateway.routing.prefix_index import BlockIndex, PrefixIndexes
from gateway.routing.request import Outcome
from gateway.routing.slot_index import SlotIndex
from gateway.routing.state import RoutingState
from tests.clock import ManualClock
from tests.routing.helpers import backend, chat

pytestmark = pytest.mark.unit


def prompt(group: str, question: str, n: int = 40) -> list[bytes]:
    """Chained blocks: ``n`` of the group's prefix, then one of the question."""
    return [f"{group}{i}".encode() for i in range(n)] + [f"{group}-{question}".encode()]


def test_a_slot_is_chosen_as_llama_cpp_chooses_it() -> None:
    index = SlotIndex(2)
    assert index.assign(prompt("a", "1"), "r1").slot == 1, "no slot holds anything: the last least recently used"
    index.release("r1")
    assert index.assign(prompt("b", "1"), "r2").slot == 0, "then the other, least recently used"
    index.release("r2")
    placement = index.assign(prompt("a", "2"), "r3")
    assert (placement.slot, placement.cached, placement.waits) == (1, 40, False), "the slot sharing the most"
    # a prompt sharing no more than 10% with any slot goes to the least recently used idle slot
    index.release("r3")
    assert index.plan(prompt("a", "3", n=1) + [b"x"] * 30).slot == 0


def test_a_busy_slot_is_skipped_unless_the_engine_takes_a_named_slot() -> None:
    plain = SlotIndex(2)
    plain.assign(prompt("a", "1"), "r1")
    plain.assign(prompt("b", "1"), "r2")
    plain.release("r2")
    # "a" sits in a busy slot: llama.cpp gives the request the idle slot, evicting "b" there
    assert plain.plan(prompt("a", "2")).waits is False and plain.match(prompt("a", "2")) == 0

    pinned = SlotIndex(2, pin=True)
    first = pinned.assign(prompt("a", "1"), "r1")
    pinned.assign(prompt("b", "1"), "r2")
    pinned.release("r2")
    wait = pinned.assign(prompt("a", "2"), "r3")
    assert (wait.slot, wait.cached, wait.waits) == (first.slot, 40, True), "waits for the slot holding its prefix"
    # at most two waiting behind the running one: the fourth request of "a" takes the idle slot (and evicts
    # "b") instead of queueing
    assert pinned.assign(prompt("a", "3"), "r4").waits is True
    fourth = pinned.plan(prompt("a", "4"))
    assert fourth.waits is False and fourth.slot != first.slot and fourth.cached == 0


def test_a_slot_held_by_a_request_the_gateway_never_heard_of_again_frees_itself() -> None:
    clock = ManualClock()
    index = SlotIndex(1, busy_ttl=600.0, clock=clock)
    index.assign(prompt("a", "1"), "lost")
    clock.advance(600.0)
    busy = index.plan(prompt("b", "2"))
    assert (busy.slot, busy.waits) == (None, True), "busy for its whole time to live"
    clock.advance(0.001)
    placement = index.plan(prompt("a", "2"))
    assert (placement.slot, placement.cached, placement.waits) == (0, 40, False), "idle again, prefix still there"


def test_the_slot_model_is_used_only_where_the_engine_caches_by_slot_and_says_how_many() -> None:
    indexes = PrefixIndexes()
    llama = backend("l", engine="llamacpp", slots=2)
    assert isinstance(indexes.for_backend(llama), BlockIndex), "with its host prompt cache (the default)"
    llama = backend("l2", engine="llamacpp", slots=2)
    llama.cache_ram_mib = 0
    assert isinstance(indexes.for_backend(llama), SlotIndex)
    llama.capacity = Capacity(slots=None)
    assert isinstance(indexes.for_backend(llama), BlockIndex), "slots unknown: blocks"
    vllm = backend("v", engine="vllm")
    vllm.cache_ram_mib = 0
    assert isinstance(indexes.for_backend(vllm), BlockIndex)


def test_cache_ram_mib_is_refused_for_an_engine_without_it() -> None:
    with pytest.raises(Exception, match=r"cache_ram_mib is llama\.cpp's --cache-ram"):
        settings_from_mapping({"backends": [{"name": "v", "engine": "vllm", "url": "http://v", "cache_ram_mib": 0}]})


def llama_fleet(n: int = 3, slots: int = 2) -> list[Any]:
    out = []
    for i in range(n):
        b = backend(f"llama-{i}", engine="llamacpp", slots=slots)
        b.cache_ram_mib = 0
        out.append(b)
    return out


def test_six_prefixes_on_three_two_slot_servers_get_a_slot_each_and_a_busy_one_waits_for_its_own() -> None:
    state = RoutingState()
    pipeline = build_pipeline(settings_from_mapping({"routing": {"policy": "prefix"}}).routing, state)
    fleet = llama_fleet()
    system = {g: f"group {g} shares this long system prompt with its questions. " * 40 for g in "abcdef"}
    homes: dict[str, tuple[str, int | None]] = {}
    for g in "abcdef":  # one at a time: each prefix gets its own slot
        request = chat(system[g], "first")
        chosen = pipeline.route(request, fleet).ranked[0]
        pipeline.routed(request, chosen)
        homes[g] = (chosen.name, request.engine_slot)
        pipeline.observe(Outcome(request=request, backend=chosen.name, concurrency=1, ok=True), chosen)
    assert len(set(homes.values())) == 6 and {name for name, _ in homes.values()} == {b.name for b in fleet}

    # "a" is busy on its slot; a second "a" waits for that slot instead of evicting another prefix
    by_name = {b.name: b for b in fleet}
    running = chat(system["a"], "second")
    home = by_name[homes["a"][0]]
    pipeline.routed(running, home)
    home.in_flight = 1
    again = chat(system["a"], "third")
    decision = pipeline.route(again, fleet)
    assert decision.ranked[0] is home and decision.reason == "prefix"
    pipeline.routed(again, home)
    assert again.engine_slot == homes["a"][1] and again.predicted_cached_blocks


def control_plane(settings: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/props":
            return httpx.Response(200, json={"total_slots": 2, "default_generation_settings": {"n_ctx": 8192}})
        if path == "/slots":
            return httpx.Response(200, json=[{"id": 0, "is_processing": False}, {"id": 1, "is_processing": False}])
        return httpx.Response(501)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=settings.url or "")


@pytest.mark.parametrize(("policy", "cache_ram_mib", "named"), [("prefix", 0, True), ("round-robin", 0, False),
                                                                  ("prefix", None, False)])
def test_the_request_names_the_slot_only_where_the_gateway_placed_it(policy: str, cache_ram_mib: int | None,
                                                                      named: bool) -> None:
    bodies: list[dict[str, Any]] = []

    def data_plane(request: MockRequest) -> MockResponse:
        bodies.append(orjson.loads(request.body))
        return MockResponse(body=orjson.dumps({"choices": [{"message": {"content": "ok"}}], "usage": {
            "prompt_tokens": 400, "completion_tokens": 1, "total_tokens": 401}, "timings": {"cache_n": 300}}))

    entry: dict[str, Any] = {"name": "llama", "engine": "llamacpp", "url": "http://l:1"}
    if cache_ram_mib is not None:
        entry["cache_ram_mib"] = cache_ram_mib
    registry = CollectorRegistry()
    app = create_app(settings_from_mapping({"backends": [entry], "routing": {"policy": policy}}),
                     client_factory=control_plane, transport=MockTransport(data_plane), registry=registry)

    async def scenario() -> None:
        await app.gateway.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
                for question in ("one", "two"):
                    response = await client.post("/v1/chat/completions", json={
                        "model": "m", "messages": [{"role": "system", "content": "shared " * 200},
                                                   {"role": "user", "content": question}]})
                    assert response.status_code == 200
        finally:
            await app.gateway.stop()

    asyncio.run(scenario())
    slots = [body.get("id_slot") for body in bodies]
    labels = {"backend": "llama", "index": "approximate"}
    predicted = registry.get_sample_value("gateway_prefix_predicted_cached_tokens_total", labels)
    reported = registry.get_sample_value("gateway_prefix_reported_cached_tokens_total", labels)
    if named:
        assert slots[0] is not None and slots[1] == slots[0], "the second goes back to the slot holding the prefix"
    else:
        assert slots == [None, None]
    if policy == "prefix":  # the index's prediction beside the engine's report: 0 then most of the prompt
        assert reported == 600 and predicted is not None and 200 < predicted < 400, predicted
    else:
        assert reported is None and predicted is None


def test_a_shared_prefix_counts_in_the_engines_whole_pages() -> None:
    """ExLlama reuses 256-token pages: a 300-token shared prefix is 256 cached tokens there, all of it on
    SGLang's radix tree (4 bytes a token: 128-byte blocks of 32 tokens). vLLM's block size is what its
    cache_config_info shows (16 here), else its default from 0.34 (64): 288 shared tokens are 256 there, not 288."""
    indexes = PrefixIndexes(bytes_per_token=4.0)
    blocks = prompt("g", "q", n=40)  # 40 shared blocks of 32 tokens = 1,280 tokens, then the question
    for engine, shared, expected, page in (("tabbyapi", 10, 8, None), ("tabbyapi", 7, 0, None),
                                           ("sglang", 10, 10, None), ("vllm", 9, 9, 16), ("vllm", 9, 8, None)):
        b = backend(f"{engine}-{shared}-{page}", engine=engine, cache_tokens=1_000_000, page_tokens=page)
        indexes.assign(b, blocks[:shared], "warm")
        assert indexes.match(b, blocks) == expected, (engine, shared)
