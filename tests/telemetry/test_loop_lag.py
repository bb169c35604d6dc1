"""The event loop's lag: a stall of the loop shows as an observation of about its length."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry.loop_lag import LoopLag
from tests.waiting import until


@pytest.mark.anyio
async def test_a_stall_of_the_loop_is_observed_as_lag() -> None:
    lag = LoopLag(interval=0.01)
    registry = CollectorRegistry()
    registry.register(lag)
    lag.start()
    await until(lambda: lag.buckets.count >= 3, "three wake-ups observed")
    before = lag.buckets.count
    # real time: the stall observed (holds the loop on purpose, as a long parse would)
    time.sleep(0.12)  # noqa: ASYNC251
    await until(lambda: lag.buckets.count > before, "the wake-up due during the block observed")
    await lag.stop()
    assert before >= 3 and lag.buckets.count > before
    bounds = (*lag.buckets.bounds, float("inf"))
    stalled = sum(n for bound, n in zip(bounds, lag.buckets.counts, strict=True) if bound > 0.1)
    assert stalled >= 1, lag.buckets.counts  # the wake-up due during the block came about 0.11 s late
    assert lag.buckets.sum >= 0.1
    assert lag.worst(5.0) >= 0.1, "the worst lag of the last seconds (taken off the stall guard's readings)"
    text = generate_latest(registry).decode()
    assert 'gateway_event_loop_lag_seconds_bucket{le="0.25"}' in text
    count = lag.buckets.count
    await asyncio.sleep(0.05)  # real time: five intervals, in which a sampler still running would wake
    assert lag.buckets.count == count, "stopped"
