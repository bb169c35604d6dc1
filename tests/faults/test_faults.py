"""Proofs of the gateway's behaviour under faults, bounded and on loopback only.

Each test runs one scenario of :mod:`gateway.bench.faults` (``gateway bench faults`` reports the same ones)
against a fresh emulated fleet and gateway, and asserts what a user would care about: no request lost that
could have been saved, a well-formed OpenAI error event where one could not, nothing hanging, no one held
back by a slow client. Times are only bounded from above, generously, or compared within one run.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator

import pytest

from gateway.bench import faults
from gateway.bench.faults import Outcome, judge_stream
from tests.faults.fakes import GARBAGE


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    """Failures are the point here: keep the gateway's warnings about them out of the output."""
    logger = logging.getLogger("gateway")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def test_the_judge_tells_well_formed_streams_from_broken_ones() -> None:
    def kind(body: bytes) -> str:
        out = Outcome(0)
        judge_stream(body, out)
        return out.kind

    event = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    error = b'data: {"error":{"message":"m","type":"api_error","param":null,"code":"upstream_failed"}}\n\n'
    assert kind(event + b"data: [DONE]\n\n") == "complete"
    assert kind(event + error + b"data: [DONE]\n\n") == "error_event"
    assert kind(event + b'data: {"choices":[{"del\n\ndata: [DONE]\n\n') == "malformed"  # a cut JSON line
    assert kind(event + b'data: {"error":"bare string"}\n\ndata: [DONE]\n\n') == "malformed"
    assert kind(event + error) == "malformed"  # no [DONE]
    assert kind(event + b"data: [DONE]\n\ndata: [DONE]") == "malformed"  # cut mid-event


def test_killing_a_backend_while_200_streams_run() -> None:
    result = faults.kill_while_streaming(streams=200, max_tokens=120, time_scale=1.0, spread_s=1.0,
                                         kill_after_s=0.6, timeout=30.0)
    report, outcomes = result.report, result.outcomes
    kinds = collections.Counter((o.kind, o.backend) for o in outcomes)
    assert report.requests == 200
    assert report.checks["hung"] == 0, "nothing hangs"
    # the scenario did what it says: some streams were cut mid-flight, some arrived only after the kill
    assert report.checks["interrupted_mid_stream"] > 0, kinds
    # every stream due after the kill waited for it to be over (stopping a server takes a variable while)
    assert report.checks["started_after_kill"] == 80, report.checks
    # requests that had not started streaming failed over: every one completed
    not_streaming = [o for o in outcomes if not (o.kind == "error_event" and o.streamed)]
    assert all(o.kind == "complete" for o in not_streaming), report.samples
    assert report.lost == 0, report.samples
    # streams cut mid-flight were on the killed backend, and each ends with a well-formed error event + [DONE]
    cut = [o for o in outcomes if o.kind == "error_event"]
    assert {o.backend for o in cut} == {result.victim}
    assert report.error_events == len(cut) and report.error_events_well_formed == len(cut)
    assert all(o.events > 0 for o in cut), "the tokens before the failure reached the client"
    # and the streams served by the survivor were not disturbed
    assert all(o.kind == "complete" for o in outcomes if o.backend != result.victim)
    assert report.checks["in_flight_back_to_zero"], "the in-flight gauge returns to 0"


def test_a_hanging_backend_costs_at_most_the_first_byte_timeout() -> None:
    report = faults.hanging_backend(requests=6, first_byte=0.5)
    assert report.checks["hit_the_hanging_backend"] >= 2, "round-robin sent requests to the hanging backend"
    assert report.complete == 6 and report.lost == 0, report.samples  # failed over to the healthy one
    assert report.checks["within_first_byte_timeout_plus_1s"], report.checks["slowest_request_s"]
    # alone, the hanging backend gives a 504 after the first-byte timeout
    assert report.http_errors == 2
    assert report.checks["alone_within_first_byte_timeout_plus_1s"], report.checks["alone_504_within_s"]


@pytest.fixture(scope="module")
def garbage() -> tuple[faults.ScenarioReport, dict[str, list[Outcome]]]:
    logger = logging.getLogger("gateway")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # (given back after: later tests read the gateway's warnings)
    try:
        return faults.garbage_backend(per_mode=2, timeout=10.0)
    finally:
        logger.setLevel(level)


def test_a_garbage_backend_never_makes_a_client_hang(
        garbage: tuple[faults.ScenarioReport, dict[str, list[Outcome]]]) -> None:
    report, by_mode = garbage
    assert set(by_mode) == set(GARBAGE)
    assert all(o.kind not in ("hung", "client_error") for outs in by_mode.values() for o in outs), report.samples
    assert max(o.duration for outs in by_mode.values() for o in outs) < 5.0
    assert report.checks["in_flight_back_to_zero"]


@pytest.mark.parametrize("mode", GARBAGE)
def test_a_garbage_backend_gives_the_client_a_well_formed_stream_or_error(
        garbage: tuple[faults.ScenarioReport, dict[str, list[Outcome]]], mode: str) -> None:
    outcomes = garbage[1][mode]
    assert all(o.kind in ("complete", "error_event", "http_error") for o in outcomes), [
        f"{o.kind}: {o.detail}" for o in outcomes]


def test_a_flapping_backend_fails_no_request_while_another_is_healthy() -> None:
    report = faults.flapping_backend(seconds=3.0, concurrency=8, period_s=0.25)
    assert report.checks["flips"] >= 6
    assert report.requests > 100
    assert report.lost == 0 and report.complete == report.requests, report.samples
    assert report.checks["served_by_flapper"] > 0, "it was in rotation between flaps"
    assert report.checks["in_flight_back_to_zero"]


def test_a_backend_stuck_loading_is_never_routed_to() -> None:
    report = faults.loading_backend(requests=24, concurrency=8)
    assert report.checks["health_of_loading_backend"] == "loading"
    assert report.checks["generation_requests_to_loading_backend"] == 0
    assert report.complete == 24, report.samples


@pytest.mark.system
def test_a_slow_client_holds_back_no_one_and_gateway_memory_stays_bounded() -> None:
    report = faults.slow_client(slow_readers=4, normal=16, rounds=3, slow_seconds=5.0)
    c = report.checks
    assert report.lost == 0, report.samples
    assert c["slow_reader_status"] == ["HTTP/1.1 200 OK"]
    # the others are held back by no one: every round of normal streams beside the slow readers ran to its end
    # while all of them were still reading (their pace beside them, slowdown_ratio, is a figure for the report)
    assert c["normal_streams_beside_slow"] == 16 * 3, c
    assert c["slow_readers_reading_after_the_rounds"] == 4, c
    # the slow readers took little of what the backend produced; the rest did not pile up in the gateway
    assert sum(c["slow_reader_bytes_read"]) < 200_000 < 100 * c["backend_chunks_written_meanwhile"], c
    assert c["gateway_rss_growth_mb"] < 16, c
