"""Ending background tasks for good.

``task.cancel()`` then ``await task`` is not enough on Python 3.11: ``asyncio.wait_for`` drops a cancellation
that arrives just as the awaitable it waits on completes (CPython gh-86296, fixed in 3.12 when ``wait_for``
was rebuilt on ``asyncio.timeout``), so a loop that awaits one, as the engine scrapes do, can carry on after
its one ``cancel()``, and the ``await`` that waits for it never returns. That hung ``gateway serve``'s
shutdown now and then (the scrapes went on, once a second, in a process that never exited).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("gateway")

AGAIN_EVERY = 0.1  # seconds between cancellations of a task that has not ended yet


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None]) -> None:
    """Cancel ``tasks`` and return once every one has ended, cancelling again those that go on. A task that
    ended with an error other than its cancellation has it logged (not raised: the caller is stopping)."""
    every = [task for task in tasks if task is not None]
    pending = {task for task in every if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=AGAIN_EVERY)
        for task in pending:
            task.cancel()
    for task in every:
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task %s had failed: %r", task.get_name(), task.exception())
