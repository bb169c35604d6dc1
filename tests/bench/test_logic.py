"""The tool's own logic: percentiles, workloads, Zipf, interleaving, SSE parsing, report shape, py-spy parsing."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import numpy as np
import pytest

from gateway.bench.client import RequestResult, SSEEvents, Target, apply_usage, has_content, parse_target
from gateway.bench.profile import default_levels, level_figures
from gateway.bench.pyspy import parse_collapsed, top_areas, top_frames
from gateway.bench.report import SCHEMA, build_report
from gateway.bench.runner import Phase, RunResult, interleave_order, poisson_offsets, split_rounds
from gateway.bench.stats import percentile, ratio, summarize
from gateway.bench.workload import WorkloadConfig, build_workload, zipf_weights
from gateway.sim.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


# --- stats ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [random.Random(q).uniform(0, 100) for _ in range(37)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_ignores_nan_and_ratio_guards() -> None:
    s = summarize([1.0, math.nan, 3.0])
    assert s["count"] == 2 and s["mean"] == 2.0 and s["min"] == 1.0 and s["max"] == 3.0 and s["p50"] == 2.0
    assert math.isnan(summarize([])["p99"])
    assert ratio(2.0, 4.0) == 0.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


# --- workloads -----------------------------------------------------------------------------------------
def test_shared_prefix_uniform_sends_every_pair_once_with_exact_lengths() -> None:
    cfg = WorkloadConfig(groups=3, prompts_per_group=4, system_len=50, question_len=10, output_len=7)
    reqs = build_workload(cfg)
    assert len(reqs) == 12
    pairs = Counter((r.group, r.tags["question"]) for r in reqs)
    assert len(pairs) == 12 and set(pairs.values()) == {1}
    by_group: dict[int | None, set[str]] = {}
    for r in reqs:
        by_group.setdefault(r.group, set()).add(r.body["messages"][0]["content"])
        assert r.body["max_tokens"] == 7
    assert all(len(s) == 1 for s in by_group.values())  # one system prompt per group ...
    assert len({next(iter(s)) for s in by_group.values()}) == 3  # ... different across groups
    tok = Tokenizer()
    question = reqs[0].body["messages"][1]["content"]
    assert len(tok.encode(question, add_bos=False)) == 10  # one emulator token per word
    system = reqs[0].body["messages"][0]["content"]
    assert len(tok.encode(system.split(".", 1)[1], add_bos=False)) == 50


def test_workload_is_deterministic_and_seed_dependent() -> None:
    a = build_workload(WorkloadConfig(kind="random", count=20, seed=1))
    b = build_workload(WorkloadConfig(kind="random", count=20, seed=1))
    c = build_workload(WorkloadConfig(kind="random", count=20, seed=2))
    assert [r.body for r in a] == [r.body for r in b]
    assert [r.body for r in a] != [r.body for r in c]


def test_zipf_popularity_favours_low_ranks() -> None:
    weights = zipf_weights(8, 1.1)
    assert sum(weights) == pytest.approx(1.0)
    assert all(x > y for x, y in itertools.pairwise(weights))
    reqs = build_workload(WorkloadConfig(groups=8, prompts_per_group=4, popularity="zipf", count=4000,
                                         system_len=4, question_len=2))
    counts = Counter(r.group for r in reqs)
    assert counts[0] / 4000 == pytest.approx(weights[0], abs=0.03)
    assert counts[0] > counts[1] > counts[3] > counts[7]


def test_multi_turn_history_grows_and_turns_are_ordered() -> None:
    reqs = build_workload(WorkloadConfig(kind="multi-turn", conversations=3, turns=4, question_len=5, output_len=6))
    assert len(reqs) == 12
    assert [r.turn for r in reqs] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    conv0 = [r for r in reqs if r.conversation == 0]
    for turn, r in enumerate(conv0):
        msgs = r.body["messages"]
        assert len(msgs) == 2 + 2 * turn  # system + (user, assistant) per earlier turn + this user message
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * turn + ["user"]
        if turn:
            assert msgs[:-2] == conv0[turn - 1].body["messages"]  # the earlier request is a prefix


def test_random_lengths_within_bounds() -> None:
    reqs = build_workload(WorkloadConfig(kind="random", count=200, input_min=5, input_max=9, output_min=2,
                                         output_max=4))
    assert {r.output_len for r in reqs} == {2, 3, 4}
    assert all(5 <= r.prompt_words <= 9 for r in reqs)
    assert all(len(r.body["messages"][0]["content"].split()) == r.prompt_words for r in reqs)


def test_structured_mix() -> None:
    reqs = build_workload(WorkloadConfig(kind="random", count=400, structured_fraction=0.25))
    structured = [r for r in reqs if r.structured]
    assert 60 < len(structured) < 140
    assert all(r.body["response_format"]["type"] == "json_schema" for r in structured)
    assert all("response_format" not in r.body for r in reqs if not r.structured)
    none = build_workload(WorkloadConfig(kind="random", count=50))
    assert not any(r.structured for r in none)


def test_bad_workload_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(kind="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        WorkloadConfig(structured_fraction=1.5)
    with pytest.raises(ValueError):
        WorkloadConfig(kind="random", input_min=10, input_max=5)


# --- arrival and interleaving ----------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_interleave_order_balances_places_and_predecessors(n: int) -> None:
    rows = 2 * n if n % 2 else n
    order = interleave_order(n, 2 * rows)
    assert all(sorted(o) == list(range(n)) for o in order)
    assert order[rows:] == order[:rows], "the square repeats"
    for place in range(n):  # every target in every place equally often
        assert Counter(o[place] for o in order[:rows]) == dict.fromkeys(range(n), rows // n)
    follows = Counter((o[i - 1], o[i]) for o in order[:rows] for i in range(1, n))
    if n > 1:  # and after every other target equally often: not always the same one, as a rotation would
        assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert len(set(follows.values())) == 1
    assert interleave_order(4, 3)[:2] == [[0, 1, 3, 2], [1, 2, 0, 3]]


def test_split_rounds() -> None:
    assert split_rounds(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    with pytest.raises(ValueError):
        split_rounds(3, 0)


def test_poisson_offsets_have_the_requested_rate() -> None:
    offsets = poisson_offsets(5000, rate=20.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert (len(offsets) - 1) / offsets[-1] == pytest.approx(20.0, rel=0.06)
    assert poisson_offsets(10, 5.0, seed=1) == poisson_offsets(10, 5.0, seed=1)


# --- SSE parsing at the client --------------------------------------------------------------------------
def test_sse_events_split_across_reads_and_crlf() -> None:
    ev = SSEEvents()
    assert ev.feed(b'data: {"a":1}\n\ndata: {"b"') == [b'{"a":1}']
    assert ev.feed(b':2}\r\n\r\n: ping\r\n\r\ndata: [DONE]\n\n') == [b'{"b":2}', b"[DONE]"]


def test_has_content_and_usage() -> None:
    assert has_content({"choices": [{"delta": {"content": "x"}}]})
    assert has_content({"choices": [{"text": "x"}]})
    assert not has_content({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert not has_content({"choices": [], "usage": {}})
    r = RequestResult(index=0, target="t")
    apply_usage(r, {"completion_tokens": 5, "prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}})
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (5, 9, 4)


def test_parse_target() -> None:
    t = parse_target("gw=http://h:8000/v1")
    assert t.name == "gw" and t.base == "http://h:8000"
    assert parse_target("http://h:9/").name == "h:9"
    with pytest.raises(ValueError):
        parse_target("gw=h:8000")


# --- report ----------------------------------------------------------------------------------------------
def _result(target: str, i: int, ttft: float, ok: bool = True, backend: str | None = None) -> RequestResult:
    return RequestResult(index=i, target=target, ok=ok, status=200 if ok else 502, ttft=ttft, ttfb=ttft / 2,
                         e2e=ttft + 0.1, itl=[0.01, 0.01], chunks=3, output_tokens=3, prompt_tokens=10,
                         cached_tokens=4, backend=backend, error=None if ok else "HTTP 502: x")


def test_report_shape_counts_and_ratios() -> None:
    run = RunResult(targets=[Target("a", "http://a", pid=None), Target("b", "http://b")])
    run.results["a"] = [_result("a", i, 0.010) for i in range(10)]
    run.results["b"] = [_result("b", i, 0.030, backend="x" if i % 2 else "y") for i in range(9)]
    run.results["b"].append(_result("b", 9, 0.030, ok=False))
    run.phases += [Phase("a", 0, 1.0, 10, 30, 0.5), Phase("b", 0, 2.0, 10, 30, None)]
    doc = build_report(run, {"k": 1})
    assert doc["schema"] == SCHEMA and doc["config"] == {"k": 1}
    a, b = doc["targets"]["a"], doc["targets"]["b"]
    assert (a["requests"], a["ok"], a["errors"]) == (10, 10, 0)
    assert (b["requests"], b["ok"], b["errors"]) == (10, 9, 1) and b["error_samples"] == ["HTTP 502: x"]
    assert b["backends"] == {"x": 4, "y": 5}
    assert a["cpu_ms_per_request"] == pytest.approx(50.0) and b["cpu_s"] is None
    assert a["cache_hit_ratio"] == pytest.approx(0.4)
    assert a["metrics"]["ttft_s"]["p50"] == pytest.approx(0.010)
    assert doc["ratios"]["b"]["ttft_s.p50"] == pytest.approx(3.0)
    assert doc["ratios"]["b"]["added_ttft_ms.p50"] == pytest.approx(20.0)
    assert "a" not in doc["ratios"]
    assert len(doc["requests"]["b"]) == 10 and doc["requests"]["b"][9]["ok"] is False
    assert "requests" not in build_report(run, {}, include_requests=False)


# --- profile and py-spy parsing ---------------------------------------------------------------------------
def test_default_levels() -> None:
    assert default_levels(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_levels(48) == [1, 2, 4, 8, 16, 32, 48]


def test_level_figures_undo_time_scale() -> None:
    results = [RequestResult(index=i, target="t", ok=True, ttft=0.01, e2e=0.11, output_tokens=11, prompt_tokens=100)
               for i in range(4)]
    fig = level_figures(results, wall=0.2, concurrency=4, time_scale=10.0)
    assert fig["per_user_decode_tok_s"] == pytest.approx(10.0)  # 10 tokens / 0.1 s / 10
    assert fig["aggregate_tok_s"] == pytest.approx(44 / 0.2 / 10)
    assert fig["ttft_p50_s"] == pytest.approx(0.1)
    assert fig["prefill_tok_s"] == pytest.approx(100 / 0.01 / 10)
    assert fig["requests"] == 4 and fig["errors"] == 0


def test_collapsed_stacks_are_ranked() -> None:
    text = ("main (app.py:1);loop (x.py:5);send (proxy.py:10) 30\n"
            "main (app.py:1);loop (x.py:5);send (proxy.py:12) 10\n"
            "main (app.py:1);loop (x.py:6) 60\n")
    self_c, total_c, n = parse_collapsed(text)
    assert n == 100 and self_c["send (proxy.py)"] == 40 and self_c["loop (x.py)"] == 60
    assert total_c["main (app.py)"] == 100
    top = top_frames(text, 2)
    assert [f.frame for f in top] == ["loop (x.py)", "send (proxy.py)"]
    assert top[1].self_share == pytest.approx(0.4)


def test_self_time_is_added_up_by_package() -> None:
    text = ("run (/v/lib/python3.12/site-packages/redis/asyncio/client.py:9);"
            "parse (/v/lib/python3.12/site-packages/redis/_parsers/resp.py:3) 30\n"
            "run (/v/lib/python3.12/site-packages/redis/asyncio/client.py:9) 20\n"
            "admit (/repo/gateway/state/shared.py:300) 10\n"
            "keep (/repo/gateway/state/shared.py:400) 15\n"
            "select (/usr/lib/python3.12/asyncio/base_events.py:1) 20\n"
            "<idle> 5\n")
    areas = {area: (k, share) for area, k, share in top_areas(text)}
    assert areas["redis/_parsers"][0] == 30 and areas["redis/asyncio"][0] == 20
    assert areas["gateway/state"] == (25, pytest.approx(0.25))
    assert areas["stdlib/asyncio"][0] == 20 and areas["<idle>"][0] == 5
    assert [a for a, _, _ in top_areas(text, 1)] == ["redis/_parsers"]
