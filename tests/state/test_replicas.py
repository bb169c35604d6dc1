"""Three gateway replicas (separate processes) sharing one real redis-server, in front of an emulated fleet,
driven by one client that spreads requests over them: one set of limits, one max_concurrency, sessions that
stick whichever replica a request reaches, and no request lost while Redis is killed and started again."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import pytest
import redis

from gateway.bench.procs import ChildProcess
from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port_block
from tests.state.conftest import RedisServer, start_replica
from tests.waiting import until, until_true, wait_until

pytestmark = pytest.mark.system

KEYS = {"rpm": "sk-rpm", "tpm": "sk-tpm", "free": "sk-free", "burst": "sk-burst", "cap": "sk-cap", "ops": "sk-ops"}
TPM = 18_000  # the tpm key's tokens per minute: about 160 of the test's requests, fewer than 32 streams can send
RPM = 30


@dataclass
class Cluster:
    redis: RedisServer
    fleet: FleetThread
    urls: list[str]
    procs: list[ChildProcess]

    def url(self, i: int) -> str:
        return self.urls[i % len(self.urls)]


def key(name: str, **limits: int) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(KEYS[name].encode()).hexdigest(), **limits}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("replicas")
    base = free_port_block(4)
    redis = RedisServer(base, tmp).start()
    specs = [SimSpec(engine="vllm", model="m", name=f"m{i}", time_scale=20) for i in range(2)]
    specs += [SimSpec(engine="vllm", model="s", name=f"s{i}", time_scale=20) for i in range(2)]
    with FleetThread(specs) as fleet:
        servers = {s.spec.name: s for s in fleet.fleet.servers}
        backends = [{"name": n, "engine": "vllm", "url": servers[n].url,
                     **({"max_concurrency": 3} if n[0] == "m" else {})} for n in ("m0", "m1", "s0", "s1")]
        procs, urls = [], []
        try:
            for i in range(3):
                proc, url = start_replica(tmp, i, base + 1 + i, redis, backends=backends, auth={"keys": [
                    key("rpm", requests_per_minute=RPM), key("tpm", tokens_per_minute=TPM), key("free"),
                    key("burst", requests_per_minute=5), key("cap", max_in_flight=3),
                    {**key("ops"), "scopes": ["admin"]}]})
                procs.append(proc)
                urls.append(url)
            for url in urls:
                wait_models(url)
            yield Cluster(redis, fleet, urls, procs)
        finally:
            for proc in procs:
                proc.stop()
            redis.kill()


def wait_models(url: str) -> None:
    def both_listed() -> bool:
        try:
            models = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEYS['free']}"}, timeout=2)
        except httpx.TransportError:
            return False
        return models.status_code == 200 and {m["id"] for m in models.json()["data"]} == {"m", "s"}

    wait_until(both_listed, f"{url} up, listing both models", within=60)


async def chat(client: httpx.AsyncClient, url: str, key: str, model: str = "m", max_tokens: int = 4,
               session: str | None = None, content: str = "hello") -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[key]}"}
    if session is not None:
        headers["x-session-id"] = session
    return await client.post(url + "/v1/chat/completions", headers=headers, timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "ignore_eos": True})


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_keys_max_in_flight_is_one_cap_across_the_replicas(cluster: Cluster) -> None:
    servers = [s for s in cluster.fleet.fleet.servers if s.spec.name in ("s0", "s1")]

    async def go() -> tuple[list[int], httpx.Response, int]:
        async with httpx.AsyncClient() as client:
            for server in servers:  # the backends hold each request 0.6 s (below the health checks' timeout)
                server.faults.update({"added_latency_s": 0.6})
            try:
                held = [asyncio.ensure_future(chat(client, cluster.url(i), "cap", model="s", max_tokens=1,
                                                   content=f"held {i}")) for i in range(3)]  # one on each replica

                def arrived() -> bool:  # (admitted, each: the key's three places taken)
                    asked = {r.body["messages"][0]["content"] for server in servers for r in list(server.received)
                             if r.path == "/v1/chat/completions" and isinstance(r.body, dict)}
                    return {f"held {i}" for i in range(3)} <= asked

                await until(arrived, "the three at the backends")
                refused = await chat(client, cluster.url(1), "cap", model="s", max_tokens=1)
                statuses = [r.status_code for r in await asyncio.gather(*held)]
            finally:
                for server in servers:
                    server.faults.update({"added_latency_s": 0.0})
            after = [0]

            async def answered() -> bool:  # their places come back as their settlements reach Redis
                after[0] = (await chat(client, cluster.url(2), "cap", model="s", max_tokens=1)).status_code
                return after[0] == 200

            await until_true(answered, "a place of the key's free again")
            return statuses, refused, after[0]

    statuses, refused, after = run(go())
    assert statuses == [200, 200, 200] and after == 200
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit"


def test_requests_per_minute_is_one_limit_across_the_replicas(cluster: Cluster) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(chat(client, cluster.url(i), "rpm", model="s", max_tokens=1)
                                          for i in range(RPM + 10)))

    replies = run(burst())
    codes = Counter(r.status_code for r in replies)
    assert codes == {200: RPM, 429: 10}, codes  # (the burst takes well under the 2 s a request refills in)
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_requests" and int(refused.headers["retry-after"]) >= 1
    assert {r.headers["x-gateway-backend"] for r in replies if r.status_code == 200} <= {"s0", "s1"}


def test_tokens_per_minute_holds_within_5_percent_under_32_streams(cluster: Cluster) -> None:
    # at least 6 s, and on until the limit has refused 30 requests (on a loaded machine the fleet once took the
    # whole 6 s to spend the full bucket, and the limit never bit), 15 s at most
    seconds, longest = 6.0, 15.0
    used: list[int] = []
    refused = 0

    async def worker(i: int, client: httpx.AsyncClient, stop: float) -> None:
        nonlocal refused
        for n in itertools.count():
            now = time.monotonic()
            if now >= stop + longest - seconds or (now >= stop and refused >= 30):
                return
            reply = await chat(client, cluster.url(i + n), "tpm", model="s", max_tokens=60,
                               content=f"question {i} {n} " + "word " * 40)
            if reply.status_code == 200:
                usage = reply.json()["usage"]
                used.append(usage["prompt_tokens"] + usage["completion_tokens"])
            else:
                assert reply.status_code == 429 and reply.json()["error"]["code"] == "rate_limit_tokens", reply.text
                refused += 1
                await asyncio.sleep(0.05)  # real time: a refused client's pause, as the bucket refills by the clock

    async def drive() -> float:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            started = time.monotonic()
            await asyncio.gather(*(worker(i, client, started + seconds) for i in range(32)))
            return time.monotonic() - started

    elapsed = run(drive())
    # what the bucket allowed: full at the start, then refilled for as long as requests were admitted
    allowed = TPM + TPM * elapsed / 60
    assert len(used) > 50 and refused >= 30, ("the limit, not the fleet, bounded what was admitted", len(used), refused,
                                              sum(used), allowed)
    assert 0.95 * allowed <= sum(used) <= 1.05 * allowed, (sum(used), allowed, len(used))


def test_max_concurrency_is_never_exceeded_and_queued_requests_get_freed_slots(cluster: Cluster) -> None:
    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            # (400 tokens: ~10 times a Redis admission on a loaded machine, so a freed slot is taken again while
            # its neighbours still run; at 40 the answers were as short as the hand-over and the peaks read 2)
            return await asyncio.gather(*(chat(client, cluster.url(i), "free", max_tokens=400) for i in range(30)))

    replies = run(flood())
    assert [r.status_code for r in replies] == [200] * 30, [r.text for r in replies if r.status_code != 200][:2]
    peaks = {name: cluster.fleet.fleet[name].stats.peak_requests for name in ("m0", "m1")}
    assert all(1 <= p <= 3 for p in peaks.values()), peaks  # 3 each, whichever replica sent them
    assert sum(peaks.values()) == 6, "both were kept full while requests queued"


def test_a_session_sticks_to_one_backend_whichever_replica_it_reaches(cluster: Cluster) -> None:
    rng = random.Random(3)
    served: dict[str, list[str]] = {}

    async def session(name: str, client: httpx.AsyncClient) -> None:
        for turn in range(5):
            reply = await chat(client, cluster.url(rng.randrange(3)), "free", model="s", session=name,
                               content=f"{name} turn {turn}")
            assert reply.status_code == 200, reply.text
            served.setdefault(name, []).append(reply.headers["x-gateway-backend"])

    async def drive() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(*(session(f"conversation-{i}", client) for i in range(40)))

    run(drive())
    follow_ups = [backend == backends[0] for backends in served.values() for backend in backends[1:]]
    moved = {name: backends for name, backends in served.items() if len(set(backends)) > 1}
    assert sum(follow_ups) >= 0.99 * len(follow_ups), moved
    assert len({backends[0] for backends in served.values()}) == 2, "sessions started on both backends"


OPS = {"authorization": f"Bearer {KEYS['ops']}"}


def on_every_replica(cluster: Cluster, check: Callable[[str], bool], what: str) -> None:
    """Until ``check`` holds of every replica's URL (what one was told has reached the others)."""
    wait_until(lambda: all(check(url) for url in cluster.urls), f"{what}, on every replica")


