"""The admissions' own Redis connection (gateway.state.resp) against a real redis-server: pipelined replies in
their commands' order with error replies in place, a password and a database from the URL, a caller that gives
up without putting later replies out of step, and a Redis that dies and comes back."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from gateway.state.resp import RespConnection, RespError
from tests.state.conftest import RedisServer
from tests.waiting import until_true

pytestmark = pytest.mark.system


def connection(url: str) -> RespConnection:
    pool = redis.asyncio.BlockingConnectionPool.from_url(url)
    assert RespConnection.supports(url)
    return RespConnection(dict(pool.connection_kwargs), timeout=2.0)


def test_what_it_stands_in_for() -> None:
    assert RespConnection.supports("redis://h:1/0") and RespConnection.supports("unix:///run/r.sock?db=2")
    assert not RespConnection.supports("rediss://h:1/0")  # TLS stays with redis-py
    assert not RespConnection.supports("redis://h:1/0?socket_keepalive=true")


@pytest.mark.anyio
async def test_pipelined_replies_come_back_in_order_with_errors_in_place(redis_server: RedisServer) -> None:
    conn = connection(redis_server.url)
    try:
        replies = await conn.execute([("SET", "k", 5), ("INCRBY", "k", 2), ("EVALSHA", "0" * 40, 0),
                                      ("GET", "k"), ("EVAL", "return {1, 'x'}", 0)])
        assert replies[:2] == [b"OK", 7]
        assert isinstance(replies[2], RespError) and replies[2].no_script
        assert replies[3:] == [b"7", [1, b"x"]]
        # many callers at once, each its own answer
        answers = await asyncio.gather(*(conn.execute([("ECHO", str(i))]) for i in range(200)))
        assert [a[0] for a in answers] == [str(i).encode() for i in range(200)]
    finally:
        conn.close()


@pytest.mark.anyio
async def test_a_password_and_a_database_from_the_url(redis_server: RedisServer) -> None:
    admin = redis.asyncio.Redis.from_url(redis_server.url)
    await admin.config_set("requirepass", "s3cret")
    try:
        conn = connection(f"redis://:s3cret@127.0.0.1:{redis_server.port}/3")
        assert await conn.execute([("SET", "in-db-3", "yes")]) == [b"OK"]
        conn.close()
        db3 = redis.asyncio.Redis.from_url(f"redis://:s3cret@127.0.0.1:{redis_server.port}/3")
        assert await db3.get("in-db-3") == b"yes"
        await db3.aclose()
        wrong = connection(f"redis://:nope@127.0.0.1:{redis_server.port}/0")
        with pytest.raises(ConnectionError, match="set-up"):
            await wrong.execute([("PING",)])
    finally:
        fix = redis.asyncio.Redis.from_url(f"redis://:s3cret@127.0.0.1:{redis_server.port}/0")
        await fix.config_set("requirepass", "")
        await fix.aclose()
        await admin.aclose()


@pytest.mark.anyio
async def test_a_caller_that_gives_up_leaves_the_next_replies_in_step(redis_server: RedisServer) -> None:
    conn = connection(redis_server.url)
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await conn.execute([("BLPOP", "nothing-here", 0.3)])  # answers nil after 0.3 s
        assert await conn.execute([("PING",)]) == [b"PONG"]  # not the late nil
    finally:
        conn.close()


@pytest.mark.anyio
async def test_redis_dying_fails_what_is_in_flight_and_the_next_command_connects_again(
        redis_server: RedisServer) -> None:
    conn = connection(redis_server.url)
    try:
        assert await conn.execute([("PING",)]) == [b"PONG"]
        pending = asyncio.ensure_future(conn.execute([("BLPOP", "nothing-here", 5)]))
        admin = redis.asyncio.Redis.from_url(redis_server.url)

        async def blocked() -> bool:
            return bool((await admin.info("clients"))["blocked_clients"] == 1)

        try:
            await until_true(blocked, "the BLPOP blocked in Redis")
        finally:
            await admin.aclose()
        redis_server.kill()
        assert isinstance((await pending)[0], ConnectionError)
        with pytest.raises(OSError):  # nothing listens: connecting fails (ConnectionRefusedError)
            await conn.execute([("PING",)])
        redis_server.start()
        assert await conn.execute([("PING",)]) == [b"PONG"]
    finally:
        conn.close()


def test_the_port_is_free_after_close(redis_server: RedisServer) -> None:
    # (the protocol holds no socket after close: the server sees its client go)
    async def go() -> None:
        conn = connection(redis_server.url)
        await conn.execute([("CLIENT", "SETNAME", "resp-test")])
        conn.close()
        admin = redis.asyncio.Redis.from_url(redis_server.url)

        async def gone() -> bool:
            return not any(c.get("name") == "resp-test" for c in await admin.client_list())

        try:
            await until_true(gone, "the server seeing its client go")
        finally:
            await admin.aclose()

    asyncio.run(go())
