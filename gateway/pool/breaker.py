"""Outlier ejection per backend: a circuit breaker fed by the outcome of every proxied request.

closed -> open: ``consecutive_failures`` failures in a row, or a failure ratio of at least ``failure_ratio``
over the last ``window_seconds`` once ``min_requests`` were seen. open -> half-open: after the cooldown, one
real request is let through as a probe. Its success closes the breaker; its failure opens it again with
the cooldown doubled (up to ``max_cooldown_seconds``). A health check passing does not close an open
breaker: an engine can answer ``/health`` and still fail every request.

Failures are what the backend did wrong: refused or dropped connections, timeouts, 5xx answers and broken
streams. Client errors (4xx) and 429 back-pressure are not. A 5xx the backend *answered* may be the request's
doing (llama.cpp answers 500 to a JSON-constrained answer cut short by ``max_tokens``): it counts when requests
of two different API keys met one within ``CORROBORATION_SECONDS`` (:meth:`Breaker.corroborated`), so one key's
requests alone never eject a backend for everyone (sweep 13: a key's crafted requests did, on a model of two
backends with ``retries.max_attempts: 1``, and in a mixed fleet where another engine served them).
"""

from __future__ import annotations

import enum
from collections import deque

from gateway.clock import SYSTEM, Clock
from gateway.config import BreakerSettings

CORROBORATION_SECONDS = 60.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    __slots__ = ("_clock", "_consecutive", "_cooldown", "_error_at", "_error_owner", "_errors_in_a_row", "_failures",
                 "_open_until", "_probing", "_seconds", "_total", "settings", "state", "trips")

    def __init__(self, settings: BreakerSettings, clock: Clock = SYSTEM) -> None:
        self.settings = settings
        self._clock = clock
        self.state = BreakerState.CLOSED
        # outcomes counted per second over the window: O(1) per request and bounded memory at any rate
        self._seconds: deque[list[int]] = deque()  # [second, requests, failures]
        self._total = 0
        self._failures = 0
        self._consecutive = 0
        self._cooldown = settings.cooldown_seconds
        self._open_until = 0.0
        self._probing = False
        self._error_owner: str | None = None  # whose request last met a 5xx the backend answered, and when
        self._error_at = 0.0
        self._errors_in_a_row = 0  # answered 5xx since the last success
        self.trips = 0

    def available(self, now: float | None = None) -> bool:
        """May a request be routed here? (No side effects: routing asks this of every candidate.)"""
        if self.state is BreakerState.CLOSED:
            return True
        now = self._clock.monotonic() if now is None else now
        if self.state is BreakerState.OPEN:
            return now >= self._open_until
        return not self._probing

    @property
    def probing(self) -> bool:
        """A half-open probe is out (no other request is routed here until it is settled)."""
        return self._probing

    def begin(self, now: float | None = None) -> None:
        """A request is being sent: after the cooldown, it is the half-open probe."""
        if self.state is BreakerState.OPEN and (self._clock.monotonic() if now is None else now) >= self._open_until:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN:
            self._probing = True

    def corroborated(self, owner: str | None, now: float | None = None) -> bool:
        """A 5xx the backend answered ``owner``'s request (an API key's name; None: requests are not told apart,
        as with auth off): whether it counts as a failure, that is whether another key's request met one within
        ``CORROBORATION_SECONDS``, or the backend answered nothing else for twice ``consecutive_failures``
        requests in a row (a deployment of one key still sees a broken engine ejected; an attacker's requests
        among others' that succeed never add up). Remembers this one for the next."""
        now = self._clock.monotonic() if now is None else now
        before, at = self._error_owner, self._error_at
        self._error_owner, self._error_at = owner, now
        self._errors_in_a_row += 1
        return (owner is None or (before is not None and before != owner and now - at < CORROBORATION_SECONDS)
                or self._errors_in_a_row >= 2 * self.settings.consecutive_failures)

    def release(self) -> None:
        """The request ended without telling anything (the client left): let another probe through."""
        self._probing = False

    def record(self, ok: bool, now: float | None = None) -> None:
        now = self._clock.monotonic() if now is None else now
        s = self.settings
        if self.state is BreakerState.HALF_OPEN:
            self._probing = False
            if ok:
                self._errors_in_a_row = 0
                self._close()
            else:
                self._open(now, self._cooldown * 2)
            return
        second = int(now)
        seconds = self._seconds
        while seconds and second - seconds[0][0] >= s.window_seconds:
            _, total, failures = seconds.popleft()
            self._total -= total
            self._failures -= failures
        if not seconds or seconds[-1][0] != second:
            seconds.append([second, 0, 0])
        seconds[-1][1] += 1
        self._total += 1
        if not ok:
            seconds[-1][2] += 1
            self._failures += 1
        self._consecutive = 0 if ok else self._consecutive + 1
        if ok:
            self._errors_in_a_row = 0
        if self.state is not BreakerState.CLOSED or ok:
            return
        if self._consecutive >= s.consecutive_failures or (
            self._total >= s.min_requests and self._failures / self._total >= s.failure_ratio
        ):
            self._open(now, s.cooldown_seconds)

    def _open(self, now: float, cooldown: float) -> None:
        self._cooldown = min(cooldown, self.settings.max_cooldown_seconds)
        self._open_until = now + self._cooldown
        self.state = BreakerState.OPEN
        self.trips += 1

    def _close(self) -> None:
        self.state = BreakerState.CLOSED
        self._seconds.clear()
        self._total = self._failures = 0
        self._consecutive = 0
        self._cooldown = self.settings.cooldown_seconds
