"""A clock that moves only when a test says (see gateway/clock.py), the way Go's fake clocks do: readings are
what the test set, and a sleeper wakes when :meth:`ManualClock.advance` moves time past its
deadline, never before, and never on its own."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from gateway.clock import Clock


class ManualClock(Clock):
    __slots__ = ("_order", "_timers", "now", "wall_offset")

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall_offset
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + self.wall_offset

    @property
    def sleepers(self) -> int:
        """Sleepers waiting for time to move (a test can wait for a component to go to sleep)."""
        return len(self._timers)

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds``, firing in deadline order what falls due (each sees the time it was due,
        then time ends at the new reading)."""
        if seconds < 0:
            raise ValueError("time does not go back")
        end = self.now + seconds
        while self._timers and self._timers[0][0] <= end:
            due, _, fire = heapq.heappop(self._timers)
            self.now = max(self.now, due)
            fire()
        self.now = end

    def _at(self, delay: float, fire: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (self.now + max(0.0, delay), next(self._order), fire))

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._at(seconds, lambda: woken.done() or woken.set_result(None))
        await woken

