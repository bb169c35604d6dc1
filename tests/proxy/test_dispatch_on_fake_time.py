"""The dispatcher, built whole (pool, breaker, admission, forwarder) with no socket and on fake time: failover
order, the half-open probe after the cooldown, and a waiter refused at its deadline, each exact to the tick.

The engines are a :class:`MockTransport` (the data plane) and httpx's mock transport (health and load readings);
the gateway runs on a fake-time event loop (looptime) and reads that loop's time (LoopClock), so a five-second
cooldown or a thirty-second wait passes at once, in the same order every run."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import looptime
import orjson
import pytest

from gateway.app import GatewayApp
from gateway.clock import LoopClock
from gateway.pool.breaker import BreakerState
from gateway.proxy.transport import MockRequest, MockResponse, UpstreamError
from tests.inprocess import Engine, in_process

pytestmark = [pytest.mark.anyio, pytest.mark.unit, pytest.mark.unit]



@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return "asyncio", {"loop_factory": lambda: looptime.new_event_loop(start=1000.0)}


def now() -> float:
    return asyncio.get_running_loop().time()


def answer(text: str) -> MockResponse:
    return MockResponse(body=orjson.dumps({"id": "c", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}))


def gateway(config: dict[str, Any], engine: Engine) -> contextlib.AbstractAsyncContextManager[
        tuple[GatewayApp, httpx.AsyncClient]]:
    return in_process(config, engine, LoopClock())  # (the fake-time loop's own time)


def backends(*names: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": n, "engine": "vllm", "url": f"http://{n}:8000", "models": ["m"], **extra} for n in names]


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


async def test_a_request_fails_over_in_the_order_routing_ranked_and_the_refusing_backend_is_marked_down() -> None:
    tried: list[str] = []

    async def engine(request: MockRequest) -> MockResponse:
        host = httpx.URL(request.url).host
        tried.append(host)
        if host in ("a", "b"):
            raise UpstreamError("connection refused", connect=True)
        return answer(host)

    config = {"backends": backends("a", "b", "c"), "routing": {"policy": "round-robin"},
              "retries": {"max_attempts": 3}}
    async with gateway(config, engine) as (app, client):
        response = await client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "c"
        assert tried == ["a", "b", "c"], "each backend once, in the order ranked"
        down = {b.name: b.health.value for b in app.gateway.pool.backends}
        assert down["a"] == down["b"] == "down" and down["c"] == "ready"


async def test_after_the_cooldown_one_request_is_the_probe_and_its_success_closes_the_breaker() -> None:
    failing = True
    probe_in, probe_may_answer = asyncio.Event(), asyncio.Event()
    seen: list[float] = []

    async def engine(request: MockRequest) -> MockResponse:
        seen.append(now())
        if failing:
            raise UpstreamError("connection refused", connect=True)
        probe_in.set()
        await probe_may_answer.wait()
        return answer("back")

    config = {"backends": backends("only"), "breaker": {"consecutive_failures": 1, "cooldown_seconds": 5},
              "scrape": {"interval": 1}}
    async with gateway(config, engine) as (app, client):
        only = app.gateway.pool.backends[0]
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 502
        assert only.breaker.state is BreakerState.OPEN
        opened = now()
        # fake time: the cooldown running
        await asyncio.sleep(2.0)  # its health checks pass again: the breaker, not health, keeps it out
        assert only.health.value == "ready"
        refused = await client.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 503 and "ejected" in refused.text and len(seen) == 1, "none reaches it"
        failing = False
        await asyncio.sleep(opened + 4.9 - now())  # fake time: to just before the cooldown's end
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503, "not before the cooldown"
        await asyncio.sleep(0.1)  # fake time: past the cooldown's end
        probe = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await probe_in.wait()
        assert only.breaker.state is BreakerState.HALF_OPEN and only.breaker.probing
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 503, "one probe at a time"
        probe_may_answer.set()
        assert (await probe).status_code == 200
        assert only.breaker.state is BreakerState.CLOSED and len(seen) == 2


async def test_a_waiter_is_refused_exactly_at_its_deadline_and_the_slot_goes_to_the_next() -> None:
    first_in, release = asyncio.Event(), asyncio.Event()
    started: list[float] = []

    async def engine(request: MockRequest) -> MockResponse:
        started.append(now())
        first_in.set()
        await release.wait()
        return answer("ok")

    config = {"backends": backends("one", max_concurrency=1), "admission": {"max_wait_seconds": 30}}
    async with gateway(config, engine) as (_app, client):
        holder = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await first_in.wait()
        queued_at = now()
        waiter = await client.post("/v1/chat/completions", json=CHAT)
        assert waiter.status_code == 429 and waiter.json()["error"]["code"] == "queue_timeout", waiter.text
        assert now() - queued_at == pytest.approx(30.0), "refused at its deadline, not before or after"
        late = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.sleep(10.0)  # fake time: the slot held 10 s more
        release.set()
        assert (await holder).status_code == 200 and (await late).status_code == 200
        assert started[1] - started[0] == pytest.approx(40.0), "the next waiter got the slot when it was freed"


async def test_a_backend_that_timed_out_after_reading_the_prompt_is_charged_to_the_key_on_failover() -> None:
    """Sweep 16: a 5xx failover charged the key the prompt the failed engine had read, a first-byte timeout did
    not: each backend timed out on was a prompt's work for free (1.45x the key's budget with three backends).
    On fake time the bucket's refill over the timeout is exact: the prompt read by the backend that timed out
    is charged with the answer's usage, as the engine that answered counted it."""
    import hashlib

    async def engine(request: MockRequest) -> MockResponse:
        if httpx.URL(request.url).host == "a":
            await asyncio.Event().wait()  # (reads the prompt, never answers)
        done = answer("from b")
        done.body = done.body.replace(b'"prompt_tokens":3', b'"prompt_tokens":1000')
        return done

    key = {"name": "k", "key_sha256": hashlib.sha256(b"sk-k").hexdigest(), "tokens_per_minute": 6000}
    config = {"backends": backends("a", "b"), "routing": {"policy": "round-robin"}, "auth": {"keys": [key]},
              "timeouts": {"first_byte": 5}, "retries": {"max_attempts": 2, "max_seconds": 60}}
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 800}], "max_tokens": 1}
    async with gateway(config, engine) as (app, client):
        started = now()
        response = await client.post("/v1/chat/completions", json=body, headers={"authorization": "Bearer sk-k"})
        assert response.status_code == 200 and response.headers["x-gateway-backend"] == "b"
        assert now() - started == pytest.approx(5.0)
        tokens = next(c for _, c in app.gateway.keys._clients if c.name == "k").tokens
        assert tokens is not None
        prompt_read_by_a = 1000  # (b's count of the same prompt)
        refilled = 5.0 * 6000 / 60
        assert tokens.level == pytest.approx(6000 - (1000 + 1) - prompt_read_by_a + refilled, abs=1), tokens.level
