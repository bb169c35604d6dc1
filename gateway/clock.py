"""The gateway's time, as one seam: everything whose behaviour depends on time reads it from a :class:`Clock`.

Production runs on :data:`SYSTEM` (``time.monotonic``, ``time.time``, ``asyncio.sleep``). Tests hand a component
another clock and move time themselves:

- a manual clock (``tests/clock.py``) for code that only reads the time (a breaker, a token bucket, a lease):
  the test sets it and advances it, and a sleeper wakes only when the test moves time past its deadline;
- :class:`LoopClock` for code that also waits (admission's deadlines and kicks, heartbeats): it reads the running
  event loop's own time, so on a fake-time loop (``looptime.new_event_loop()`` in the tests) every sleep,
  timeout and reading agrees, and a wait of a minute takes none.

Monotonic time is what durations, deadlines and rates use; wall time (``time()``) is only for what leaves the
process (timestamps in answers, expiry written to Redis). Timers the event loop keeps itself (``call_later``,
``asyncio.wait_for``) are the loop's time: :class:`LoopClock` and a fake-time loop cover them.
"""

from __future__ import annotations

import asyncio
import time


class Clock:
    """The real clock (see :data:`SYSTEM`)."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM = Clock()


class LoopClock(Clock):
    """Monotonic time is the running event loop's (``loop.time()``, which on the default loop is
    ``time.monotonic()``): on a fake-time loop the readings move with its sleeps and timeouts. Wall time is
    the loop's time plus a fixed offset taken when the clock was made."""

    __slots__ = ("_offset",)

    def __init__(self) -> None:
        self._offset = time.time() - time.monotonic()

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def time(self) -> float:
        return self.monotonic() + self._offset

