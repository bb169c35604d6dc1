"""What the replicas tell each other through Redis (peer messages: drains, backends, routing changes, reloads,
sessions, prompt blocks; freed slots; backends wanted) is sealed with a secret they share and Redis does not
hold: whoever else can PUBLISH there (the sweep's redis-inject.py, redis-envexfil.py, redis-harvest.py) changes
nothing, a message replayed or stale is dropped, and bytes that are not a message end nothing."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import redis.asyncio

from gateway.config import StateSettings
from gateway.state import SharedState, Slotted
from gateway.state.sealing import Rejected, Seal, fleet_secret
from tests.state.conftest import RedisServer
from tests.state.test_shared import settings, stop
from tests.waiting import until, until_true

pytestmark = pytest.mark.system

FLEET = b"the fleet's own secret"
EVIL = {"name": "evil", "engine": "openai", "url": "http://127.0.0.1:9", "models": ["m1"], "api_key_env": "HOME"}


async def sealed(server: RedisServer, names: list[str], secret: bytes = FLEET) -> list[SharedState]:
    """Replicas ``names`` started, once Redis counts their subscriptions to every channel."""
    out = [SharedState(settings(server, heartbeat_seconds=5.0), replica_id=name, secret=secret) for name in names]
    channels = (out[0]._peers_channel, out[0]._freed_channel, out[0]._wanted_channel)
    client = redis.asyncio.Redis.from_url(server.url)

    async def subscribers() -> int:
        return min(count for _, count in await client.pubsub_numsub(*channels))

    try:
        before = await subscribers()
        for state in out:
            state.slotted = lambda: {"b"}
            await state.start()
            state.replicas = 3  # (as if the heartbeats had counted them: a lone replica publishes nothing)

        async def subscribed() -> bool:
            return await subscribers() >= before + len(out)

        await until_true(subscribed, "the replicas subscribed to their channels")
    finally:
        await client.aclose()
    return out


@pytest.fixture
async def attacker(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def heard(state: SharedState) -> list[Any]:
    """What ``state`` applies of the others' messages, in order."""
    got: list[Any] = []
    for topic in ("backends", "routing", "reload", "session"):
        state.subscribe(topic, lambda payload, topic=topic: got.append((topic, payload)))
    state.on_drained(lambda backend, drained: got.append(("drain", backend, drained)))
    state.on_freed(lambda backend: got.append(("freed", backend)))
    return got


@pytest.mark.anyio
async def test_what_anyone_else_publishes_on_the_replicas_channels_changes_nothing(
        redis_server: RedisServer, attacker: redis.asyncio.Redis) -> None:
    a, b = await sealed(redis_server, ["r0", "r1"])
    (other,) = await sealed(redis_server, ["r2"], secret=b"another fleet's secret")
    got = heard(b)
    try:
        assert (await a.admit(None, 0, [Slotted("b", 16)])).slot and a.kept("b") == 2
        forged = [("gateway:peers", [["backends", ["add", EVIL, "key ops"]]]),  # redis-inject.py, -envexfil.py
                  ("gateway:peers", [["drain", ["b", True]]]),
                  ("gateway:peers", [["routing", [{"session_header": "authorization"}, "key ops"]]]),  # -harvest.py
                  ("gateway:peers", [["reload", "key ops"]])]
        for channel, batch in forged:
            await attacker.publish(channel, b"attacker\0" + msgpack.packb(batch))
            await attacker.publish(channel, b"r0\0" + msgpack.packb(batch))  # (in a replica's name)
        await attacker.publish("gateway:freed", b"b\0r0")  # (the free-slot and wanted messages as they were)
        await attacker.publish("gateway:wanted", b"r1\0b")  # (it would have had r0 give back its kept slots)
        other.publish("drain", ["b", True])  # a replica sealing with another secret is not heard either
        await until(lambda: b.rejected["unauthenticated"] == 10 and a.rejected["unauthenticated"] == 7,
                    "every forged message turned away")
        a.publish("routing", [{"policy": "round-robin"}, "ops"])  # the real ones, after them all
        a.settle(None, 0, "b")  # (it keeps two already: this slot goes back, announced as freed)
        await until(lambda: len(got) >= 2, "the real messages heard")
        assert sorted(got) == [("freed", "b"), ("routing", [{"policy": "round-robin"}, "ops"])]
        assert a.kept("b") == 2, "a forged wanted message took no kept slot back"
        # (each skips what heads like its own: b the four in r0's name, a those in r1's and its own)
        assert b.rejected["unauthenticated"] == 10 and a.rejected["unauthenticated"] == 7
        assert a.up and b.up and b.errors["subscribe"] == 0
    finally:
        await stop([a, b, other])


