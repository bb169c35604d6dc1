"""Prefix caches in each engine's unit: unit tests of the caches, and hits/misses seen through each API."""

from __future__ import annotations

import httpx
import pytest

from gateway.sim import FleetThread, SimSpec
from gateway.sim.prefix_cache import BlockCache, RadixCache, SlotCache
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import Tokenizer
from tests.sim.conftest import ask_usage

pytestmark = pytest.mark.unit


def test_block_cache_reuses_whole_chained_blocks_only() -> None:
    cache = BlockCache(16, 16 * 100)
    a = list(range(100))
    assert cache.admit(1, a) == 0
    cache.computed(1, a)
    assert cache.admit(2, a) == 96  # 6 full blocks; the last token is always computed
    assert cache.admit(3, a[:40] + [999] * 60) == 32
    assert cache.admit(4, [7, *a[1:]]) == 0  # chained: a different first block invalidates all later ones


def test_block_cache_lru_eviction() -> None:
    cache = BlockCache(16, 16 * 4)
    a, b = list(range(33)), list(range(100, 133))
    cache.computed(1, a)
    cache.computed(2, b)  # 4 blocks: full
    cache.admit(3, a)  # touch a
    cache.computed(4, list(range(200, 233)))  # evicts the two least recently used (b's)
    assert cache.admit(5, a) == 32 and cache.admit(6, b) == 0


def test_radix_cache_is_token_granular_with_lru() -> None:
    cache = RadixCache(capacity_tokens=50)
    a = list(range(30))
    cache.computed(1, a)
    assert cache.admit(2, [*a[:17], 99, 98]) == 17
    cache.computed(3, list(range(100, 140)))  # over capacity: the oldest leaves go
    assert cache.admit(4, a) < 29
    assert cache.admit(5, list(range(100, 140))) == 39


def test_slot_cache_prefers_similar_slot_then_lru() -> None:
    slots = SlotCache(2)
    a, b = list(range(50)), list(range(100, 150))
    assert slots.admit(1, a) == 0
    slots.release(1, [*a, 7, 8])
    assert slots.admit(2, b) == 0  # dissimilar: least recently used idle slot (slot 1)
    slots.release(2, b)
    assert slots.admit(3, [*a, 1, 2]) == 50 and slots.slot_of[3] == 0
    assert slots.admit(4, a) is not None and slots.admit(5, a) is None  # both slots busy


LONG = " ".join(f"w{i}" for i in range(300))  # ~600 tokens of shared system prompt


def chat(url: str, question: str, engine: str) -> dict:  # type: ignore[type-arg]
    body = {"model": "sim-llama-2-7b", "max_tokens": 2, "stream": False, **ask_usage(engine),
            "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": question}]}
    with httpx.Client(timeout=10) as c:
        r = c.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 200
        return r.json()  # type: ignore[no-any-return]


@pytest.mark.integration
@pytest.mark.parametrize(("engine", "unit"), [("vllm", 16), ("sglang", 1), ("llamacpp", 1), ("tabbyapi", 256)])
def test_shared_prefix_hits_in_engine_units(fleet: FleetThread, engine: str, unit: int) -> None:
    server = fleet.fleet[f"sim-{engine}"]
    first = chat(server.url, "first question?", engine)
    second = chat(server.url, "another one!", engine)
    prompt_len = second["usage"]["prompt_tokens"]
    if engine == "tabbyapi":  # TabbyAPI reports no cached tokens: read the emulator's own count
        before = server.stats.cached_tokens
        chat(server.url, "a third one.", engine)
        cached = server.stats.cached_tokens - before
    else:
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt_len // 2  # a miss at first
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    tok = Tokenizer()
    p1, p2 = (tok.encode(render_chat([{"role": "system", "content": LONG}, {"role": "user", "content": q}]))
              for q in ("first question?", "another one!"))
    shared = next(i for i, (x, y) in enumerate(zip(p1, p2, strict=False)) if x != y)
    assert cached % unit == 0
    assert shared - unit < cached <= shared
    if engine == "llamacpp":
        assert second["timings"]["cache_n"] == cached


