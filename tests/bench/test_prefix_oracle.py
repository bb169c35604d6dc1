"""The oracle hit rate of the prefix benchmarks: its cache models follow the engines', it finds what a good
placement finds, it never passes the unlimited-cache bound, and the reports carry it beside each policy."""

from __future__ import annotations

import random

import pytest

from gateway.bench.client import RequestResult, Target
from gateway.bench.report import build_report
from gateway.bench.routing import PrefixConfig, kv_capacity_for, prefix_workload, summarize_prefix
from gateway.bench.routing.oracle import (
    BlockLRU,
    Future,
    LlamaSlots,
    bound_cached_tokens,
    common_prefix,
    families,
    llamacpp_oracle,
    vllm_emulator_oracle,
)
from gateway.bench.routing.prefix import emulated_oracle
from gateway.bench.runner import Phase, RunResult
from gateway.bench.workload import build_workload
from gateway.sim.prefix_cache import BlockCache

pytestmark = pytest.mark.unit


def shared_prefix(groups: int, per_group: int, system: int, question: int, seed: int = 0) -> list[list[int]]:
    """Token prompts: ``groups`` system prefixes (all starting with the same 5-token header), shuffled."""
    rng = random.Random(seed)
    header = [1, 2, 3, 4, 5]
    systems = [header + [rng.randrange(100, 30_000) for _ in range(system)] for _ in range(groups)]
    prompts = [s + [rng.randrange(100, 30_000) for _ in range(question)] for s in systems for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix([], [1]) == 0
    a = list(range(1000))
    assert common_prefix(a, [*a[:777], -1]) == 777


def test_block_model_serves_what_the_emulated_vllm_cache_serves() -> None:
    # one backend, requests one at a time: the oracle's model and the emulator's own cache agree on every hit
    prompts = shared_prefix(groups=6, per_group=5, system=120, question=20)
    future = Future(prompts, [17] * len(prompts))
    mine, theirs = BlockLRU(600, 16), BlockCache(16, 600)
    hits = []
    for t, prompt in enumerate(prompts):
        expected = theirs.admit(t, prompt)
        assert mine.hit(t, future) == expected
        assert mine.place(t, future) == expected
        theirs.computed(t, prompt)
        theirs.release(t, list(future.content(t)))
        hits.append(expected)
    assert 0 < sum(hits) < sum(len(p) for p in prompts)  # some reuse, some eviction: the case is not trivial


def test_llama_slots_take_the_most_similar_idle_slot_else_the_least_recently_used() -> None:
    a1, a2 = [1, *range(10, 60)], [1, *range(10, 50), *range(70, 80)]  # share 41 of 51 tokens
    b1, c1 = [1, *range(100, 150)], [1, *range(200, 250)]
    future = Future([a1, b1, a2, c1, a1], [3] * 5)
    slots = LlamaSlots(2)
    assert slots.place(0, future) == 0 and slots.place(1, future) == 0
    # both were empty, equally old: llama.cpp's "<=" takes the last one first
    a_slot, b_slot = 1, 0
    assert slots.tokens[a_slot][:51] == tuple(a1) and slots.tokens[b_slot][:51] == tuple(b1)
    # a2 picks a1's slot by similarity (41/51 > 0.1) though b1's is more recent; the common prefix is cached
    assert slots.hit(2, future) == 41 and slots.place(2, future) == 41
    assert slots.tokens[a_slot][:51] == tuple(a2)
    # c1 shares only the BOS token with either (1/51 < 0.1): the least recently used slot (b1's) is taken
    slots.place(3, future)
    assert slots.tokens[b_slot][:51] == tuple(c1)
    # a whole prompt in a slot: one token is still evaluated
    slots.tokens[a_slot] = tuple(a1)
    assert slots.hit(4, future) == len(a1) - 1


def test_families_are_the_shared_system_prompts() -> None:
    prompts = [tuple(p) for p in shared_prefix(groups=4, per_group=3, system=100, question=10)]
    family, shared = families(prompts)
    by_system = {p[:105]: family[i] for i, p in enumerate(prompts)}
    assert len(by_system) == 4 and len(set(family)) == 4  # one family per system prompt, no more
    assert all(family[i] == by_system[p[:105]] for i, p in enumerate(prompts))
    assert all(105 <= n < 115 for n in shared.values())


def test_oracle_reaches_the_bound_when_the_caches_hold_every_prefix() -> None:
    prompts = shared_prefix(groups=8, per_group=6, system=300, question=16)
    result = vllm_emulator_oracle(prompts, [8] * len(prompts), backends=4, capacity_tokens=1000)
    bound = bound_cached_tokens([tuple(p) for p in prompts], 16)
    # every request after its group's first reuses the whole system prompt, in whole blocks
    assert bound == 8 * 5 * (305 // 16 * 16)
    assert result.cached_tokens == bound and result.hit_rate == result.bound_hit_rate
    assert sum(result.requests_per_backend) == len(prompts)


def test_oracle_beats_round_robin_and_stays_under_the_bound_when_caches_are_short() -> None:
    prompts = shared_prefix(groups=12, per_group=6, system=300, question=16, seed=3)
    outputs = [8] * len(prompts)
    result = vllm_emulator_oracle(prompts, outputs, backends=3, capacity_tokens=1000)  # ~9 of 12 prefixes fit
    future = Future(prompts, outputs)
    caches = [BlockLRU(1000) for _ in range(3)]
    round_robin = sum(caches[t % 3].place(t, future) for t in range(len(prompts)))
    assert result.cached_tokens > 1.5 * round_robin
    assert result.hit_rate is not None and result.bound_hit_rate is not None
    assert result.hit_rate < result.bound_hit_rate
    assert result.hit_rate == max(r for r in result.hit_rates.values() if r is not None)


def test_llamacpp_oracle_keeps_one_family_per_slot() -> None:
    # 6 system prompts, 3 servers x 2 slots: every request after its family's first finds it in a slot
    prompts = shared_prefix(groups=6, per_group=8, system=400, question=12, seed=1)
    result = llamacpp_oracle(prompts, [8] * len(prompts), servers=3, slots=2)
    whole_prefixes = 6 * 7 * 405
    # the bound also counts the 5-token header a family's first request shares with other families
    assert whole_prefixes <= result.cached_tokens <= bound_cached_tokens([tuple(p) for p in prompts])
    # one slot fewer than families: some must miss again
    short = llamacpp_oracle(prompts, [8] * len(prompts), servers=5, slots=1)
    assert short.cached_tokens < whole_prefixes


def test_emulated_oracle_counts_the_emulators_prompt_tokens() -> None:
    cfg = PrefixConfig(backends=2, groups=3, prompts_per_group=4, system_len=200, question_len=8, output_len=4,
                       cache_share=1.0)
    requests = build_workload(prefix_workload(cfg))
    prompts = _emulator_prompts(requests)
    result = emulated_oracle(requests, cfg)
    assert result.prompt_tokens == sum(len(p) for p in prompts)
    assert result.model.endswith(f"{kv_capacity_for(3, 200, 1.0, 8, 4) // 16} blocks of 16")
    # each backend holds every prefix: all but the first of each group reuse it, less at most the one-block
    # header the bound also counts for a group's first request
    bound = bound_cached_tokens([tuple(p) for p in prompts], 16)
    assert bound - 3 * 16 <= result.cached_tokens <= bound


def _emulator_prompts(requests: list) -> list[list[int]]:  # type: ignore[type-arg]
    from gateway.sim.template import render_chat
    from gateway.sim.tokenizer import Tokenizer

    tok = Tokenizer()
    return [tok.encode(render_chat(r.body["messages"])) for r in requests]


def test_each_policy_is_reported_as_a_share_of_the_oracle() -> None:
    def results(name: str, cached: int) -> list[RequestResult]:
        return [RequestResult(index=i, target=name, ok=True, status=200, ttft=0.1, e2e=0.5, chunks=4,
                              output_tokens=4, prompt_tokens=1000, cached_tokens=cached, backend="b0")
                for i in range(4)]

    per = {"round-robin": results("round-robin", 200), "prefix": results("prefix", 800)}
    run = RunResult(targets=[Target(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(per)], results=per)
    run.phases = [Phase(n, 0, 1.0, 4, 16) for n in per]
    prompts = shared_prefix(groups=1, per_group=4, system=300, question=10)
    best = vllm_emulator_oracle(prompts, [4] * 4, backends=2, capacity_tokens=2000)
    out = summarize_prefix(build_report(run, {}, include_requests=False), oracle=best)
    assert best.hit_rate is not None
    assert out["oracle"]["hit_rate"] == best.hit_rate and out["oracle"]["definition"]
    for name, rate in (("round-robin", 0.2), ("prefix", 0.8)):
        assert out["policies"][name]["oracle_hit_rate"] == best.hit_rate
        assert out["policies"][name]["hit_rate_of_oracle"] == pytest.approx(rate / best.hit_rate)