def drained(url: str, backend: str) -> bool:
    return bool(httpx.get(url + f"/admin/backends/{backend}", headers=OPS).json()["drained"])


def policy(url: str) -> str:
    return str(httpx.get(url + "/admin/config", headers=OPS).json()["routing"]["policy"])


def test_a_drain_and_a_routing_change_made_on_one_replica_hold_on_all(cluster: Cluster) -> None:
    ops = {"authorization": f"Bearer {KEYS['ops']}"}

    def served_by(i: int) -> str:
        free = {"authorization": f"Bearer {KEYS['free']}"}
        reply = httpx.post(cluster.url(i) + "/v1/chat/completions", headers=free, json={
            "model": "s", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2})
        assert reply.status_code == 200
        return reply.headers["x-gateway-backend"]

    try:
        assert httpx.post(cluster.url(0) + "/admin/backends/s0/drain", headers=ops).json()["drained"]
        on_every_replica(cluster, lambda u: drained(u, "s0"), "s0 drained")
        assert {served_by(i) for i in range(30)} == {"s1"}
        changed = httpx.put(cluster.url(1) + "/admin/routing", headers=ops, json={"policy": "round-robin"})
        assert changed.status_code == 200
        on_every_replica(cluster, lambda u: policy(u) == "round-robin", "the round-robin policy")
    finally:
        httpx.post(cluster.url(2) + "/admin/backends/s0/undrain", headers=ops)
        httpx.put(cluster.url(2) + "/admin/routing", headers=ops, json={"policy": "default"})
    on_every_replica(cluster, lambda u: not drained(u, "s0"), "s0 undrained")
    on_every_replica(cluster, lambda u: policy(u) == "default", "the default policy")


