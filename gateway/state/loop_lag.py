"""Timeouts on Redis that measure Redis, not this process's event loop.

A Redis operation's timeout decides whether Redis is slow or down. Measured on the wall clock, it also counted
every moment the event loop was held by other work (one large body decoded, ~0.3 s; a fast stream relayed): a
quick Redis looked down, other keys' admissions failed (503 ``limits_unavailable``, or passed unchecked), and a
settlement's timeout took the whole shared state down (sweep 13). :class:`LoopLag` keeps how far behind its
timers the loop has run; :func:`LoopLag.wait` waits for an operation for its timeout plus that lag. The hot
path's admissions have a finer rule (``AutoPipeline.run``: what was written, and when, and what was read).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
TICK = 0.05  # seconds between two looks at the loop's lateness (20 a second: nothing measurable)
# an operation waits at most this many of its timeouts in all, however busy the loop (250 ms: 10 s; an admission
# takes ~5 loop turns, each as long as whatever else holds the loop then)
MAX_LAG_FACTOR = 40


class LoopLag:
    """``total``: seconds the running loop has been late on its timers since :meth:`start` (holds shorter than
    a tick are not all seen; what is seen is not counted against Redis)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + TICK
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now > self._due:
            self.total += now - self._due
        self._due = now + TICK
        self._handle = loop.call_at(self._due, self._tick)

    async def wait(self, operation: Awaitable[T], within: float) -> T:
        """``operation``'s result within ``within`` seconds not counting the loop's lateness meanwhile (and
        within ``MAX_LAG_FACTOR`` times that in all); TimeoutError, the operation cancelled."""
        timeout = within
        loop = asyncio.get_running_loop()
        task: asyncio.Future[T] = asyncio.ensure_future(operation)
        start, lag = loop.time(), self.total
        try:
            while True:
                left = timeout + (self.total - lag) - (loop.time() - start)
                if left > 0:
                    done, _ = await asyncio.wait({task}, timeout=left)
                    if done:
                        return task.result()
                for _ in range(2):  # (a turn or two: a tick as late as this timer is counted first)
                    await asyncio.sleep(0)
                if task.done():
                    return task.result()
                more = timeout + (self.total - lag) - (loop.time() - start) > 0
                if not more or loop.time() - start >= MAX_LAG_FACTOR * timeout:
                    raise TimeoutError
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.shield(_settled(task))


async def _settled(task: asyncio.Future[Any]) -> None:
    with contextlib.suppress(BaseException):
        await task
