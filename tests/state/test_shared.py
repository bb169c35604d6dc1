"""The shared state against a real redis-server: admission scripts (budgets, slots), slots freed across
replicas, a dead replica reaped, peers' messages, stored responses, and Redis going away and coming back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gateway.config import StateSettings
from gateway.state import Budget, SharedState, Slotted, StateUnavailable
from tests.state.conftest import RedisServer


def settings(server: RedisServer, **extra: Any) -> StateSettings:
    return StateSettings(url=server.url, heartbeat_seconds=0.05, replica_ttl_seconds=0.5, timeout_ms=200, **extra)


async def replicas(server: RedisServer, n: int, slotted: set[str] | None = None, **extra: Any) -> list[SharedState]:
    out = []
    for i in range(n):
        state = SharedState(settings(server, **extra), replica_id=f"r{i}")
        state.slotted = lambda: slotted or set()
        await state.start()
        out.append(state)
    return out


async def stop(states: list[SharedState]) -> None:
    for state in states:
        await state.stop()


async def until(predicate: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.01)


@pytest.fixture
async def pair(redis_server: RedisServer) -> AsyncIterator[list[SharedState]]:
    states = await replicas(redis_server, 2, {"b"})
    yield states
    await stop(states)


B = [Slotted("b", 2)]


@pytest.mark.anyio
async def test_requests_per_minute_is_one_budget_for_every_replica(pair: list[SharedState]) -> None:
    budget = Budget("k", 10, None)
    results = [await pair[i % 2].admit(budget, 0, [Slotted("x", None)]) for i in range(12)]
    assert [r.limited for r in results] == [None] * 10 + ["requests"] * 2
    assert 0 < results[-1].retry_after <= 6.1  # one request refills in 6 s


@pytest.mark.anyio
async def test_tokens_are_reserved_then_settled_and_admit_while_positive(pair: list[SharedState]) -> None:
    budget = Budget("k", None, 600)
    a, b = pair
    assert (await a.admit(budget, 500, [])).limited is None  # 600 -> 100
    assert (await b.admit(budget, 500, [])).limited is None  # positive: admitted, 100 -> -400
    assert (await a.admit(budget, 1, [])).limited == "tokens"
    b.settle(budget, -500, None)  # that one used nothing: given back
    a.settle(budget, -400, None)
    await until(lambda: not a.pending and not b.pending)
    assert (await b.admit(budget, 1, [])).limited is None


@pytest.mark.anyio
async def test_a_keys_max_in_flight_holds_across_replicas_and_a_refusal_takes_nothing(
        pair: list[SharedState]) -> None:
    budget = Budget("capped", 100, None, max_in_flight=2)
    a, b = pair
    first, second = await a.admit(budget, 0, []), await b.admit(budget, 0, [])
    assert first.limited is None and first.key_place and second.key_place
    third = await a.admit(budget, 0, [])
    assert third.limited == "in_flight" and not third.key_place
    # a refusal takes nothing: not a backend slot either
    full = await b.admit(budget, 0, [Slotted("b", 1)])
    assert full.limited == "in_flight" and a.remote_in_flight("b") == 0 and b.holds("b") == 0
    b.settle(budget, 0, None, key_place=True)
    await until(lambda: not b.pending)
    again = await a.admit(budget, 0, [])
    assert again.limited is None and again.key_place


@pytest.mark.anyio
async def test_a_slot_is_taken_on_the_first_candidate_with_one_and_freed_for_the_others(
        pair: list[SharedState]) -> None:
    a, b = pair
    freed: list[str] = []
    b.on_freed(freed.append)
    two = [Slotted("b", 1), Slotted("c", 1)]
    first = await a.admit(None, 0, two)
    second = await b.admit(None, 0, two)
    assert (first.chosen, first.slot, second.chosen, second.slot) == (0, True, 1, True)
    third = await a.admit(None, 0, two)
    assert third.full  # nothing taken
    assert (await b.admit(None, 0, [Slotted("b", 1), Slotted("x", None)])).chosen == 1, "a backend without a limit"
    a.settle(None, 0, "b")
    await until(lambda: freed == ["b"])
    assert (await b.admit(None, 0, two)).chosen == 0


@pytest.mark.anyio
async def test_a_full_backend_does_not_charge_the_budget(pair: list[SharedState]) -> None:
    a, _ = pair
    budget = Budget("k", 2, None)
    assert (await a.admit(budget, 0, [Slotted("b", 1)])).slot
    assert (await a.admit(budget, 0, [Slotted("b", 1)])).full
    assert (await a.admit(budget, 0, [Slotted("c", 1)])).slot, "the full attempt took nothing from the budget"


@pytest.mark.anyio
async def test_the_others_slots_are_read_by_the_heartbeat(pair: list[SharedState]) -> None:
    a, b = pair
    await a.admit(None, 0, B)
    await a.admit(None, 0, B)
    await until(lambda: b.remote_in_flight("b") == 2)
    assert a.remote_in_flight("b") == 0 and a.holds("b") == 2
    assert await b.acquire(Slotted("b", 3)) and not await b.acquire(Slotted("b", 3))


@pytest.mark.anyio
async def test_a_replica_that_stops_renewing_is_reaped_and_its_slots_freed(redis_server: RedisServer) -> None:
    alive, dying = await replicas(redis_server, 2, {"b"})
    freed: list[str] = []
    alive.on_freed(freed.append)
    try:
        assert (await dying.admit(None, 0, [Slotted("b", 1)])).slot
        assert (await alive.admit(None, 0, [Slotted("b", 1)])).full
        for task in dying._tasks:  # it dies: no heartbeat, no goodbye
            task.cancel()
        await until(lambda: "*" in freed, seconds=5)
        assert (await alive.admit(None, 0, [Slotted("b", 1)])).slot
    finally:
        await stop([alive])


@pytest.mark.anyio
async def test_peers_get_each_others_messages_not_their_own(pair: list[SharedState]) -> None:
    a, b = pair
    got: dict[str, list[Any]] = {"a": [], "b": []}
    a.subscribe("session", got["a"].append)
    b.subscribe("session", got["b"].append)
    await asyncio.sleep(0.1)  # (the subscriptions are in place)
    a.publish("session", ["s1", "backend-1"])
    a.publish("session", ["s2", "backend-2"])
    await until(lambda: len(got["b"]) == 2)
    assert got["b"] == [["s1", "backend-1"], ["s2", "backend-2"]] and got["a"] == []


@pytest.mark.anyio
async def test_stored_responses_are_read_by_another_replica(pair: list[SharedState]) -> None:
    a, b = pair
    a.put_response("resp_1", [{"role": "user", "content": "hi"}], ttl_seconds=0.3)
    await until(lambda: not a._background)
    assert await b.get_response("resp_1") == [{"role": "user", "content": "hi"}]
    await asyncio.sleep(0.4)
    assert await b.get_response("resp_1") is None, "expired"


@pytest.mark.anyio
async def test_redis_going_away_and_back(redis_server: RedisServer) -> None:
    (state,) = await replicas(redis_server, 1, {"b"})
    try:
        assert (await state.admit(None, 0, B)).slot
        redis_server.kill()
        with pytest.raises(StateUnavailable):
            await state.admit(None, 0, B)
        assert not state.up and state.errors["admit"] == 1
        state.settle(None, 0, "b")  # waits for Redis
        assert state.pending == 1 and state.remote_in_flight("b") == 0
        redis_server.start()  # empty: its scripts and counts are gone
        await until(lambda: state.up and not state.pending, seconds=5)
        # its own count was written again (0 now), so the limit holds from the truth
        assert (await state.admit(None, 0, B)).slot and (await state.admit(None, 0, B)).slot
        assert (await state.admit(None, 0, B)).full
    finally:
        await stop([state])


@pytest.mark.anyio
async def test_a_drain_reaches_every_replica_and_one_that_starts_later(redis_server: RedisServer) -> None:
    a, b = await replicas(redis_server, 2)
    seen: dict[str, dict[str, bool]] = {"a": {}, "b": {}}
    a.on_drained(lambda name, drained: seen["a"].__setitem__(name, drained))
    b.on_drained(lambda name, drained: seen["b"].__setitem__(name, drained))
    late: SharedState | None = None
    try:
        await until(lambda: a.replicas == 2 and b.replicas == 2)
        await asyncio.sleep(0.1)  # (the subscriptions are in place)
        a.set_drained("x", True)
        await until(lambda: seen["b"].get("x") is True)
        assert seen["a"].get("x", True) is True  # (its own heartbeat may read it back: never the other way)
        (late,) = await replicas(redis_server, 1)
        late_seen: dict[str, bool] = {}
        late.on_drained(late_seen.__setitem__)
        await until(lambda: late_seen.get("x") is True)  # read from the shared set by its heartbeat
        b.set_drained("x", False)
        await until(lambda: seen["a"].get("x") is False and late_seen.get("x") is False)
    finally:
        await stop([a, b, *([late] if late is not None else [])])
