"""Priority holds across replicas: two gateway processes sharing one real redis-server in front of one emulated
vLLM server with two slots. One replica queues a backlog of `standard` requests; `critical` requests sent
later to the other replica get the next slots freed, although the slots are freed on the first replica, whose
own waiters would otherwise take them before the second replica even hears of them."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port_block
from tests.state.conftest import RedisServer, start_replica
from tests.waiting import until_true, wait_until

pytestmark = pytest.mark.system

KEYS = {"batch": "sk-batch", "app": "sk-app"}
SLOTS = 2
MAX_TOKENS = 80  # about 0.46 s each at the emulated vLLM's 175 tokens/s
ARRIVALS = itertools.count()  # the order of the streams' first lines


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetThread, list[str]]]:
    tmp: Path = tmp_path_factory.mktemp("priority-replicas")
    base = free_port_block(3)
    redis = RedisServer(base, tmp).start()
    with FleetThread([SimSpec(engine="vllm", model="m", name="m0")]) as fleet:
        keys = [{"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(),
                 "priority": "critical" if name == "app" else "standard"} for name, secret in KEYS.items()]
        procs, urls = [], []
        try:
            for i in range(2):
                proc, url = start_replica(tmp, i, base + 1 + i, redis, auth={"keys": keys}, backends=[
                    {"name": "m0", "engine": "vllm", "url": fleet.fleet.servers[0].url, "max_concurrency": SLOTS}])
                procs.append(proc)
                urls.append(url)
            for url in urls:
                procs[urls.index(url)].wait_http(url + "/v1/models",
                                                 headers={"Authorization": f"Bearer {KEYS['batch']}"})
            counted_each_other(redis)  # (a replica alone tells peers nothing)
            yield fleet, urls
        finally:
            for proc in procs:
                proc.stop()
            redis.kill()


def counted_each_other(store: RedisServer) -> None:
    """Until each replica has heartbeated twice with the other in Redis's set of replicas (a heartbeat writes its
    replica's score there, and reads how many are alive): each then counts two."""
    client = redis.Redis.from_url(store.url)

    def scores() -> dict[Any, Any]:
        pairs: Any = client.zrange("gateway:replicas", 0, -1, withscores=True)  # replica -> its last heartbeat
        return dict(pairs)

    def a_heartbeat_of_each() -> None:
        seen = scores()
        wait_until(lambda: all(scores().get(replica) != score for replica, score in seen.items()),
                   "a heartbeat of each replica")

    try:
        wait_until(lambda: len(scores()) == 2, "both replicas in the set")
        a_heartbeat_of_each()
        a_heartbeat_of_each()
    finally:
        client.close()


async def first_token_at(client: httpx.AsyncClient, url: str, key: str) -> int:
    """When the stream's first line arrived, as the order of all first lines (the streams share one event loop);
    the stream is read to its end."""
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", timeout=60,
                             headers={"authorization": f"Bearer {KEYS[key]}"},
                             json={"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                   "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:"):
                first = next(ARRIVALS)
    assert first is not None
    return first


def test_critical_requests_on_one_replica_go_before_a_standard_backlog_on_another(
        replicas: tuple[FleetThread, list[str]]) -> None:
    fleet, (a, b) = replicas

    async def scenario() -> tuple[list[int], list[int]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            backlog = [asyncio.create_task(first_token_at(client, a, "batch")) for _ in range(8)]

            async def six_wait() -> bool:
                text = (await client.get(a + "/metrics")).text
                return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("gateway_queue_depth{")) == 6

            await until_true(six_wait, "two run, six wait on replica a")
            urgent = [asyncio.create_task(first_token_at(client, b, "app")) for _ in range(3)]
            return list(await asyncio.gather(*backlog)), list(await asyncio.gather(*urgent))

    standard, critical = asyncio.run(scenario())
    queued = sorted(standard)[SLOTS:]  # (the first two took the free slots at once)
    before = [t for t in queued if t < max(critical)]
    # each freed slot went to a critical request while one waited: at most one standard slipped in (a slot freed
    # in the instant before the other replica's announcement arrived)
    assert len(before) <= 1, (f"{len(before)} of the standard backlog started before the last critical request",
                              sorted(standard), sorted(critical))
    assert fleet.fleet["m0"].stats.peak_requests <= SLOTS
