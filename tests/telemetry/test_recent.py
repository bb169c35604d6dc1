"""The operator's recent view per backend (gateway.telemetry.recent): buckets in a ring, tokens spread over a
stream's span, several workers' views added up."""

from __future__ import annotations

import orjson
import pytest

from gateway.telemetry.recent import Recent, empty, merge, series, summary

pytestmark = pytest.mark.unit


def test_a_finished_request_counts_in_its_bucket_and_the_summary() -> None:
    recent = Recent(step=2.0, buckets=10, window=10.0)
    for i in range(10):
        recent.record("a", 100.0 + i * 0.1, ok=i != 3, ttft=0.010 * (i + 1), tokens=20, reason="prefix")
    recent.record("a", 101.0, ok=True, ttft=None, tokens=0, reason="least-load")  # (not a stream)
    view = recent.raw(101.5)
    cols = view["backends"]["a"]
    s = summary(cols, view["step"], view["window"])
    assert s["requests"] == 11 and s["errors"] == 1
    assert s["ttft_p50_ms"] == 50.0 and s["ttft_p95_ms"] == 100.0
    assert s["tokens_per_second"] == round(200 / 10.0, 2)  # 200 tokens over the 5-bucket (10 s) window
    assert s["decisions"] == {"prefix": 10, "least-load": 1}
    line = series(cols, view["step"])
    assert line["requests"][-1] == 11 and line["requests"][:-1] == [0] * 9
    assert line["ttft_ms"][-1] == 55.0 and line["ttft_ms"][0] is None
    assert line["tokens_per_second"][-1] == 100.0


def test_a_streams_tokens_are_spread_over_the_buckets_it_spanned() -> None:
    recent = Recent(step=1.0, buckets=10)
    recent.record("a", 54.5, ok=True, ttft=0.1, tokens=400, first=50.0, last=54.0)
    tokens = recent.raw(54.5)["backends"]["a"]["tokens"]
    assert tokens[-6:] == [0.0, 100.0, 100.0, 100.0, 100.0, 0.0]  # buckets 50..53 (54 is past its last token)
    assert sum(tokens) == 400


def test_old_buckets_are_emptied_when_the_ring_comes_round() -> None:
    recent = Recent(step=1.0, buckets=4, window=4.0)
    recent.record("a", 10.2, ok=True, ttft=0.5, tokens=5, reason="prefix")
    recent.record("a", 14.2, ok=True, ttft=0.1, tokens=1, reason="least-load")  # (same ring slot as 10)
    cols = recent.raw(14.5)["backends"]["a"]
    assert cols["requests"] == [0.0, 0.0, 0.0, 1.0]
    assert cols["ttft_samples"] == [0.1] and cols["decisions"] == {"least-load": 1}
    # nothing recorded for a while: the view is empty, not stale
    later = recent.raw(30.0)["backends"]["a"]
    assert later["requests"] == [0.0] * 4 and later["ttft_samples"] == []


def test_ttft_samples_are_bounded_per_bucket() -> None:
    recent = Recent(step=10.0, buckets=3, samples=8)
    for i in range(1000):
        recent.record("a", 5.0, ok=True, ttft=i / 1000, tokens=1)
    cols = recent.raw(5.0)["backends"]["a"]
    assert len(cols["ttft_samples"]) == 8 and cols["ttft_n"][-1] == 1000
    assert round(cols["ttft_sum"][-1], 6) == round(sum(i / 1000 for i in range(1000)), 6)


def test_the_sampler_keeps_the_most_in_flight_and_queued_per_bucket() -> None:
    recent = Recent(step=2.0, buckets=3)
    recent.sample(10.0, {"a": 3, "b": 0}, 1)
    recent.sample(11.0, {"a": 7, "b": 2}, 0)
    recent.sample(12.5, {"a": 1, "b": 0}, 4)
    view = recent.raw(12.5)
    assert view["backends"]["a"]["in_flight"] == [0.0, 7.0, 1.0]
    assert view["backends"]["b"]["in_flight"] == [0.0, 2.0, 0.0]
    assert view["queued"] == [0.0, 1.0, 4.0]
    recent.forget("b")
    assert set(recent.raw(12.5)["backends"]) == {"a"}


def test_workers_views_add_up_aligned_on_their_buckets() -> None:
    one, two = Recent(step=1.0, buckets=5), Recent(step=1.0, buckets=5)
    one.record("a", 9.5, ok=True, ttft=0.2, tokens=10, reason="prefix")
    two.record("a", 9.5, ok=False, ttft=0.4, tokens=30, reason="prefix")
    two.record("b", 8.5, ok=True, ttft=None, tokens=3)
    # the second worker answered a moment later, in the next bucket: the first one's buckets shift by one
    views = [orjson.loads(orjson.dumps(one.raw(9.9))), orjson.loads(orjson.dumps(two.raw(10.1)))]
    merged = merge(views)
    assert merged["end"] == 10
    assert merged["backends"]["a"]["requests"] == [0.0, 0.0, 0.0, 2.0, 0.0]
    assert merged["backends"]["a"]["errors"][-2] == 1.0 and merged["backends"]["a"]["tokens"][-2] == 40.0
    assert sorted(merged["backends"]["a"]["ttft_samples"]) == [0.2, 0.4]
    assert merged["backends"]["a"]["decisions"] == {"prefix": 2}
    assert merged["backends"]["b"]["tokens"] == [0.0, 0.0, 3.0, 0.0, 0.0]


def test_a_backend_without_requests_summarises_as_nothing() -> None:
    s = summary(empty(30), 2.0, 30)
    assert s == {"window_seconds": 60.0, "requests": 0, "errors": 0, "ttft_p50_ms": None, "ttft_p95_ms": None,
                 "tokens_per_second": 0.0, "decisions": {}}
