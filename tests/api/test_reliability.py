"""Failover on retryable statuses, outlier ejection, admission control, API keys and limits, through the
gateway with the OpenAI SDK in front of emulated engines."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.clock import SYSTEM, Clock
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running
from tests.conftest import serve_in_thread
from tests.waiting import until

ASK = [{"role": "user", "content": "hi"}]


class SkippingClock(Clock):
    """The real clock, which a test may move ahead at once (``skip``): whatever reads the time sees that much more
    pass (a breaker's cooldown); sleeps stay real."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def time(self) -> float:
        return time.time() + self.ahead

    def skip(self, seconds: float) -> None:
        self.ahead += seconds


def running(specs: list[SimSpec], clock: Clock = SYSTEM, **extra: Any) -> Iterator[Running]:
    from tests.api.conftest import gateway_settings

    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers, **extra), clock=clock)
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


@pytest.fixture
def pair_rr() -> Iterator[Running]:
    # a cooldown well above the time the ejection test takes to send its dozen requests on a loaded machine
    specs = [SimSpec(engine="vllm", model="m", name=f"v{i}", time_scale=TIME_SCALE) for i in range(2)]
    yield from running(specs, SkippingClock(), routing={"policy": "round-robin"},
                       breaker={"consecutive_failures": 3, "cooldown_seconds": 1.5})


def sdk(r: Running, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0)


def generations(r: Running, name: str) -> int:
    return sum(1 for q in list(r.server(name).received) if q.path == "/v1/chat/completions")


def test_a_retryable_status_fails_over_before_any_byte_and_is_counted(pair_rr: Running) -> None:
    pair_rr.server("v0").faults.update({"error_rate": 1.0, "error_status": 503})
    served = collections.Counter()
    for _ in range(4):
        raw = sdk(pair_rr).chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=3,
                                                                     stream=True)
        assert [c for c in raw.parse()], "a complete stream"
        served[raw.headers["x-gateway-backend"]] += 1
    assert served == {"v1": 4}
    metrics = httpx.get(pair_rr.url + "/metrics").text
    assert 'gateway_retries_total{backend="v0",reason="status_503"}' in metrics


def test_with_nowhere_else_to_go_the_engines_error_comes_back(pair_rr: Running) -> None:
    for server in pair_rr.fleet.fleet.servers:
        server.faults.update({"error_rate": 1.0, "error_status": 500})
    with pytest.raises(openai.InternalServerError) as err:
        sdk(pair_rr).chat.completions.create(model="m", messages=ASK, max_tokens=3)
    assert "Simulated engine error" in err.value.message


def test_a_request_that_every_backend_fails_alike_ejects_none_of_them(pair_rr: Running) -> None:
    """A 500 that follows the request from backend to backend is the request's doing (llama.cpp answers 500 to
    a JSON-constrained answer cut short by max_tokens): it fails, and the backends stay in service. Counted
    against each, five such requests ejected them all and the next client got 503."""
    for server in pair_rr.fleet.fleet.servers:
        server.faults.update({"error_rate": 1.0, "error_status": 500})
    for _ in range(6):
        with pytest.raises(openai.InternalServerError):
            sdk(pair_rr).chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert generations(pair_rr, "v0") == generations(pair_rr, "v1") == 6, "each tried on both"
    ready = httpx.get(pair_rr.url + "/ready").json()
    assert {name: b["breaker"] for name, b in ready["backends"].items()} == {"v0": "closed", "v1": "closed"}
    for server in pair_rr.fleet.fleet.servers:
        server.faults.update({"error_rate": 0.0})
    assert sdk(pair_rr).chat.completions.create(model="m", messages=ASK, max_tokens=2).choices


def test_a_failing_backend_is_ejected_then_probed_back(pair_rr: Running) -> None:
    bad = pair_rr.server("v0")
    bad.faults.update({"error_rate": 1.0, "error_status": 500})
    for _ in range(8):  # every request still succeeds: failover to v1
        sdk(pair_rr).chat.completions.create(model="m", messages=ASK, max_tokens=2)
    before = generations(pair_rr, "v0")
    assert before == 3, "ejected after 3 consecutive failures"
    for _ in range(4):
        sdk(pair_rr).chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert generations(pair_rr, "v0") == before, "an open breaker sends nothing there"
    ready = httpx.get(pair_rr.url + "/ready").json()
    assert ready["backends"]["v0"]["health"] == "ready", "its /health still passes: the breaker decides"
    bad.faults.update({"error_rate": 0.0})
    clock = pair_rr.app.gateway.clock
    assert isinstance(clock, SkippingClock)
    clock.skip(1.5)  # past the cooldown: the next request routed there is the probe
    served = {sdk(pair_rr).chat.completions.with_raw_response.create(
        model="m", messages=ASK, max_tokens=2).headers["x-gateway-backend"] for _ in range(6)}
    assert served == {"v0", "v1"}


def test_requests_wait_for_a_free_slot_and_beyond_the_queue_get_429() -> None:
    specs = [SimSpec(engine="sglang", model="m", name="s", time_scale=TIME_SCALE)]
    extra = {"admission": {"queue_size": 3, "max_wait_seconds": 10}}
    for r in running(specs, **extra):
        r.app.gateway.pool.get("s").max_concurrency = 1

        async def burst(n: int, url: str = r.url, max_tokens: int = 20) -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                body = {"model": "m", "messages": ASK, "max_tokens": max_tokens}
                responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                                   for _ in range(n)))
                return [resp.status_code for resp in responses]

        statuses = asyncio.run(burst(4))  # one runs, three wait
        assert statuses == [200] * 4
        # one runs, three wait, two are turned away; each ~110 ms (20 tokens took ~6 ms: on a loaded CI machine
        # the first was done before the sixth arrived, and five were served)
        statuses = asyncio.run(burst(6, max_tokens=400))
        assert sorted(statuses) == [200] * 4 + [429] * 2
        metrics = httpx.get(r.url + "/metrics").text
        waited = [line for line in metrics.splitlines()
                  if line.startswith('gateway_queue_wait_seconds_sum{backend="s",stage="gateway"}')]
        assert waited and float(waited[0].split()[-1]) > 0.05


