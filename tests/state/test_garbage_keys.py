"""One corrupt key in Redis (written by anyone who can reach it, or by a bug) fails or repairs that key's own
operations, never the shared state: a bucket set as a string used to take the state down for every key (503
with on_failure closed, every limit lifted with open), a count that is not a number failed every heartbeat."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio

from gateway.state import Budget, SharedState, Slotted, StateUnavailable
from gateway.state.shared import key_place_of
from tests.state.conftest import RedisServer
from tests.state.test_shared import replicas, stop, until

pytestmark = pytest.mark.system

LIM = Budget("lim", 5, None)
TOK = Budget("tok", None, 60)
CAP = Budget("cap", None, None, max_in_flight=2)
OTHER = Budget("other", 5, None)
FOUR = [Slotted("b", 4)]  # (too few slots to keep any: each admission asks Redis)

GARBAGE = {
    "a bucket that is a string": ["SET", "gateway:bucket:requests:lim", "garbage"],
    "a bucket's time that is no number": ["HSET", "gateway:bucket:requests:lim", "l", "1", "t", "yesterday"],
    "a bucket at minus infinity": ["HSET", "gateway:bucket:requests:lim", "l", "-inf", "t", "0"],
    "a tokens bucket that is not a number": ["HSET", "gateway:bucket:tokens:tok", "l", "nan", "t", "nan"],
    "another replica's count that is no number": ["HSET", "gateway:inflight:b", "evil", "abc"],
    "its own count that is no number": ["HSET", "gateway:inflight:key:cap", "r0", "1.5e"],
    "an in-flight hash that is a list": ["EVAL", "redis.call('DEL', KEYS[1]) redis.call('RPUSH', KEYS[1], 'x')", "1",
                                         "gateway:inflight:b"],
    "the replicas that are a string": ["SET", "gateway:replicas", "garbage"],
    "the drained backends that are a string": ["SET", "gateway:drained", "garbage"],
}


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def limits_of(state: SharedState) -> dict[str, list[Any]]:
    """What the next requests get: each limited key's, and slots of the backend."""
    return {"lim": [(await state.admit(LIM, 0, [])).limited for _ in range(6)],
            "tok": [(await state.admit(TOK, 25, [])).limited for _ in range(4)],
            "cap": [(await state.admit(CAP, 0, [])).limited for _ in range(3)],
            "other": [(await state.admit(OTHER, 0, [])).limited for _ in range(6)],
            "slots": [(await state.admit(None, 0, FOUR)).slot for _ in range(4)]}


@pytest.mark.parametrize("command", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.anyio
async def test_a_corrupt_key_is_repaired_and_no_other_key_notices(redis_server: RedisServer,
                                                                  admin: redis.asyncio.Redis,
                                                                  command: list[str]) -> None:
    a, b = await replicas(redis_server, 2, {"b", key_place_of("cap")})
    a.on_drained(lambda backend, drained: None)  # (so that its heartbeat reads the drained backends too)
    try:
        await admin.execute_command(*command)
        assert (await b.admit(None, 0, FOUR)).slot  # the other replica holds one of the four slots ...
        await until(lambda: a.remote_in_flight("b") == 1)  # ... which a's heartbeats, going on, read
        # every key's limits hold, the corrupt key's as if it were new (a bucket full, a count nothing)
        assert await limits_of(a) == {
            "lim": [None] * 5 + ["requests"], "tok": [None, None, None, "tokens"], "cap": [None, None, "in_flight"],
            "other": [None] * 5 + ["requests"], "slots": [True, True, True, False]}
        assert a.up and b.up
        assert a.errors["admit"] == a.errors["heartbeat"] == b.errors["heartbeat"] == 0
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_a_key_redis_refuses_fails_its_own_requests_alone(redis_server: RedisServer,
                                                               admin: redis.asyncio.Redis) -> None:
    """A command Redis answers with an error (here an ACL that denies one key's bucket; as well a script's
    error on data it cannot read) fails that request as on_failure says, counted; the state stays up."""
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "&*", "+@all", "~gateway:[^b]*",
                                "~gateway:bucket:tokens:*", "~gateway:bucket:requests:[^l]*")
    (state,) = await replicas(redis_server, 1, {"b"}, url=f"redis://gw:pw@127.0.0.1:{redis_server.port}/0")
    try:
        with pytest.raises(StateUnavailable):
            await state.admit(LIM, 0, [])
        assert state.errors["admit"] == 1 and state.up
        assert [(await state.admit(OTHER, 0, [])).limited for _ in range(6)] == [None] * 5 + ["requests"]
        assert (await state.admit(None, 0, FOUR)).slot and state.up
    finally:
        await stop([state])
