"""Inter-token gaps are sorted into the histogram's buckets as they come; the metrics add them in one go."""

from __future__ import annotations

import bisect
import itertools

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.engines.registry import ENGINES
from gateway.pool.backend import Backend
from gateway.proxy.accounting import record_metrics
from gateway.proxy.exchange import Exchange
from gateway.telemetry.metrics import ITL_BUCKETS, GatewayMetrics

pytestmark = pytest.mark.unit


def itl_lines(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if line.startswith("gateway_inter_token_latency_seconds")]


def test_gaps_are_bucketed_and_summed_as_they_arrive() -> None:
    ex = Exchange(request_id="r", route="chat", t_start=0.0)
    assert ex.gap_counts is None
    ex.saw_text(2, 10.0)  # the first block: two text events, one zero gap
    assert ex.t_first_text == 10.0 and ex.gap_counts is not None and ex.gap_counts[0] == 1
    ex.saw_text(1, 10.5)
    ex.saw_text(3, 12.0)  # a gap beyond the last bound, and two zero gaps
    assert ex.gap_counts[0] == 3
    assert ex.gap_counts[bisect.bisect_left(ITL_BUCKETS, 0.5)] == 1
    assert ex.gap_counts[-1] == 1  # +Inf
    assert sum(ex.gap_counts) == 5 and ex.gap_sum == 2.0
    assert ex.text_events == 6 and ex.t_last_text == 12.0


def test_the_metrics_equal_observing_each_gap() -> None:
    backend = Backend("b", "vllm", "http://b:8000", spec=ENGINES["vllm"])
    times = [1.0, 1.001, 1.003, 1.0035, 1.0535, 1.0535, 1.2, 2.7, 2.71]
    ex = Exchange(request_id="r", route="chat", t_start=0.5, model="m", stream=True, backend=backend, status=200,
                  outcome="success", t_dispatch=0.6, t_end=3.0)
    ex.saw_text(2, times[0])
    for t in times[1:]:
        ex.saw_text(1, t)
    m = GatewayMetrics()
    record_metrics(m, ex)

    # the same histogram as prometheus_client keeps it, each gap observed
    expected = CollectorRegistry()
    itl = Histogram("gateway_inter_token_latency_seconds",
                    "Gaps between the streamed events carrying generated text, as sent to the client.",
                    ["backend", "model"], buckets=ITL_BUCKETS, registry=expected).labels("b", "m")
    itl.observe(0.0)
    for a, b in itertools.pairwise(times):
        itl.observe(b - a)
    # bucket and count lines are exact; the sum is added in one go, so it may differ in the last bit
    got, want = itl_lines(m.registry), itl_lines(expected)
    assert [line for line in got if "_sum" not in line] == [line for line in want if "_sum" not in line]
    (got_sum,), (want_sum,) = ([float(line.split()[-1]) for line in lines if "_sum" in line] for lines in (got, want))
    assert abs(got_sum - want_sum) < 1e-12
    assert any(line.endswith(f" {float(len(times))}") for line in got if "_count" in line)


def test_a_single_text_event_makes_no_inter_token_series() -> None:
    backend = Backend("b", "vllm", "http://b:8000", spec=ENGINES["vllm"])
    ex = Exchange(request_id="r", route="chat", t_start=0.5, model="m", stream=True, backend=backend, status=200,
                  outcome="success", t_end=3.0)
    ex.saw_text(1, 1.0)
    m = GatewayMetrics()
    record_metrics(m, ex)
    assert not [line for line in itl_lines(m.registry) if "{" in line]


def test_usage_figures_an_engine_reports_that_are_no_count_count_nothing() -> None:
    """A backend's usage feeds the token counters: a negative figure would take tokens off them, a huge one add
    2^27 a request, a wrong type count for something. Each is no reading, counted 0 (what a key is charged then:
    tests/proxy/test_garbage_usage.py)."""
    ex = Exchange(request_id="r", route="chat", t_start=0.0, backend=Backend("b", "vllm", "http://b",
                                                                            spec=ENGINES["vllm"]))
    ex.usage = {"prompt_tokens": -1_000_000, "completion_tokens": 10**30, "total_tokens": "7",
                "prompt_tokens_details": {"cached_tokens": -5}, "completion_tokens_details": {"reasoning_tokens": True}}
    assert (ex.usage_int("prompt_tokens"), ex.usage_int("completion_tokens"), ex.usage_int("total_tokens")) == (
        0, 0, 0)
    assert ex.reported_cached_tokens() == 0 and ex.reasoning_tokens() == 0
    registry = CollectorRegistry()
    record_metrics(GatewayMetrics(registry), ex)
    prompt = [line for line in generate_latest(registry).decode().splitlines()
              if line.startswith("gateway_prompt_tokens_total{")]
    assert prompt and all(float(line.rsplit(" ", 1)[1]) == 0 for line in prompt), prompt


def test_a_completion_figure_below_the_text_events_relayed_is_no_reading() -> None:
    """Sweep 24: an engine reporting a completion of 1 for streams of 2,000 content events was believed, and a key
    of 10,000 tokens a minute took 4.1M a minute. A stream's completion is at least half its text events (a
    reasoning parser may split one token's text in two): a figure below is no reading, the gateway's count pays."""
    from gateway.routing.request import RouteRequest

    request = RouteRequest(route="chat", model="m", stream=True, max_tokens=2000, body={})
    ex = Exchange(request_id="r", route="chat", t_start=0.0, stream=True, request=request,
                  backend=Backend("b", "vllm", "http://b", spec=ENGINES["vllm"]))
    ex.reserve, ex.body_tokens, ex.text_events = 2010, 10, 2000
    ex.usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert ex.answer_tokens() >= 2000
    ex.usage = {"prompt_tokens": 9, "completion_tokens": 1000, "total_tokens": 1009}  # (two events a token: read)
    assert ex.answer_tokens() == 1009