@pytest.mark.anyio
async def test_a_message_replayed_or_stamped_long_ago_is_dropped(redis_server: RedisServer,
                                                                 attacker: redis.asyncio.Redis) -> None:
    """Whoever can SUBSCRIBE can record a replica's messages (an operator's drain, then its undrain) and send
    them again later: a replay is no newer than the last message of its sender, and is dropped."""
    a, b = await sealed(redis_server, ["r0", "r1"])
    got = heard(b)
    recorder = attacker.pubsub()
    await recorder.subscribe("gateway:peers")
    try:
        a.set_drained("b", True)
        await until(lambda: got == [("drain", "b", True)], "the drain heard")
        a.set_drained("b", False)
        await until(lambda: got[-1] == ("drain", "b", False), "the undrain heard")
        recorded = []
        while len(recorded) < 2:
            message = await recorder.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                recorded.append(message["data"])
        await attacker.publish("gateway:peers", recorded[0])  # the drain again
        # sealed with the fleet's secret (as one who had it once), but stamped two minutes ago
        old = Seal(FLEET, "r0", clock=lambda: time.time() - 120)
        await attacker.publish("gateway:peers", old.seal(b"gateway:peers", msgpack.packb([["drain", ["b", True]]])))
        a.publish("reload", "ops")
        await until(lambda: got[-1] == ("reload", "ops"), "the reload heard")
        assert got == [("drain", "b", True), ("drain", "b", False), ("reload", "ops")]
        assert b.rejected["replayed"] == 1 and b.rejected["stale"] == 1
    finally:
        await recorder.aclose()
        await stop([a, b])


@pytest.mark.anyio
async def test_a_message_sealed_before_a_replica_listened_is_dropped(redis_server: RedisServer,
                                                                    attacker: redis.asyncio.Redis) -> None:
    """The sweep (rec.py, replay.py): an operator's drain of a backend and its undrain recorded, a worker
    killed and started again, the drain replayed within the minute: the new worker had heard nothing of its
    sender, took the copy for new, and stayed drained (the shared set never changed). A replica or worker drops
    what was sealed before it began to listen."""
    a, b = await sealed(redis_server, ["r0", "r1"])
    recorder = attacker.pubsub()
    await recorder.subscribe("gateway:peers")
    late: list[SharedState] = []
    try:
        got_b = heard(b)
        a.set_drained("good", True)
        await until(lambda: got_b == [("drain", "good", True)], "the drain heard")
        a.set_drained("good", False)
        await until(lambda: got_b[-1] == ("drain", "good", False), "the undrain heard")
        a.publish("routing", [{"policy": "round-robin"}, "ops"])
        await until(lambda: got_b[-1] == ("routing", [{"policy": "round-robin"}, "ops"]), "the routing change heard")
        recorded: list[bytes] = []
        while len(recorded) < 3:
            message = await recorder.get_message(ignore_subscribe_messages=True, timeout=1.0)
            if message is not None:
                recorded.append(message["data"])
        late = await sealed(redis_server, ["r2"])  # (the worker started again)
        got = heard(late[0])
        for message in recorded:  # the drain (the sweep's), and the rest of what it recorded
            await attacker.publish("gateway:peers", message)
        a.publish("reload", "ops")  # (after them: what the new worker hears from now on)
        await until(lambda: ("reload", "ops") in got, "the reload heard by the new worker")
        assert got == [("reload", "ops")] and late[0].rejected["replayed"] == 3
        assert got_b[-1] == ("reload", "ops") and b.rejected["replayed"] == 3
    finally:
        await recorder.aclose()
        await stop([a, b, *late])


@pytest.mark.anyio
async def test_a_drain_follows_the_shared_set_not_the_message(redis_server: RedisServer) -> None:
    """A replica's drain message that passes the seal but changed nothing in the shared set (a replica of the
    version before whose write Redis refused, or a copy of a message sent while the receiver's subscription was
    down) drains nothing: a message only says the set changed, and the set is what every replica applies."""
    a, b = await sealed(redis_server, ["r0", "r1"])
    got = heard(b)
    try:
        a.publish("drain", ["x", True])  # (what the versions before sent, the set left as it was)
        a.set_drained("y", True)
        await until(lambda: ("drain", "y", True) in got, "the drain of y heard")
        assert got == [("drain", "y", True)]
        assert {m.decode() for m in await b._redis.smembers("gateway:drained")} == {"y"}
    finally:
        await stop([a, b])


