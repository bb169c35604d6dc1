"""The suite's one way to wait for a state: bounded, and failing with what it waited for.

Wait for the event that matters where the code gives one (an ``asyncio.Event``, a future, a message, a process
exiting). These two are for a state another thread, process or task reaches in its own time (a reload
applied, a model discovered, a scrape read) where no event is there to wait on: they look every 10 ms and fail
naming ``what`` after ``within`` seconds. ``within`` is a bound on a failure, never a guess at how long
something takes, so be generous: a loaded machine is slow, and a passing test never waits it out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

EVERY = 0.01  # seconds between two looks


def wait_until(condition: Callable[[], object], what: str, within: float = 10.0) -> None:
    """Return once ``condition()`` is true (from a thread that may block)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(EVERY)


async def until(condition: Callable[[], object], what: str, within: float = 10.0) -> None:
    """Return once ``condition()`` is true (from a coroutine: the loop runs meanwhile). On a fake-time loop the
    bound is in the loop's time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not condition():
        assert loop.time() < deadline, f"{what}: not within {within:g} s"
        await asyncio.sleep(EVERY)


async def until_true(condition: Callable[[], Awaitable[object]], what: str, within: float = 10.0) -> None:
    """As ``until``, for a condition that must itself be awaited (a read from Redis, a request)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await condition():
        assert loop.time() < deadline, f"{what}: not within {within:g} s"
        await asyncio.sleep(EVERY)
