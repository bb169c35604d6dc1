"""Priority holds across replicas: two gateway processes sharing one real redis-server in front of one emulated
vLLM server with two slots. One replica queues a backlog of `standard` requests; `critical` requests sent
later to the other replica get the next slots freed, although the slots are freed on the first replica, whose
own waiters would otherwise take them before the second replica even hears of them."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port_block
from tests.state.conftest import RedisServer, start_replica

pytestmark = pytest.mark.system

KEYS = {"batch": "sk-batch", "app": "sk-app"}
SLOTS = 2
MAX_TOKENS = 80  # about 0.46 s each at the emulated vLLM's 175 tokens/s


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
            time.sleep(1.0)  # five heartbeats: each counts the other (a replica alone tells peers nothing)
            yield fleet, urls
        finally:
            for proc in procs:
                proc.stop()
            redis.kill()


async def first_token_at(client: httpx.AsyncClient, url: str, key: str) -> float:
    """When the stream's first line arrived (time.monotonic()); the stream is read to its end."""
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", timeout=60,
                             headers={"authorization": f"Bearer {KEYS[key]}"},
                             json={"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                   "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.monotonic()
    assert first is not None
    return first


def test_critical_requests_on_one_replica_go_before_a_standard_backlog_on_another(
        replicas: tuple[FleetThread, list[str]]) -> None:
    fleet, (a, b) = replicas

    async def scenario() -> tuple[list[float], list[float]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=32)) as client:
            backlog = [asyncio.create_task(first_token_at(client, a, "batch")) for _ in range(8)]
            await asyncio.sleep(0.15)  # two run, six wait on replica a
            urgent = [asyncio.create_task(first_token_at(client, b, "app")) for _ in range(3)]
            return list(await asyncio.gather(*backlog)), list(await asyncio.gather(*urgent))

    standard, critical = asyncio.run(scenario())
    queued = sorted(standard)[SLOTS:]  # (the first two took the free slots at once)
    before = [t for t in queued if t < max(critical)]
    # each freed slot went to a critical request while one waited: at most one standard slipped in (a slot freed
    # in the instant before the other replica's announcement arrived)
    assert len(before) <= 1, (f"{len(before)} of the standard backlog started before the last critical request",
                              [round(t - min(standard), 2) for t in sorted(standard)],
                              [round(t - min(standard), 2) for t in sorted(critical)])
    assert fleet.fleet["m0"].stats.peak_requests <= SLOTS
