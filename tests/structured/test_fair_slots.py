"""The validation workers are shared between API keys by the time each used them: a key queueing many constraints
delays another key's one by at most one per worker, a key whose checks are slow gets fewer turns, and a key's own
queue is bounded."""

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
    assert order.index("victim") == 0  # the flood had the worker: the victim's comes before its next
    assert len(order) == 11


def test_a_slot_goes_to_the_owner_that_used_the_slots_least_not_only_in_turn() -> None:
    """Sweep 28: one key's offloaded checks took 2-4 s each, and in plain turns every other key's check waited
    behind one of them (0.23 -> 10.9 s). The time a slot is held is what its owner is charged."""
    now = [0.0]

    async def scenario() -> list[str]:
        slots = FairSlots(1, per_owner=100, clock=lambda: now[0])
        order: list[str] = []

        async def job(owner: str, seconds: float) -> None:
            slot = await slots.acquire(owner, 60)
            order.append(owner)
            await asyncio.sleep(0)
            now[0] += seconds  # (what its check took)
            slots.release(slot)

        held = await slots.acquire("heavy", 1)
        tasks = [asyncio.create_task(job("heavy", 2.0)) for _ in range(3)]
        tasks += [asyncio.create_task(job("light", 0.1)) for _ in range(30)]
        await asyncio.sleep(0)
        now[0] += 2.0
        slots.release(held)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    # each of heavy's 2 s turns is worth 20 of light's 0.1 s ones, not one
    assert order[:21] == ["light"] * 20 + ["heavy"] and order.count("heavy") == 3, order


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
