"""The event loop's lag: a stall of the loop shows as an observation of about its length."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.telemetry.loop_lag import LoopLag


@pytest.mark.anyio
async def test_a_stall_of_the_loop_is_observed_as_lag() -> None:
    lag = LoopLag(interval=0.01)
    registry = CollectorRegistry()
    registry.register(lag)
    lag.start()
    await asyncio.sleep(0.1)
    before = lag.buckets.count
    time.sleep(0.12)  # noqa: ASYNC251  (holds the loop on purpose, as a long parse would)
    await asyncio.sleep(0.05)
    await lag.stop()
    assert before >= 3 and lag.buckets.count > before
    bounds = (*lag.buckets.bounds, float("inf"))
    stalled = sum(n for bound, n in zip(bounds, lag.buckets.counts, strict=True) if bound > 0.1)
    assert stalled >= 1, lag.buckets.counts  # the wake-up due during the block came about 0.11 s late
    assert lag.buckets.sum >= 0.1
    text = generate_latest(registry).decode()
    assert 'gateway_event_loop_lag_seconds_bucket{le="0.25"}' in text
    count = lag.buckets.count
    await asyncio.sleep(0.05)
    assert lag.buckets.count == count, "stopped"
