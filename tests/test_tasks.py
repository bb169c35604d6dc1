"""Background tasks end for good when stopped, even one that lost its first cancellation (as Python 3.11's
``asyncio.wait_for`` can make a loop lose it: gh-86296)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.tasks import cancel_and_wait
from tests.waiting import until

pytestmark = pytest.mark.unit


async def _loses_one_cancellation(rounds: list[int]) -> None:
    lost = False
    while True:
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True  # (what a wait_for whose awaitable completed at that moment does: it carries on)
        rounds.append(1)


@pytest.mark.anyio
async def test_a_task_that_loses_a_cancellation_is_cancelled_again_until_it_ends() -> None:
    rounds: list[int] = []
    task = asyncio.create_task(_loses_one_cancellation(rounds))
    await until(lambda: rounds, "the task running")
    once_rounds: list[int] = []
    once = asyncio.create_task(_loses_one_cancellation(once_rounds))
    await until(lambda: once_rounds, "the other running")
    once.cancel()
    cancelled_at = len(once_rounds)
    await until(lambda: len(once_rounds) > cancelled_at + 2, "it going on past its cancellation")
    assert not once.done(), "one cancel() is not enough for it (await would hang)"
    await asyncio.wait_for(cancel_and_wait([task, once, None]), 5)
    assert task.cancelled() and once.cancelled()


@pytest.mark.anyio
async def test_a_failed_task_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fail() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fail(), name="failing")
    await asyncio.sleep(0)
    with caplog.at_level(logging.WARNING, logger="gateway"):
        await cancel_and_wait([task])
    assert "failing" in caplog.text and "boom" in caplog.text