KEY_A, KEY_B, KEY_C = "sk-alpha", "sk-beta", "sk-gamma"


@pytest.fixture(scope="module")
def keyed() -> Iterator[Running]:
    specs = [SimSpec(engine="vllm", model="m", name="v", time_scale=TIME_SCALE, api_key="backend-secret"),
             SimSpec(engine="vllm", model="other", name="o", time_scale=TIME_SCALE, api_key="backend-secret")]
    auth = {"keys": [
        {"name": "alpha", "key_sha256": hashlib.sha256(KEY_A.encode()).hexdigest(), "models": ["m"],
         "requests_per_minute": 5},
        {"name": "beta", "key_sha256": hashlib.sha256(KEY_B.encode()).hexdigest(),
         "scopes": ["inference", "metrics"]},
        {"name": "gamma", "key_sha256": hashlib.sha256(KEY_C.encode()).hexdigest(), "max_in_flight": 2},
    ], "protect_metrics": True}
    yield from running(specs, auth=auth, limits={"max_messages": 4, "max_tokens": 1000})


def test_keys_are_required_checked_and_never_forwarded(keyed: Running) -> None:
    with pytest.raises(openai.AuthenticationError):
        sdk(keyed, "sk-wrong").chat.completions.create(model="m", messages=ASK)
    assert httpx.post(keyed.url + "/v1/chat/completions", json={"model": "m", "messages": ASK}).status_code == 401
    assert httpx.get(keyed.url + "/v1/models").status_code == 401
    assert [m.id for m in sdk(keyed, KEY_B).models.list()] == ["m", "other"]
    with pytest.raises(openai.PermissionDeniedError):
        sdk(keyed, KEY_A).chat.completions.create(model="other", messages=ASK)
    reply = sdk(keyed, KEY_B).chat.completions.with_raw_response.create(model="m", messages=ASK, max_tokens=2)
    reply.parse()
    sent = [q for q in list(keyed.server("v").received) if q.path == "/v1/chat/completions"][-1]
    assert sent.headers["authorization"] == "Bearer backend-secret"
    assert KEY_B not in str(sent.headers) and "backend-secret" not in str(dict(reply.headers))


def test_a_keys_max_in_flight_turns_away_the_next_request_until_one_ends(keyed: Running) -> None:
    async def go() -> tuple[list[int], int, dict[str, Any], int]:
        headers = {"authorization": f"Bearer {KEY_C}"}
        body = {"model": "m", "messages": ASK, "max_tokens": 2}
        async with httpx.AsyncClient(base_url=keyed.url, headers=headers, timeout=30) as client:
            # two that the backend holds for 0.6 s (its health checks wait as long: below their 1 s timeout)
            keyed.server("v").faults.update({"added_latency_s": 0.6})
            try:
                held = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(2)]
                backend = keyed.app.gateway.pool.get("v")
                await until(lambda: backend.in_flight == 2, "the two requests at the backend")
                refused = await client.post("/v1/chat/completions", json=body)  # at once: no place left
                statuses = [r.status_code for r in await asyncio.gather(*held)]
            finally:
                keyed.server("v").faults.update({"added_latency_s": 0.0})
            after = await client.post("/v1/chat/completions", json=body)  # their places are free again
            return statuses, refused.status_code, refused.json(), after.status_code

    statuses, refused, body, after = asyncio.run(go())
    assert statuses == [200, 200] and refused == 429 and after == 200
    assert body["error"]["code"] == "concurrency_limit" and "max_in_flight 2" in body["error"]["message"]


def test_per_key_request_budget(keyed: Running) -> None:
    c = sdk(keyed, KEY_A)
    statuses = []
    for _ in range(7):
        try:
            c.chat.completions.create(model="m", messages=ASK, max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError as err:
            statuses.append(429)
            assert int(err.response.headers["retry-after"]) >= 1
    assert statuses.count(429) >= 2 and statuses[:4] == [200] * 4
    sdk(keyed, KEY_B).chat.completions.create(model="m", messages=ASK, max_tokens=1)  # beta is unaffected


def test_health_open_metrics_keyed_and_request_limits(keyed: Running) -> None:
    assert httpx.get(keyed.url + "/health").status_code == 200
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers={"authorization": f"Bearer {KEY_B}"}).status_code == 200
    with pytest.raises(openai.BadRequestError) as err:
        sdk(keyed, KEY_B).chat.completions.create(model="m", messages=ASK * 5)
    assert err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        sdk(keyed, KEY_B).chat.completions.create(model="m", messages=ASK, max_tokens=5000)
    assert err.value.param == "max_tokens"
    # n (QA: n=10^9 was passed on to the engine), at OpenAI's own cap of 128 by default
    with pytest.raises(openai.BadRequestError) as err:
        sdk(keyed, KEY_B).chat.completions.create(model="m", messages=ASK, max_tokens=2, n=1_000_000_000)
    assert err.value.param == "n" and "at most 128" in err.value.message
