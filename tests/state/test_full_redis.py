"""One tenant filling the shared Redis with stored responses (``/v1/responses`` stores by default) while another
key is limited to one request a minute: the limit holds exactly and the shared state stays up, under Redis's
default ``noeviction`` and under the shipped ``volatile-lru``.

It used not to: under ``noeviction`` the first write Redis refused took the whole shared state down and every
limited key failed open (147 answers in 30 s to a 5 requests/min key); under ``volatile-lru`` Redis evicted the
limited key's idle bucket (it carried a TTL) along with old responses, and gave the key a full one."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import serve_in_thread
from tests.state.conftest import RedisServer

pytestmark = [pytest.mark.slow, pytest.mark.system]

KEYS = {"filler": "sk-filler", "limited": "sk-limited"}
MAXMEMORY = 6 * 1024 * 1024
INPUT = "word " * 40_000  # 200 kB a response: Redis's spare room fills in a few dozen


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    # an engine with room for the long inputs (the default profile's context is 4,096 tokens), fast
    spec = SimSpec(engine="vllm", model="m", name="v", time_scale=50, overrides={
        "context_length": 1_000_000, "kv_capacity_tokens": 4_000_000, "prefill_tok_s": 100_000_000})
    with FleetThread([spec]) as running:
        yield running


def ask(url: str, path: str, key: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(url + path, headers={"authorization": f"Bearer {KEYS[key]}"}, json=body, timeout=30)


def chat(url: str) -> int:
    return ask(url, "/v1/chat/completions", "limited",
               {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exposed")


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_a_limited_key_gets_exactly_its_answers_while_stored_responses_fill_redis(
        fleet: FleetThread, redis_server: RedisServer, policy: str) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("maxmemory-policy", policy)
    admin.config_set("maxmemory", str(MAXMEMORY))
    keys = [{"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
             **({"requests_per_minute": 1} if name == "limited" else {})} for name, key in KEYS.items()]
    app = create_app(settings_from_mapping({
        "backends": [{"name": "v", "engine": "vllm", "url": fleet.fleet["v"].url}],
        "auth": {"keys": keys},
        "state": {"url": redis_server.url},
        # more than the Redis holds: the Redis fills, as a Redis sized without the stored responses in mind does
        "responses": {"store_bytes": 64 * MAXMEMORY, "store_bytes_per_key": 64 * MAXMEMORY},
    }))
    try:
        with serve_in_thread(app) as gateway:
            # the key's minute, spent at once (one request: the bucket refills on Redis's real clock, and a run on a
            # loaded machine took 17 s, past the 12 s a 5 requests/min bucket takes to refill one)
            began = time.monotonic()
            statuses = [chat(gateway.url) for _ in range(5)]
            filled = 0
            while filled < 80:  # (then Redis has been full for dozens of responses)
                answer = ask(gateway.url, "/v1/responses", "filler",
                             {"model": "m", "input": INPUT, "max_output_tokens": 2})
                assert answer.status_code == 200, answer.text
                filled += 1
                if filled > 40 and filled % 4 == 0:  # (idle first: its bucket the least recently used)
                    statuses.append(chat(gateway.url))  # the limited key, asking again while Redis fills
            stats, memory = admin.info("stats"), admin.info("memory")
            full = stats["evicted_keys"] > 0 if policy == "volatile-lru" else memory["used_memory"] > 0.9 * MAXMEMORY
            assert full, "the stored responses filled Redis"
            statuses += [chat(gateway.url) for _ in range(3)]
            # (one a minute: a run beside the rest of the suite took past a minute, and the bucket gave one more)
            refills = int((time.monotonic() - began) // 60)
            assert statuses[0] == 200 and len(statuses) == 18, statuses
            # real time: the key's bucket refills on Redis's clock, one request a minute
            assert 1 <= statuses.count(200) <= 1 + refills and set(statuses) == {200, 429}, (statuses, refills)
            assert metric(gateway.url, "gateway_state_up") == 1.0
            assert metric(gateway.url, "gateway_state_fail_open_total") == 0.0
            refused = metric(gateway.url, 'gateway_state_errors_total{operation="put_response"}')
            assert refused > 0 if policy == "noeviction" else refused == 0, "each refused write is counted"
    finally:
        admin.close()
