"""What the limits keep in a real redis-server is never lost: a key's debt outlives any expiry, its buckets are
never what Redis evicts, and the limits' scripts run on in a Redis past its maxmemory."""

from __future__ import annotations

import logging
import signal
from collections.abc import AsyncIterator

import pytest
import redis.asyncio

from gateway.state import Budget
from tests.state.conftest import RedisServer
from tests.state.test_shared import replicas, stop, until

pytestmark = pytest.mark.system


@pytest.fixture
async def admin(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def rewind(admin: redis.asyncio.Redis, bucket: str, ms: int) -> None:
    """As if ``ms`` had passed since the bucket was last written (its stored time moved back; Redis's clock, and
    the key's TTL, are left as they are)."""
    written = int(await admin.hget(bucket, "t") or 0)
    await admin.hset(bucket, "t", written - ms)


@pytest.mark.anyio
async def test_a_tokens_overrun_is_owed_until_it_has_refilled(redis_server: RedisServer,
                                                              admin: redis.asyncio.Redis) -> None:
    """A 2,000 tokens/min key whose requests used 1.9M tokens owes them for ~16 hours, as the in-process buckets
    have it: its bucket must not vanish before it refilled (it used to expire two minutes after its last write,
    and the debt with it). Checked without waiting: the bucket carries no TTL at all, and two minutes and ten
    seconds on it is still ~15.8 hours from admitting anything."""
    a, b = await replicas(redis_server, 2)
    try:
        budget = Budget("heavy", None, 2000)
        bucket = "gateway:bucket:tokens:heavy"
        # one request reserving more than the bucket holds is admitted while the bucket is positive ...
        assert (await a.admit(budget, 200_000, [])).limited is None
        assert await admin.pttl(bucket) == -1, "the bucket in debt carries no expiry"
        # ... and its settlement, 1.9M tokens really used, puts the key deeper in debt
        a.settle(budget, 1_900_000 - 200_000, None)
        await until(lambda: not a.pending)
        assert await admin.pttl(bucket) == -1
        assert float(await admin.hget(bucket, "l") or 0) < -1_890_000
        await rewind(admin, bucket, 130_000)
        refused = await b.admit(budget, 1, [])  # (the other replica: it holds no lease of the key)
        assert refused.limited == "tokens"
        owed = 1_900_000 - 2000 - 130 * 2000 / 60  # tokens still owed
        assert refused.retry_after == pytest.approx(owed / (2000 / 60), rel=0.01)  # ~15.8 hours
        assert await admin.pttl(bucket) == -1, "a refusal writes nothing, and sets no expiry either"
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_a_bucket_an_older_gateway_wrote_with_an_expiry_loses_it_on_the_next_write(
        redis_server: RedisServer, admin: redis.asyncio.Redis) -> None:
    (state,) = await replicas(redis_server, 1)
    try:
        bucket = "gateway:bucket:requests:old"
        await admin.hset(bucket, mapping={"l": "3", "t": "0"})
        await admin.pexpire(bucket, 120_000)
        await rewind(admin, bucket, 0)
        assert (await state.admit(Budget("old", 60, None, max_in_flight=10), 0, [])).limited is None
        assert await admin.pttl(bucket) == -1
    finally:
        await stop([state])


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
@pytest.mark.anyio
async def test_limits_hold_in_a_redis_past_its_maxmemory(redis_server: RedisServer, admin: redis.asyncio.Redis,
                                                         policy: str) -> None:
    """Redis past its maxmemory with nothing it may evict left (under noeviction it evicts nothing; under
    volatile-lru only keys with a TTL): admissions, settlements and heartbeats still run, the state stays up,
    and a 5 requests/min key is admitted exactly 5 times; its bucket is never evicted."""
    a, b = await replicas(redis_server, 2)
    try:
        budget = Budget("limited", 5, None)
        tokens = Budget("tokens", None, 1000)
        assert [(await a.admit(budget, 0, [])).limited for _ in range(3)] == [None] * 3
        await admin.config_set("maxmemory-policy", policy)
        for i in range(200):  # what may be evicted: keys with a TTL
            await admin.set(f"volatile:{i}", b"x" * 10_000, px=3_600_000)
        await admin.set("filler", b"x" * 3_000_000)  # and what may not
        # past it by more than all that may be evicted
        await admin.config_set("maxmemory", str((await admin.info("memory"))["used_memory"] - 2_500_000))
        results = [(await b.admit(budget, 0, [])).limited for _ in range(4)]
        assert results == [None, None, "requests", "requests"]
        assert await admin.exists("gateway:bucket:requests:limited") == 1 and await admin.pttl(
            "gateway:bucket:requests:limited") == -1
        assert (await a.admit(tokens, 900, [])).limited is None
        a.settle(tokens, 500, None)  # used 1,400: the bucket owes 400
        await until(lambda: not a.pending)
        assert (await b.admit(tokens, 1, [])).limited == "tokens"
        beats = a.errors["heartbeat"]
        await until(lambda: a.replicas == 2 and b.replicas == 2)
        for state in (a, b):
            assert state.up and state.fail_open == 0 and state.errors["admit"] == 0 and state.errors["settle"] == 0
        assert a.errors["heartbeat"] == beats == 0
        used, limit = (await admin.info("memory"))["used_memory"], int((await admin.config_get("maxmemory"))[
            "maxmemory"])
        assert used > limit, "Redis really was past its maxmemory"
        evicted = (await admin.info("stats"))["evicted_keys"]  # (a settlement's id carries a TTL too)
        assert evicted >= 200 if policy == "volatile-lru" else evicted == 0
        assert await admin.exists("filler") == 1, "what carries no TTL is never evicted"
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_a_policy_that_evicts_limits_is_warned_about_at_start_and_when_redis_answers_again(
        redis_server: RedisServer, admin: redis.asyncio.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """allkeys-* may evict a key's bucket (its debt forgiven) or a backend's in-flight count: unsupported, and
    said so at start and each time Redis answers again (it may have been configured anew); a Redis that does
    not let its configuration be read (a managed one) gets no word."""
    caplog.set_level(logging.WARNING, logger="gateway.state")
    await admin.config_set("maxmemory-policy", "allkeys-lru")
    (state,) = await replicas(redis_server, 1, timeout_ms=100)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]

    try:
        await until(lambda: len(warnings()) == 1)
        assert "allkeys-lru" in warnings()[0] and "volatile-lru or noeviction" in warnings()[0]
        await admin.config_set("maxmemory-policy", "allkeys-lfu")
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)  # (long enough for a heartbeat to time out)
        try:
            await until(lambda: not state.up)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await until(lambda: state.up and len(warnings()) == 2)
        assert "allkeys-lfu" in warnings()[1]
    finally:
        await stop([state])
    await admin.execute_command("ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", "-config")
    caplog.clear()
    (refused,) = await replicas(redis_server, 1, url=f"redis://gw:pw@127.0.0.1:{redis_server.port}/0")
    try:
        await until(lambda: refused.up and not refused._background)  # (its look at the policy is done)
        assert warnings() == [] and refused.errors == dict.fromkeys(refused.errors, 0)
    finally:
        await stop([refused])