@pytest.mark.anyio
async def test_bytes_that_are_not_a_message_end_nothing(redis_server: RedisServer,
                                                        attacker: redis.asyncio.Redis) -> None:
    """Invalid UTF-8 on the free-slot or wanted channel used to end the subscriber with a traceback and take
    the state down; even sealed (by one who holds the secret), it is read as what it says, and nothing ends."""
    a, b = await sealed(redis_server, ["r0", "r1"])
    got = heard(b)
    fake = Seal(FLEET, "r9")
    try:
        for channel in ("gateway:freed", "gateway:wanted", "gateway:peers"):
            await attacker.publish(channel, b"\xff\xfe\0\xfd")
            await attacker.publish(channel, fake.seal(channel.encode(), b"\xff\xfe\0\xfd"))
        await attacker.publish("gateway:peers", fake.seal(b"gateway:peers", msgpack.packb([1, [2]])))
        a.settle(None, 0, "b")  # (a freed slot, announced)
        await until(lambda: ("freed", "b") in got, "the freed slot heard")
        assert got == [("freed", "\ufffd\ufffd\0\ufffd"), ("freed", "b")]
        assert b.errors["subscribe"] == 0 and b.up and a.up
        assert b.rejected["unauthenticated"] == 3 and b.rejected["malformed"] == 2
    finally:
        await stop([a, b])


def test_a_seal_binds_its_channel_and_body() -> None:
    seal, receiver = Seal(FLEET, "r0"), Seal(FLEET, "r1")
    message = seal.seal(b"gateway:peers", b"body")
    assert receiver.open(b"gateway:peers", message).body == b"body"
    for changed in (message[:-1] + b"x", message.replace(b"r0", b"r3", 1)):
        with pytest.raises(Rejected, match="unauthenticated"):
            receiver.open(b"gateway:peers", changed)
    with pytest.raises(Rejected, match="unauthenticated"):
        receiver.open(b"gateway:freed", message)  # (moved to another channel)
    with pytest.raises(Rejected, match="unauthenticated"):
        Seal(b"another", "r1").open(b"gateway:peers", message)


def test_a_replica_of_the_version_before_sealing_reads_sealed_messages_as_text_it_ignores() -> None:
    """During a rolling upgrade the replicas not yet upgraded still subscribe: they decoded a free-slot or wanted
    message as UTF-8 (bytes that were not ended their subscriber, and took their state down each time) and read
    a peer message's batch after its first NUL (which then is not msgpack: ignored)."""
    seal = Seal(FLEET, "host-1234-abcdef")
    for body in (b"good", b"*", b"a\0b", "gpu-\u00e9".encode()):
        for _ in range(200):
            message = seal.seal(b"gateway:freed", body)
            backend = message.decode().partition("\0")[0]  # (what the older replicas did)
            assert backend == "host-1234-abcdef"  # (a backend it does not have: nothing happens)
    with pytest.raises((ValueError, msgpack.UnpackException)):
        msgpack.unpackb(seal.seal(b"gateway:peers", msgpack.packb([["drain", ["b", True]]])).partition(b"\0")[2])


def test_the_secret_is_the_environments_or_derived_from_what_redis_does_not_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    digests = [hashlib.sha256(b"sk-ops").hexdigest()]
    plain = StateSettings(url="redis://redis:6379/0")
    assert fleet_secret(plain) is None, "nothing secret to derive it from"
    keyed = fleet_secret(plain, digests)
    assert keyed is not None and keyed == fleet_secret(plain, list(reversed(digests + digests)))
    assert fleet_secret(plain, [hashlib.sha256(b"sk-other").hexdigest()]) != keyed
    with_password = fleet_secret(StateSettings(url="redis://:pw@redis:6379/0"))
    assert with_password is not None and with_password != fleet_secret(StateSettings(url="redis://:pw2@redis/0"))
    monkeypatch.setenv("GATEWAY_STATE_SECRET", "s3cret")
    assert fleet_secret(StateSettings(url=plain.url, secret_env="GATEWAY_STATE_SECRET"), digests) == b"s3cret"
    monkeypatch.delenv("GATEWAY_STATE_SECRET")
    with pytest.raises(ValueError, match="GATEWAY_STATE_SECRET is not set"):
        StateSettings(url=plain.url, secret_env="GATEWAY_STATE_SECRET")
