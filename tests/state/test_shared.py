"""The shared state against a real redis-server: admission scripts (budgets, slots), slots freed across
replicas, slots a replica keeps for its next requests, a dead replica reaped, peers' messages, stored
responses, and Redis going away and coming back."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from gateway.config import StateSettings
from gateway.state import Budget, SharedState, Slotted, StateUnavailable
from gateway.state.shared import key_place_of
from gateway.state.stored_responses import StoreBounds
from tests import waiting
from tests.state.conftest import RedisServer

pytestmark = pytest.mark.system


def settings(server: RedisServer, **extra: Any) -> StateSettings:
    return StateSettings(**{"url": server.url, "heartbeat_seconds": 0.05, "replica_ttl_seconds": 0.5,
                            "timeout_ms": 200, **extra})


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


async def until(predicate: Callable[[], object], seconds: float = 5.0) -> None:
    """``tests.waiting.until``, for the modules that still import it from here without saying what they wait for
    (test_limit_state, test_garbage_keys, test_stored_responses)."""
    await waiting.until(predicate, "the shared state's awaited state", seconds)


async def listening(*states: SharedState, seconds: float = 5.0) -> None:
    """Until Redis counts every replica's subscription to the peers' channel (a message published before it is
    not theirs to hear)."""
    channel = states[0]._peers_channel

    async def subscribed() -> bool:
        return bool((await states[0]._redis.pubsub_numsub(channel))[0][1] >= len(states))

    await waiting.until_true(subscribed, "the replicas subscribed to the peers' channel", seconds)


async def heartbeats(*states: SharedState, count: int = 2, seconds: float = 5.0) -> None:
    """Until each replica has answered ``count`` more heartbeats (each read what was written before it)."""
    targets = [state.beats + count for state in states]
    await waiting.until(lambda: all(s.beats >= t for s, t in zip(states, targets, strict=True)),
                        f"{count} more heartbeats of each replica", seconds)


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
    await waiting.until(lambda: not a.pending and not b.pending, "not a.pending and not b.pending")
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
    await waiting.until(lambda: not b.pending, "not b.pending")
    again = await a.admit(budget, 0, [])
    assert again.limited is None and again.key_place


@pytest.mark.anyio
async def test_a_backend_named_like_a_keys_places_shares_no_count_with_that_key(redis_server: RedisServer) -> None:
    """The sweep (t22-coll.yaml): a backend "key:lim" holding two requests of another key, and key lim got 429
    concurrency_limit with nothing in flight: both were counted in one hash, inflight:key:lim."""
    lim, backend = Budget("lim", None, None, max_in_flight=2), [Slotted("key:lim", 2)]
    a, b = await replicas(redis_server, 2, {"key:lim", key_place_of("lim")})
    try:
        assert (await b.admit(None, 0, backend)).slot and (await b.admit(None, 0, backend)).slot
        assert [(await a.admit(lim, 0, [])).limited for _ in range(3)] == [None, None, "in_flight"]
        assert (await a.admit(None, 0, backend)).full, "lim's requests took none of the backend's slots either"
        await waiting.until(lambda: a.remote_in_flight("key:lim") == 2 and b.remote_in_flight(key_place_of("lim")) == 2,
                            "a.remote_in_flight('key:lim') == 2 and b.remote_in_flight(key_place_of('lim')) == 2")
        assert a.holds("key:lim") == 0 and a.holds(key_place_of("lim")) == 2
        assert a.remote_in_flight(key_place_of("lim")) == 0 and b.remote_in_flight("key:lim") == 0
        # the key's places stay where replicas of the version before count them (a rolling upgrade keeps them)
        assert await a._redis.hget("gateway:inflight:key:lim", "r0") == b"2"
        b.settle(None, 0, "key:lim")
        await waiting.until(lambda: not b.pending, "not b.pending")
        assert (await a.admit(None, 0, backend)).slot
    finally:
        await stop([a, b])


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
    await waiting.until(lambda: freed == ["b"], "freed == ['b']")
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
    await waiting.until(lambda: b.remote_in_flight("b") == 2, "b.remote_in_flight('b') == 2")
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
        await waiting.until(lambda: "*" in freed, "'*' in freed", within=5)
        assert (await alive.admit(None, 0, [Slotted("b", 1)])).slot
    finally:
        await stop([alive])


@pytest.mark.anyio
async def test_peers_get_each_others_messages_not_their_own(pair: list[SharedState]) -> None:
    a, b = pair
    got: dict[str, list[Any]] = {"a": [], "b": []}
    a.subscribe("session", got["a"].append)
    b.subscribe("session", got["b"].append)
    await waiting.until(lambda: a.replicas == 2 and b.replicas == 2,
                        "a.replicas == 2 and b.replicas == 2")  # (a replica alone publishes nothing)
    await listening(a, b)
    a.publish("session", ["s1", "backend-1"])
    a.publish("session", ["s2", "backend-2"])
    await waiting.until(lambda: len(got["b"]) == 2, "len(got['b']) == 2")
    assert got["b"] == [["s1", "backend-1"], ["s2", "backend-2"]] and got["a"] == []


@pytest.mark.anyio
async def test_stored_responses_are_read_by_another_replica(pair: list[SharedState]) -> None:
    a, b = pair
    a.responses.put_response("", "resp_1", b'[{"role":"user","content":"hi"}]', StoreBounds(ttl_seconds=0.3))
    await waiting.until(lambda: not a._background, "not a._background")
    assert await b.responses.get_response("", "resp_1") == b'[{"role":"user","content":"hi"}]'
    await asyncio.sleep(0.4)  # (real time: Redis expires the stored response by its own clock, 0.3 s)
    assert await b.responses.get_response("", "resp_1") is None, "expired"


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
        await waiting.until(lambda: state.up and not state.pending, "state.up and not state.pending", within=5)
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
        await waiting.until(lambda: a.replicas == 2 and b.replicas == 2, "a.replicas == 2 and b.replicas == 2")
        await listening(a, b)
        a.set_drained("x", True)
        await waiting.until(lambda: seen["b"].get("x") is True, "seen['b'].get('x') is True")
        assert seen["a"].get("x", True) is True  # (its own heartbeat may read it back: never the other way)
        (late,) = await replicas(redis_server, 1)
        late_seen: dict[str, bool] = {}
        late.on_drained(late_seen.__setitem__)
        await waiting.until(lambda: late_seen.get("x") is True,
                            "late_seen.get('x') is True")  # read from the shared set by its heartbeat
        b.set_drained("x", False)
        await waiting.until(lambda: seen["a"].get("x") is False and late_seen.get("x") is False,
                            "seen['a'].get('x') is False and late_seen.get('x') is False")
    finally:
        await stop([a, b, *([late] if late is not None else [])])


@pytest.mark.anyio
async def test_an_undrain_read_while_this_replicas_own_drain_was_on_its_way_is_read_again(
        redis_server: RedisServer) -> None:
    """Soak run 4 of the stop after sweep 23: a backend stayed drained on one replica after another undrained it.
    A replica passes over a change of the shared set for a backend whose own drain or undrain is still on its
    way to Redis (a read that predates its write must not undo it); the change passed over was taken as read
    all the same, and never applied. It is found again by the next read once the write is done."""
    a, b = await replicas(redis_server, 2, heartbeat_seconds=0.2)
    seen: dict[str, bool] = {}
    a.on_drained(seen.__setitem__)
    try:
        await waiting.until(lambda: a.replicas == 2 and b.replicas == 2, "a.replicas == 2 and b.replicas == 2")
        await listening(a, b)
        b.set_drained("x", True)
        await waiting.until(lambda: seen.get("x") is True, "a heard of the drain")
        a._drain_writes["x"] = 1  # (a's own drain of x, still on its way to Redis)
        b.set_drained("x", False)
        await waiting.until(lambda: not b._drain_writes, "b's undrain written")
        await a._read_drained()  # (a read while a's write is on its way: passed over)
        assert seen["x"] is True
        del a._drain_writes["x"]  # (a's write done: the shared set says undrained, and a's next read says so too)
        await waiting.until(lambda: seen.get("x") is False, "the undrain read again once a's write was done")
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_a_replicas_own_drain_is_its_last_read_when_another_undrains_before_its_heartbeat(
        redis_server: RedisServer) -> None:
    """The test of replicas' rare failure: a replica's own drain was not its last read of the shared set until its
    next heartbeat read it back; another replica's undrain heard before that read the set as it had last read it
    (nothing drained), so nothing changed, and the backend stayed drained on the replica that drained it."""
    a, b = await replicas(redis_server, 2, heartbeat_seconds=60, replica_ttl_seconds=120)
    seen: dict[str, dict[str, bool]] = {"a": {}, "b": {}}
    a.on_drained(lambda name, drained: seen["a"].__setitem__(name, drained))
    b.on_drained(lambda name, drained: seen["b"].__setitem__(name, drained))
    try:
        for state in (a, b, a):  # (each counts the other, and has read the set: nothing drained)
            await state._heartbeat()
        assert a.replicas == 2 and b.replicas == 2
        await listening(a, b)
        beats = a.beats
        a.set_drained("x", True)
        await waiting.until(lambda: seen["b"].get("x") is True and not a._drain_writes, "the drain written and heard")
        b.set_drained("x", False)
        await waiting.until(lambda: seen["a"].get("x") is False, "a heard the undrain of the backend it drained")
        assert a.beats == beats, "no heartbeat read in between: the message alone did it"
    finally:
        await stop([a, b])


# -- kept slots ----------------------------------------------------------------------------------------------
def counting(state: SharedState) -> list[str]:
    """The scripts ``state`` runs in Redis from now on (the admission's round trips), by name."""
    calls: list[str] = []
    run = state._script

    def script(name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return run(name, *args, **kwargs)

    state._script = script  # type: ignore[method-assign]
    return calls


async def lease(state: SharedState, backend: str) -> int:
    """What Redis counts as ``state``'s slots of ``backend``."""
    return int(await state._redis.hget(state._inflight(backend), state.replica) or 0)


@pytest.mark.anyio
async def test_a_freed_slot_is_kept_for_the_next_request_which_takes_it_without_a_round_trip(
        redis_server: RedisServer) -> None:
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=5.0)
    try:
        sixteen = [Slotted("b", 16)]  # keeps up to 16 // 8 = 2
        calls = counting(a)
        assert (await a.admit(None, 0, sixteen)).slot and calls == ["admit"]
        # the round trip took two more slots to keep
        assert a.holds("b") == 1 and a.kept("b") == 2 and await lease(a, "b") == 3
        for _ in range(2):
            again = await a.admit(None, 0, sixteen)
            assert again.slot and again.chosen == 0
        assert calls == ["admit"] and a.holds("b") == 3 and a.kept("b") == 0, "no round trip"
        a.settle(None, 0, "b")
        assert a.kept("b") == 1 and a.pending == 0 and await lease(a, "b") == 3  # still held in Redis
        for _ in range(2):
            a.settle(None, 0, "b")
        assert a.kept("b") == 2, "at most max_concurrency // 8"
        await waiting.until(lambda: not a.pending, "not a.pending")
        assert await lease(a, "b") == 2
        # a limited key still asks Redis (its budget is there), and a backend ranked first without a kept slot
        # is asked for, not passed over for one that has
        assert (await a.admit(Budget("k", 100, None), 0, sixteen)).slot and calls[-1] == "admit"
        assert (await a.admit(None, 0, [Slotted("c", 16), *sixteen])).chosen == 0 and calls[-1] == "admit"
        assert a.kept("b") == 2
        # a backend too small to keep any
        four = [Slotted("d", 4)]
        await a.admit(None, 0, four)
        a.settle(None, 0, "d")
        assert a.kept("d") == 0
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_try_local_admits_from_kept_slots_and_leases_only_and_says_none_otherwise(
        redis_server: RedisServer) -> None:
    """The proxy's first look, with no await: an admission from what the replica holds, or None (then
    admit's round trip); it takes exactly what admit's local path takes, and never asks Redis."""
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=5.0)
    try:
        sixteen = [Slotted("b", 16)]
        calls = counting(a)
        assert a.try_local(None, 0, sixteen) is None and a.holds("b") == 0, "nothing kept yet"
        await a.admit(None, 0, sixteen)  # (the round trip keeps two more)
        local = a.try_local(None, 0, sixteen)
        assert local is not None and local.slot and local.chosen == 0 and not local.limited
        assert a.holds("b") == 2 and a.kept("b") == 1 and calls == ["admit"]
        # a candidate without max_concurrency needs no slot: nothing to admit here (admit's needed() says so)
        assert a.needed(None, [Slotted("c", None)]) is False
        # a key's max_in_flight is counted in Redis on every request; a key's budget must be leased here first
        assert a.try_local(Budget("k", None, None, max_in_flight=4), 0, sixteen) is None
        assert a.try_local(Budget("k", 100, None), 0, sixteen) is None
        await a.admit(Budget("k", 100, None), 0, sixteen)  # (leases the key's next requests)
        leased = a.leased("k")
        limited = a.try_local(Budget("k", 100, None), 0, sixteen)
        assert limited is not None and a.leased("k") == leased - 1
        assert calls == ["admit", "admit"] and a.admissions["local"] == 2
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_kept_slots_go_back_at_once_when_another_replica_finds_the_backend_full(
        redis_server: RedisServer) -> None:
    a, b = await replicas(redis_server, 2, {"b"}, heartbeat_seconds=5.0)
    try:
        await listening(a, b)
        sixteen = [Slotted("b", 16)]
        for _ in range(16):
            assert (await a.admit(None, 0, sixteen)).slot
        a.settle(None, 0, "b")
        a.settle(None, 0, "b")
        assert a.kept("b") == 2
        freed: list[str] = []
        b.on_freed(freed.append)
        assert (await b.admit(None, 0, sixteen)).full  # ... and says so
        await waiting.until(lambda: a.kept("b") == 0 and bool(freed), "a.kept('b') == 0 and bool(freed)")
        assert (await b.admit(None, 0, sixteen)).slot
        # while the others want it, what a frees goes back at once
        a.settle(None, 0, "b")
        assert a.kept("b") == 0
        await waiting.until(lambda: not a.pending, "not a.pending")
        assert await lease(a, "b") == 13 and await lease(b, "b") == 1
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_kept_slots_unused_for_a_heartbeat_go_back(redis_server: RedisServer) -> None:
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=0.1)
    try:
        await a.admit(None, 0, [Slotted("b", 64)])
        assert a.kept("b") == 8  # (taken with the admission: 64 // 8)
        a.settle(None, 0, "b")
        assert a.kept("b") == 8 and await lease(a, "b") in (8, 9)  # (its own slot goes back: none to keep)
        await waiting.until(lambda: a.kept("b") == 0 and not a.pending, "a.kept('b') == 0 and not a.pending", within=3)
        assert await lease(a, "b") == 0
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_an_admission_keeps_at_most_half_of_the_slots_still_free(redis_server: RedisServer) -> None:
    a, b = await replicas(redis_server, 2, {"b", "p", "q"}, heartbeat_seconds=5.0)
    try:
        await b._redis.hset(b._inflight("b"), b.replica, 58)  # (as if b's requests held them)
        assert (await a.admit(None, 0, [Slotted("b", 64)])).slot
        # 64 // 8 = 8 it could keep, but only 64 - 58 - 1 = 5 are still free after its own: it keeps 2
        assert a.kept("b") == 2 and await lease(a, "b") == 3
        # the backend asked for is full and the next one is chosen: what was taken beyond that one's own room
        # (8 // 8 = 1) goes back at once
        await b._redis.hset(b._inflight("p"), b.replica, 64)
        admitted = await a.admit(None, 0, [Slotted("p", 64), Slotted("q", 8)])
        assert admitted.slot and admitted.chosen == 1 and a.kept("q") == 1
        await waiting.until(lambda: not a.pending, "not a.pending")
        assert await lease(a, "q") == 2 and await lease(a, "p") == 0
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_a_burst_of_requests_arriving_together_pays_one_round_trip(redis_server: RedisServer) -> None:
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=5.0)
    try:
        calls = counting(a)
        roomy = [Slotted("b", 1024)]  # keeps up to 64
        burst = await asyncio.gather(*(a.admit(None, 0, roomy) for _ in range(16)))
        assert all(r.slot for r in burst) and calls == ["admit"], calls
        assert a.admissions == {"local": 0, "waited": 15, "redis": 1}
        assert a.holds("b") == 16 and await lease(a, "b") == 16 + a.kept("b") and a.kept("b") == 64 - 15
        # a limited key's burst: one round trip leases the rest (a slot each from those kept)
        budget = Budget("k", 6000, None)
        burst = await asyncio.gather(*(a.admit(budget, 0, roomy) for _ in range(16)))
        assert all(r.slot and r.limited is None for r in burst) and calls[:2] == ["admit", "admit"], calls
        # (sixteen leased, fifteen taken: the lease ran low, and sixteen more came in the background)
        await waiting.until(lambda: not a._refilling, "not a._refilling")
        assert calls == ["admit", "admit", "lease"] and a.leased("k") == 17 and a.refills == 1
        # a key with max_in_flight asks Redis for each, as before
        capped = Budget("c", 6000, None, max_in_flight=50)
        await asyncio.gather(*(a.admit(capped, 0, roomy) for _ in range(4)))
        assert len(calls) == 7
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_max_concurrency_holds_across_replicas_that_keep_slots(redis_server: RedisServer) -> None:
    """Three replicas take and free slots of one backend (max 16) at random, concurrently: at no moment do
    their requests hold more than 16, and at the end Redis counts what each holds plus what it keeps."""
    states = await replicas(redis_server, 3, {"b"}, heartbeat_seconds=0.2)
    sixteen = [Slotted("b", 16)]
    rng = random.Random(5)
    peak = 0

    async def worker(state: SharedState) -> None:
        nonlocal peak
        for _ in range(150):
            if (await state.admit(None, 0, sixteen)).slot:
                peak = max(peak, sum(s.holds("b") for s in states))
                await asyncio.sleep(rng.random() * 0.004)  # real time: a slot held a random moment (interleavings)
                state.settle(None, 0, "b")
            else:
                await asyncio.sleep(0.002)  # real time: a refused request's pause before it tries again

    try:
        await waiting.until(lambda: all(s.replicas == 3 for s in states), "all(s.replicas == 3 for s in states)")
        await asyncio.gather(*(worker(s) for s in states for _ in range(8)))
        await waiting.until(lambda: not any(s.pending for s in states), "not any(s.pending for s in states)")
        assert 8 <= peak <= 16, peak
        for state in states:
            assert await lease(state, "b") == state.holds("b") + state.kept("b") == state.kept("b")
    finally:
        await stop(states)


