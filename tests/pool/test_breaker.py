"""The circuit breaker's state machine, on a controlled clock."""

from __future__ import annotations

import pytest

from gateway.config import BreakerSettings
from gateway.pool.breaker import Breaker, BreakerState

pytestmark = pytest.mark.unit


def breaker(**kw: float) -> Breaker:
    return Breaker(BreakerSettings(**{"consecutive_failures": 3, "min_requests": 10, "cooldown_seconds": 5.0,
                                      "max_cooldown_seconds": 12.0, **kw}))  # type: ignore[arg-type]


def test_consecutive_failures_open_and_a_successful_probe_closes() -> None:
    b = breaker()
    for t in range(2):
        b.record(False, now=t)
    assert b.state is BreakerState.CLOSED and b.available(now=2)
    b.record(False, now=2)
    assert b.state is BreakerState.OPEN and not b.available(now=3) and b.trips == 1
    assert b.available(now=7.1), "after the cooldown one probe may go"
    b.begin(now=7.1)
    assert b.state is BreakerState.HALF_OPEN and not b.available(now=7.2), "only one probe at a time"
    b.record(True, now=7.5)
    assert b.state is BreakerState.CLOSED and b.available(now=7.6)


def test_a_failed_probe_reopens_with_a_longer_cooldown_up_to_the_cap() -> None:
    b = breaker()
    for t in range(3):
        b.record(False, now=t)
    b.begin(now=8)
    b.record(False, now=8)
    assert b.state is BreakerState.OPEN and not b.available(now=17.9) and b.available(now=18.1)  # 10 s
    b.begin(now=18.1)
    b.record(False, now=18.1)
    assert not b.available(now=30.0) and b.available(now=30.2)  # capped at 12 s


def test_failure_ratio_over_the_window() -> None:
    b = breaker(consecutive_failures=100, failure_ratio=0.5, window_seconds=10)
    for i in range(10):
        b.record(i % 2 == 0, now=i * 0.5)  # 50% failing, never 3 in a row
    assert b.state is BreakerState.OPEN
    b2 = breaker(consecutive_failures=100, failure_ratio=0.5, window_seconds=10)
    for i in range(10):
        b2.record(i % 3 != 0, now=i * 0.5)  # 40% failing
    assert b2.state is BreakerState.CLOSED


def test_a_probe_whose_client_left_frees_the_next_probe() -> None:
    b = breaker()
    for t in range(3):
        b.record(False, now=t)
    b.begin(now=8)
    b.release()
    assert b.available(now=8.1)


def test_an_answered_5xx_counts_when_another_key_met_one_or_nothing_else_was_answered() -> None:
    """Sweep 13: one key's requests that an engine answers 500 (llama.cpp's JSON answer cut short) ejected a
    model's backends for everyone where nothing compared them (``retries.max_attempts: 1``), or where another
    engine served them. An answered 5xx now counts when another key met one within a minute, with auth off
    (no keys to tell apart), or after twice ``consecutive_failures`` of them with no success between."""
    from gateway.pool.breaker import CORROBORATION_SECONDS

    b = breaker()
    assert not b.corroborated("attacker", now=0) and not b.corroborated("attacker", now=1)  # one key alone
    b.record(True, now=2)  # (another key's request served between)
    assert not b.corroborated("attacker", now=3)
    assert b.corroborated("victim", now=4)  # a second key met one: the backend's doing, likely
    assert not b.corroborated("victim", now=5)  # (the same key again: alone once more)
    assert not b.corroborated("attacker", now=6 + CORROBORATION_SECONDS)  # (the other's was too long ago)
    assert b.corroborated(None, now=100)  # auth off: every answered 5xx counts, as before
    single = breaker()
    seen = [single.corroborated("only", now=t) for t in range(6)]  # one key, nothing but 5xx: a broken engine
    assert seen == [False] * 5 + [True]