def test_a_backend_added_or_removed_on_one_replica_is_on_all(cluster: Cluster) -> None:
    ops = {"authorization": f"Bearer {KEYS['ops']}"}
    s1 = next(s.url for s in cluster.fleet.fleet.servers if s.spec.name == "s1")

    def names(url: str) -> list[str]:
        return [b["name"] for b in httpx.get(url + "/admin/backends", headers=ops).json()["backends"]]

    try:
        added = httpx.post(cluster.url(0) + "/admin/backends", headers=ops,
                           json={"name": "s1b", "engine": "vllm", "url": s1})
        assert added.status_code == 200, added.text
        on_every_replica(cluster, lambda u: "s1b" in names(u), "s1b added")
        assert httpx.delete(cluster.url(1) + "/admin/backends/s1b", headers=ops).status_code == 200
        on_every_replica(cluster, lambda u: "s1b" not in names(u), "s1b removed")
    finally:
        for url in cluster.urls:
            if "s1b" in names(url):
                httpx.delete(url + "/admin/backends/s1b", headers=ops)


def test_what_anyone_else_publishes_to_redis_changes_no_replica(cluster: Cluster) -> None:
    """The sweep's redis-inject.py, redis-envexfil.py and redis-harvest.py as they were: anyone who could
    PUBLISH to the replicas' Redis added a backend of its own (fed the environment variable it named as its key),
    drained the real one, and made the clients' Authorization the session key. Now the replicas' messages are
    sealed with a secret Redis does not hold (here derived from their API keys), and these are dropped."""
    ops = {"authorization": f"Bearer {KEYS['ops']}"}
    evil = {"name": "evil", "engine": "openai", "url": "http://127.0.0.1:9", "models": ["s"], "api_key_env": "HOME"}
    attacker = redis.Redis(port=cluster.redis.port)
    try:
        for batch in ([["backends", ["add", evil, "key ops"]]], [["drain", ["s0", True]]],
                      [["routing", [{"session_header": "authorization"}, "key ops"]]]):
            attacker.publish("gateway:peers", b"attacker\0" + msgpack.packb(batch))
        attacker.publish("gateway:freed", b"s0\0attacker")
    finally:
        attacker.close()
    try:  # a real change after them: once every replica has it, each has read what came before it
        assert httpx.put(cluster.url(0) + "/admin/routing", headers=ops, json={"policy": "round-robin"}).is_success
        on_every_replica(cluster, lambda u: policy(u) == "round-robin", "the round-robin policy")
        for url in cluster.urls:
            backends = httpx.get(url + "/admin/backends", headers=ops).json()["backends"]
            assert "evil" not in {b["name"] for b in backends}
            assert not any(b["drained"] for b in backends)
            assert httpx.get(url + "/admin/config", headers=ops).json()["routing"]["session_header"] != "authorization"
            metrics = httpx.get(url + "/metrics").text
            assert 'gateway_state_messages_rejected_total{reason="unauthenticated"} 4.0' in metrics, url
    finally:
        httpx.put(cluster.url(2) + "/admin/routing", headers=ops, json={"policy": "default"})
    on_every_replica(cluster, lambda u: policy(u) == "default", "the default policy")