@pytest.mark.anyio
async def test_after_an_outage_the_resync_is_not_undone_by_the_releases_that_waited(
        redis_server: RedisServer) -> None:
    """Two slots held, Redis gone, one of them freed (its release waits), Redis back (empty): the resync
    writes the one still held, and the release that waited must not take it away (it would let a third in)."""
    (state,) = await replicas(redis_server, 1, {"b"})
    try:
        assert (await state.admit(None, 0, B)).slot and (await state.admit(None, 0, B)).slot
        redis_server.kill()
        with pytest.raises(StateUnavailable):
            await state.admit(None, 0, B)
        state.settle(None, 0, "b")
        assert state.pending == 1
        redis_server.start()
        await waiting.until(lambda: state.up and not state.pending, "state.up and not state.pending", within=5)
        assert await lease(state, "b") == 1
        assert (await state.admit(None, 0, B)).slot and (await state.admit(None, 0, B)).full
    finally:
        await stop([state])


# -- leased requests ----------------------------------------------------------------------------------------------
async def level(state: SharedState, key: str) -> float:
    """The requests bucket of ``key`` as Redis holds it (not refilled to now)."""
    return float(await state._redis.hget(state._bucket(key, "requests"), "l") or "nan")


@pytest.mark.anyio
async def test_a_keys_requests_and_tokens_are_leased_a_few_at_a_time_and_taken_without_a_round_trip(
        redis_server: RedisServer) -> None:
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=5.0)
    try:
        budget, free = Budget("k", 6000, None), [Slotted("x", None)]
        calls = counting(a)
        assert (await a.admit(budget, 0, free)).chosen == 0 and calls == ["admit"]
        assert a.leased("k") == 16  # (min(16, 5999 // 16))
        assert 5983 - 1 <= await level(a, "k") <= 5983  # one admitted, sixteen leased
        for _ in range(16):
            admitted = await a.admit(budget, 0, free)
            assert admitted.limited is None and admitted.chosen == 0
        assert calls == ["admit"] and a.leased("k") == 0, "sixteen without a round trip"
        # below LEASE_LOW (sixteen requests: after the first) the lease was topped up in the background: the next
        # request waits for that round trip rather than send one of its own (in a loop that never paused, it has
        # not left yet)
        assert a._refilling.keys() == {"k"}
        await a.admit(budget, 0, free)
        assert calls == ["admit", "lease"] and a.leased("k") == 15
        assert a.admissions == {"local": 16, "waited": 1, "redis": 1}
        # with a kept slot as well, a limited key's request pays no round trip at all
        sixteen = [Slotted("b", 16)]
        await a.admit(budget, 0, sixteen)
        a.settle(None, 0, "b")
        assert a.kept("b") == 2
        before = len(calls)
        assert (await a.admit(budget, 0, sixteen)).slot and len(calls) == before
        # a limit changed (a reload): what was leased under the old one is not used, but given back
        await a.admit(Budget("k", 3000, None), 0, free)
        assert calls[-1] == "admit" and len(calls) == before + 1
        # a key with tokens per minute leases tokens too: sixteen reservations' worth, then its next requests
        # take theirs from the lease (what they really use is settled against it as ever)
        tpm = Budget("t", 6000, 60_000)
        await a.admit(tpm, 10, free)
        assert a.leased("t") == 16 and a.leased("t", "tokens") == 160 and len(calls) == before + 2
        for _ in range(16):
            assert (await a.admit(tpm, 10, free)).limited is None
        assert len(calls) == before + 2 and a.leased("t", "tokens") == 0
        # topped up in the background as it ran low: sixteen requests and sixteen reservations again
        await waiting.until(lambda: not a.pending and not a._refilling, "not a.pending and not a._refilling")
        assert calls[-1] == "lease" and len(calls) == before + 3
        assert a.leased("t") == 16 and a.leased("t", "tokens") == 160
        # their settlements go into the lease: used less gives back to it, used more takes from it, and nothing
        # goes to Redis
        a.settle(tpm, -4, None)
        a.settle(tpm, -4, None)
        a.settle(tpm, 3, None)
        assert a.leased("t", "tokens") == 165 and a.pending == 0
        a.settle(tpm, 200, None)  # (more than the lease holds: settled in Redis)
        assert a.pending == 1 and a.leased("t", "tokens") == 165
        # and the lease, below sixteen requests' worth now that the key's requests use more than they reserve, is
        # topped up by sixteen requests' worth: the reservation (10) and a moving average of what was used beyond
        over = a._overuse["t"]
        assert 25 < over < 26 and a._refilling.keys() == {"t"}
        await waiting.until(lambda: not a.pending and not a._refilling, "not a.pending and not a._refilling")
        assert len(calls) == before + 4 and a.leased("t", "tokens") == 165 + 16 * (10 + 25)
        # a reservation larger than what is leased asks Redis
        assert (await a.admit(tpm, 3000, free)).limited is None and len(calls) == before + 5
        # a key with max_in_flight is checked in Redis every time, and leases nothing
        capped = Budget("c", 6000, None, max_in_flight=50)
        for _ in range(2):
            await a.admit(capped, 10, free)
        assert a.leased("c") == 0 and len(calls) == before + 7
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_leases_never_let_the_replicas_exceed_the_limit_and_stop_as_the_bucket_runs_low(
        pair: list[SharedState]) -> None:
    budget, free = Budget("k", 600, None), [Slotted("x", None)]
    for state in pair:
        state.replicas = 2  # (as their heartbeats count: each lease at most 1/32 of what is left)
    started = time.monotonic()
    results = [await pair[i % 2].admit(budget, 0, free) for i in range(700)]
    refill = 600 * (time.monotonic() - started) / 60
    admitted = sum(r.limited is None for r in results)
    assert 600 <= admitted <= 600 + refill + 1, (admitted, refill)  # real time: Redis refills the bucket meanwhile
    assert all(r.limited is None for r in results[:600])  # (nothing refused while leases sat elsewhere)
    assert pair[0].leased("k") + pair[1].leased("k") <= 1  # none taken as the bucket ran low


