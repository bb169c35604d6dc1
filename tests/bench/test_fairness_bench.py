"""``gateway bench fairness``'s own arithmetic: outcomes summed up, the engines' TTFT between two readings, the
targets, and the scenarios' report put together from stand-in requests and scrapes (the scenarios themselves
run as ``gateway bench fairness``, minutes long: not here)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import looptime
import pytest

from gateway.bench import fairness
from gateway.bench.fairness import Config, Outcome, engine_mean_ms, summary, targets, total

pytestmark = pytest.mark.unit

ENGINE_METRICS = """# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="fair"} 3.0
vllm:time_to_first_token_seconds_sum{model_name="fair"} 0.25
vllm:time_to_first_token_seconds_count{model_name="fair"} 4.0
"""


def test_summary_counts_outcomes_and_takes_ttft_of_completed_requests_only() -> None:
    outcomes = [Outcome("B", 0.0, status=200, ttft=0.010), Outcome("B", 0.1, status=200, ttft=0.030),
                Outcome("B", 0.2, status=429, retry_after="2"), Outcome("B", 0.3, status=429),
                Outcome("B", 0.4, status=500, error="boom"), Outcome("B", 0.5, status=200)]  # (no first token)
    s = summary(outcomes, 2.0)
    assert (s["sent"], s["completed"], s["refused_429"], s["refused_with_retry_after"], s["other_errors"]) == (
        6, 2, 2, 1, 2)
    assert s["ttft_ms_mean"] == pytest.approx(20.0) and s["ttft_ms_p50"] == pytest.approx(10.0)
    assert s["ttft_ms_p99"] == pytest.approx(30.0) and s["sent_per_s"] == 3.0
    assert summary([Outcome("B", 0.0, status=429)], 1.0)["ttft_ms_mean"] is None


def test_engine_ttft_is_the_mean_between_two_readings() -> None:
    assert total(ENGINE_METRICS, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert total(ENGINE_METRICS, "vllm:time_to_first_token_seconds_count") == 4.0
    assert engine_mean_ms((0.25, 4.0), (0.85, 14.0)) == pytest.approx(60.0)  # 0.6 s over 10 requests
    assert engine_mean_ms((0.25, 4.0), (0.25, 4.0)) is None  # nothing in between: unknown, not zero


def test_targets_are_met_or_missed_by_their_figures() -> None:
    def doc(x: float | None, b_429: int, a_429: int, a_retry: int, within: float | None, ratio: float | None,
            sheddable: int) -> dict[str, object]:
        return {"noisy": {"B_ttft_p99_over_alone_x": x, "B": {"refused_429": b_429},
                          "A": {"refused_429": a_429, "refused_with_retry_after": a_retry}},
                "priority": {"critical_admitted_within_50ms": within, "sheddable": {"completed": sheddable}},
                "weights": {"ratio": ratio}}

    met = targets(doc(1.47, 0, 10, 10, 1.0, 2.8, 5))
    assert all(t["met"] for t in met.values())
    missed = targets(doc(1.63, 1, 10, 9, 0.98, 3.4, 0))
    assert not any(t["met"] for t in missed.values())
    assert missed["noisy_A_429_with_retry_after"]["value"] == "9/10"
    assert not targets(doc(None, 0, 0, 0, None, None, 1))["noisy_A_429_with_retry_after"]["met"]  # (A never refused)


class LoopTime:
    """``time`` as the scenarios read it, from the running loop's clock: on a fake-time loop their seconds of
    load pass at once, and exactly."""

    @staticmethod
    def monotonic() -> float:
        return asyncio.get_running_loop().time()

    perf_counter = monotonic


def test_the_scenarios_report_is_put_together_from_every_scenarios_outcomes(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Any) -> None:
    """Each request and scrape stood in for (B's first token 10 ms alone and 20 ms beside the flood, the flood
    refused; W3 admitted three times as often as W1): the whole report is built, and says so."""
    flooding = False
    scrapes = itertools.count(1)

    async def one(session: Any, url: str, key: str, cfg: Config, started: float,
                  headers: dict[str, str] | None = None) -> Outcome:
        await asyncio.sleep(0.01)  # fake time: a stand-in request's length
        if key == "A":
            return Outcome(key, 0.0, status=429, retry_after="1")
        return Outcome(key, 0.0, status=200, ttft=0.020 if flooding else 0.010)

    async def scrape(session: Any, url: str) -> str:
        n = next(scrapes)
        return (f'gateway_admissions_total{{key="W3",model="fair"}} {3 * n}\n'
                f'gateway_admissions_total{{key="W1",model="fair"}} {n}\n'
                f'vllm:time_to_first_token_seconds_sum{{model_name="fair"}} {0.01 * n * n}\n'
                f'vllm:time_to_first_token_seconds_count{{model_name="fair"}} {n}\n')

    async def drain(session: Any, url: str, log: Any, limit: float = 90.0) -> float:
        return 0.0

    real_open_loop = fairness.open_loop

    async def open_loop(session: Any, url: str, key: str, *args: Any, **kwargs: Any) -> list[Outcome]:
        nonlocal flooding
        flooding = flooding or key == "A"
        try:
            return await real_open_loop(session, url, key, *args, **kwargs)
        finally:
            flooding = flooding and key != "A"

    monkeypatch.setattr(fairness, "one", one)
    monkeypatch.setattr(fairness, "scrape", scrape)
    monkeypatch.setattr(fairness, "drain", drain)
    monkeypatch.setattr(fairness, "open_loop", open_loop)
    monkeypatch.setattr(fairness, "time", LoopTime)
    cfg = Config(backends=1, slots=2, seconds=0.8, out=tmp_path)
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        doc = runner.run(fairness.scenarios("http://gateway", ["http://engine"], cfg, log=lambda *_: None))

    assert doc["capacity_per_s"] > 0
    assert doc["alone"]["B"]["completed"] > 0 and doc["noisy"]["B"]["refused_429"] == 0
    assert doc["noisy"]["A"]["refused_429"] == doc["noisy"]["A"]["refused_with_retry_after"] > 0
    assert doc["noisy"]["B_ttft_p99_over_alone_x"] == pytest.approx(2.0)
    assert doc["noisy"]["engine_ttft_mean_over_alone_x"] is not None
    assert doc["weights"]["ratio"] == pytest.approx(3.0)
    assert set(doc["timeline"]) == {"alone_B", "noisy_A", "noisy_B", "critical", "sheddable"}
    assert all(isinstance(point[0], float) for points in doc["timeline"].values() for point in points)
    assert set(targets(doc)) >= {"noisy_B_no_429", "weights_3_to_1_within_10pct"}