def test_stored_responses_continue_on_any_replica_for_their_key_alone(cluster: Cluster) -> None:
    headers = {"authorization": f"Bearer {KEYS['free']}"}
    first = httpx.post(cluster.url(0) + "/v1/responses", headers=headers, timeout=30,
                       json={"model": "s", "input": "Tell me about the gateway.", "max_output_tokens": 8})
    assert first.status_code == 200, first.text
    rid = first.json()["id"]
    store = redis.Redis(port=cluster.redis.port)
    try:  # (it is written to the shared store after the answer)
        wait_until(lambda: any(store.scan_iter(match=f"gateway:response:*:{rid}")), "the response in the store")
    finally:
        store.close()
    for i in (1, 2):  # the other replicas find it in the shared store
        more = httpx.post(cluster.url(i) + "/v1/responses", headers=headers, timeout=30,
                          json={"model": "s", "input": "And more?", "max_output_tokens": 8,
                                "previous_response_id": rid})
        assert more.status_code == 200, more.text
    unknown = httpx.post(cluster.url(1) + "/v1/responses", headers=headers, timeout=30,
                         json={"model": "s", "input": "x", "previous_response_id": "resp_unknown"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "previous_response_not_found"
    # another key, on every replica (the one that made it holds it in memory, the others read Redis): told exactly
    # what an unknown id is told
    other = {"authorization": f"Bearer {KEYS['cap']}"}
    made_up = "resp_" + "0" * 48
    for i in range(3):
        answers = [httpx.post(cluster.url(i) + "/v1/responses", headers=other, timeout=30,
                              json={"model": "s", "input": "What did they say?", "previous_response_id": asked})
                   for asked in (rid, made_up)]
        theirs, unknown = answers
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json() == json.loads(unknown.text.replace(made_up, rid))


def test_redis_killed_and_restarted_loses_no_request_and_limits_resume(cluster: Cluster) -> None:
    failures: list[str] = []
    done = 0

    async def steady(i: int, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        nonlocal done
        n = 0
        while not stop.is_set():
            reply = await chat(client, cluster.url(i + n), "free", model="s", max_tokens=2)
            n += 1
            if reply.status_code != 200:
                failures.append(reply.text)
            done += 1

    async def state_up(client: httpx.AsyncClient, up: bool) -> bool:
        texts = [(await client.get(url + "/metrics")).text for url in cluster.urls]
        return all(f"gateway_state_up {float(up)}" in text for text in texts)

    async def served(more: int, what: str) -> None:
        before = done
        await until(lambda: done >= before + more, what)

    async def drive() -> None:
        async with httpx.AsyncClient() as client:
            stop = asyncio.Event()
            load = asyncio.gather(*(steady(i, client, stop) for i in range(8)))
            await served(20, "requests served with Redis up")
            cluster.redis.kill()
            await until_true(lambda: state_up(client, False), "every replica seeing Redis gone")
            await served(20, "requests served with Redis gone")
            cluster.redis.start()
            await until_true(lambda: state_up(client, True), "every replica seeing Redis back")
            await served(20, "requests served with Redis back")
            stop.set()
            await load

    run(drive())
    assert done > 50 and failures == []
    for url in cluster.urls:  # every replica saw Redis go away and come back
        metrics = httpx.get(url + "/metrics").text
        assert "gateway_state_up 1.0" in metrics
        errors = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("gateway_state_errors_total{")]
        assert sum(errors) > 0, url
    # the limits hold again: a fresh Redis, a full bucket of 5 for the burst key, shared by all replicas
    async def burst() -> Counter[int]:
        async with httpx.AsyncClient() as client:
            replies = await asyncio.gather(*(chat(client, cluster.url(i), "burst", model="s", max_tokens=1)
                                            for i in range(8)))
        return Counter(r.status_code for r in replies)

    assert run(burst()) == {200: 5, 429: 3}