@pytest.mark.anyio
async def test_unused_leases_go_back_after_a_heartbeat_and_when_the_replica_stops(redis_server: RedisServer) -> None:
    running = await replicas(redis_server, 2, heartbeat_seconds=0.1)
    a, b = running
    try:
        await a.admit(Budget("k", 6000, None), 0, [Slotted("x", None)])
        assert a.leased("k") == 16
        await waiting.until(lambda: a.leased("k") == 0, "a.leased('k') == 0")
        await waiting.until(lambda: not a.pending, "not a.pending")
        assert await level(a, "k") >= 5999 - 0.5  # (given back: one used; refill on top is capped)
        await b.admit(Budget("j", 6000, None), 0, [Slotted("x", None)])
        assert b.leased("j") == 16
        running.remove(b)
        await b.stop()
        assert await level(a, "j") >= 5999 - 0.5, "given back as it stopped"
    finally:
        await stop(running)


@pytest.mark.anyio
async def test_a_busy_keys_lease_is_topped_up_ahead_so_its_requests_seldom_wait(redis_server: RedisServer) -> None:
    """Sixteen clients of one key, each sending its next request as the last ends: after the first burst (one
    round trip, the others wait for it), the lease is topped up before it runs out, and requests take from it.
    Each uses twice what it reserved, so a lease sized by reservations alone would run out twice as fast."""
    (a,) = await replicas(redis_server, 1, {"b"}, heartbeat_seconds=5.0)
    try:
        budget, roomy = Budget("k", 1_000_000_000, 1_000_000_000), [Slotted("b", 1024)]
        rng = random.Random(7)

        async def client() -> None:
            for _ in range(20):
                admitted = await a.admit(budget, 10, roomy)
                assert admitted.limited is None and admitted.slot
                await asyncio.sleep(rng.uniform(0.002, 0.006))  # real time: its service time (top-ups land meanwhile)
                a.settle(budget, 12, "b")  # (each used more than it reserved: 22 tokens)

        await asyncio.gather(*(client() for _ in range(16)))
        counts = dict(a.admissions)
        assert sum(counts.values()) == 320
        assert counts["redis"] <= 4, counts
        # the first burst's fifteen, and a few more as top-ups land late (here 20-30 in all; without top-ups 122)
        assert counts["waited"] <= 15 + 64, counts
        assert counts["local"] >= 320 - 15 - 64 - 4 and a.refills >= 320 // 16, (counts, a.refills)
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_a_top_up_that_brings_nothing_is_not_tried_again_for_a_heartbeat(redis_server: RedisServer) -> None:
    """As the bucket runs low a top-up brings little (each lease at most 1/16 of what is left): then no top-up
    goes with each request; they take what their own round trips lease, and ask Redis as it runs out."""
    (a,) = await replicas(redis_server, 1, heartbeat_seconds=5.0)
    try:
        calls, budget, free = counting(a), Budget("k", 40, None), [Slotted("x", None)]
        results = []
        for _ in range(45):
            results.append(await a.admit(budget, 0, free))
            await waiting.until(lambda: not a._refilling, "not a._refilling")
        assert 40 <= sum(r.limited is None for r in results) <= 41  # (the bucket refills 0.67 a second)
        # (the first admission leased 38 // 16 = 2; the top-up after its first take brought 37 // 16 = 2 of the
        # 16 it asked for)
        assert "k" in a._dry and calls[:2] == ["admit", "lease"] and calls.count("lease") == 1, calls
        assert len(calls) > 30, calls
    finally:
        await stop([a])


