"""The validation workers are shared between API keys in turns: a key queueing many constraints delays
another key's one by at most one per worker, and a key's own queue is bounded."""

from __future__ import annotations

import asyncio

import pytest

from gateway.structured.fair_slots import FairSlots, OwnerQueueFull

pytestmark = pytest.mark.unit


def test_a_free_slot_goes_to_the_owners_in_turn_not_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        slots = FairSlots(1, per_owner=100)
        order: list[str] = []
        held = await slots.acquire("flood", 1)  # the one worker is busy

        async def job(owner: str) -> None:
            slot = await slots.acquire(owner, 5)
            order.append(owner)
            await asyncio.sleep(0)
            slots.release(slot)

        tasks = [asyncio.create_task(job("flood")) for _ in range(10)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(job("victim")))  # arrives after ten of the flood's
        await asyncio.sleep(0)
        slots.release(held)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert order.index("victim") == 1  # one of the flood's ran first (its turn), then the victim's
    assert len(order) == 11


def test_an_owner_with_its_share_waiting_is_refused_at_once_and_others_are_not() -> None:
    async def scenario() -> None:
        slots = FairSlots(2, per_owner=3)
        held = [await slots.acquire("a", 1), await slots.acquire("a", 1)]
        waiting = [asyncio.create_task(slots.acquire("a", 5)) for _ in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(OwnerQueueFull):
            await slots.acquire("a", 5)
        other = asyncio.create_task(slots.acquire("b", 5))
        await asyncio.sleep(0)
        assert slots.waiting("b") == 1 and slots.waiting("a") == 3
        for slot in held:
            slots.release(slot)
        await other  # a's first waiter had the first slot (its turn came first), b the second, before a's second
        assert sum(task.done() for task in waiting) == 1
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        assert slots.waiting("a") == 0

    asyncio.run(scenario())


def test_a_waiter_that_times_out_or_is_cancelled_loses_no_slot() -> None:
    async def scenario() -> None:
        slots = FairSlots(1, per_owner=10)
        held = await slots.acquire("a", 1)
        with pytest.raises(TimeoutError):
            await slots.acquire("b", 0.01)
        cancelled = asyncio.create_task(slots.acquire("c", 5))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release(held)
        assert await slots.acquire("d", 0.01) == held  # free again, nobody stale ahead of it

    asyncio.run(scenario())