@pytest.mark.integration
def test_cached_tokens_hidden_without_cache_report() -> None:
    from gateway.sim import SimSpec

    with FleetThread([SimSpec(engine="vllm", model="sim-llama-2-7b", time_scale=50, cache_report=False)]) as ft:
        out = chat(ft.fleet.servers[0].url, "q", "vllm")
    assert "prompt_tokens_details" not in out["usage"]


def test_slot_cache_honours_a_named_slot_and_waits_while_it_is_busy() -> None:
    slots = SlotCache(2)
    a, b = list(range(50)), list(range(100, 150))
    assert slots.admit(1, a, slot=1) == 0 and slots.slot_of[1] == 1
    slots.release(1, a)
    assert slots.admit(2, b, slot=1) == 0 and slots.slot_of[2] == 1, "named: taken even though dissimilar"
    assert slots.admit(3, b, slot=1) is None, "named and busy: the request waits for it"
    assert slots.admit(4, b, slot=7) is not None and slots.slot_of[4] == 0, "out of range: any idle slot"


def test_a_request_waiting_for_its_named_slot_does_not_hold_up_the_ones_behind_it() -> None:
    import asyncio

    from gateway.sim.profiles import PROFILES
    from gateway.sim.scheduler import Scheduler, Sequence
    from gateway.sim.stats import Latencies, Stats

    class Sink:
        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: None

    async def scenario() -> list[str]:
        cache = SlotCache(2)
        sched = Scheduler(PROFILES["llamacpp"], cache, 1.0, Stats(), Latencies())
        running = Sequence(list(range(20)), ["x"] * 50, [1] * 50, "length", Sink())  # type: ignore[arg-type]
        running.slot = 0
        pinned = Sequence(list(range(20)), ["x"], [1], "length", Sink())  # type: ignore[arg-type]
        pinned.slot = 0
        free = Sequence(list(range(200, 220)), ["x"], [1], "length", Sink())  # type: ignore[arg-type]
        for seq in (running, pinned, free):
            sched.submit(seq)
        sched._admit(sched.now())
        return [running.state, pinned.state, free.state]

    assert asyncio.run(scenario()) == ["prefill", "waiting", "prefill"]


def test_a_salt_keeps_block_and_radix_caches_apart_and_slots_ignore_it() -> None:
    """vLLM mixes the salt into the first block's hash, SGLang keys a salted prompt's tree by it: a prompt cached
    under one salt is reused under that salt only. llama.cpp has no salt."""
    a = list(range(100))
    for cache in (BlockCache(16, 16 * 100), RadixCache(capacity_tokens=1000)):
        cache.computed(1, a, "tenant-a")
        assert cache.admit(2, a, salt="tenant-b") == 0
        assert cache.admit(3, a) == 0
        assert cache.admit(4, a, salt="tenant-a") in (96, 99)
        cache.computed(5, a)
        assert cache.admit(6, a) in (96, 99) and cache.admit(7, a, salt="tenant-b") == 0
    slots = SlotCache(1)
    slots.admit(1, a, salt="tenant-a")
    slots.release(1, a)
    assert slots.admit(2, a, salt="tenant-b") == 99


@pytest.mark.integration
def test_vllm_and_sglang_honour_cache_salt_as_their_servers_check_it() -> None:
    spec = [SimSpec(engine="vllm", model="m", name="v"), SimSpec(engine="sglang", model="m", name="s")]
    system = "a long shared system prompt " * 20
    with FleetThread(spec) as fleet:
        for name in ("v", "s"):
            url = fleet.fleet[name].url

            def cached(salt: object = None, url: str = url) -> int:
                body = {"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": system},
                                                                   {"role": "user", "content": "hi"}]}
                if salt is not None:
                    body["cache_salt"] = salt
                r = httpx.post(f"{url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

            assert cached("a") == 0 and cached("b") == 0 and cached() == 0
            assert cached("a") > 100 and cached("b") > 100 and cached() > 100
        url = fleet.fleet["v"].url
        for bad, message in (("", "must be a non-empty string"), (7, "must be a non-empty string"),
                             ("x" * 129, "at most 128 characters"), ("a/b", "must not contain")):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "cache_salt": bad, "messages": [
                {"role": "user", "content": "hi"}]})
            assert r.status_code == 400 and message in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "cache_salt"