@pytest.mark.anyio
async def test_a_drain_survives_redis_losing_its_data_and_an_undrain_after_it_still_holds(
        redis_server: RedisServer) -> None:
    """QA: drained through one replica, then Redis restarted empty: the replicas read the empty set as an undrain
    (once both, once one of them: they disagreed, and the drained backend got traffic)."""
    a, b = await replicas(redis_server, 2)
    seen: dict[str, dict[str, bool]] = {"a": {}, "b": {}}
    a.on_drained(lambda name, drained: seen["a"].__setitem__(name, drained))
    b.on_drained(lambda name, drained: seen["b"].__setitem__(name, drained))
    try:
        await waiting.until(lambda: a.replicas == 2 and b.replicas == 2, "a.replicas == 2 and b.replicas == 2")
        await listening(a, b)
        a.set_drained("x", True)
        await waiting.until(lambda: seen["b"].get("x") is True, "seen['b'].get('x') is True")
        await heartbeats(a, b)  # (both have read it)
        redis_server.kill()
        await waiting.until(lambda: not a.up and not b.up, "not a.up and not b.up", within=5)
        redis_server.start()  # empty
        await waiting.until(lambda: a.up and b.up, "a.up and b.up", within=5)
        await heartbeats(a, b, count=3)  # several of each, on the empty Redis
        assert seen["a"].get("x", True) is True and seen["b"]["x"] is True
        members = await a._redis.smembers(a._drained_key)
        assert {m.decode() for m in members} == {"x"}, "written back for replicas that start later"
        b.set_drained("x", False)  # and an operator's undrain after it is not written over
        await waiting.until(lambda: seen["a"].get("x") is False, "seen['a'].get('x') is False")
        await heartbeats(a, b, count=3)  # (none of them writes the drain back)
        assert seen["a"]["x"] is False and not await a._redis.smembers(a._drained_key)
    finally:
        await stop([a, b])
