"""A request slower than ``timeouts.first_byte`` on a backend that answers other requests meanwhile is the
request's doing (a long non-streamed generation), not the backend's: it does not count against the backend's
breaker. Sweep 9: one key's long non-streamed requests, 8 in flight, kept both backends of a model ejected while
another key's requests got 503. A backend that answers nothing meanwhile (stuck) still counts."""

from __future__ import annotations

import concurrent.futures

import httpx

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import serve_in_thread

SLOW = {"model": "m", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 400,
        "ignore_eos": True}
FAST = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_slow_requests_on_a_backend_answering_others_do_not_eject_it() -> None:
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=1.0)]) as fleet:
        settings = settings_from_mapping({
            "backends": [{"name": "v", "engine": "vllm", "url": fleet.fleet.servers[0].url}],
            "timeouts": {"first_byte": 1.0}, "breaker": {"consecutive_failures": 2},
            "scrape": {"interval": 0.2, "timeout": 1.0}})
        app = create_app(settings)
        with serve_in_thread(app) as gw, httpx.Client(timeout=30) as client:
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                slow = [pool.submit(client.post, gw.url + "/v1/chat/completions", json=SLOW) for _ in range(3)]
                fast = client.post(gw.url + "/v1/chat/completions", json=FAST)  # (answered while they wait)
                assert fast.status_code == 200, fast.text
                assert [s.result().status_code for s in slow] == [504, 504, 504]
            assert app.gateway.pool.get("v").breaker.state.value == "closed"
            assert client.post(gw.url + "/v1/chat/completions", json=FAST).status_code == 200


def test_a_models_only_backend_answering_500_to_some_requests_is_not_ejected_by_them() -> None:
    """Sweep 10: llama.cpp answers 500 to a JSON-constrained answer cut short by max_tokens; with two backends the
    same 500 from both says the request is the cause, but a model's only backend had nothing to compare with, and
    one key's such requests (72 a minute) kept it ejected: everyone else got 503. A 5xx it answers now counts
    against neither; a backend that cannot be reached still does."""
    from tests.proxy.scripted_upstream import ScriptedUpstream, gateway_over

    with ScriptedUpstream(mode="script", model="m") as upstream:
        upstream.script = lambda headers: (500, "application/json", [b'{"error": {"message": "boom", "code": 500}}'])
        app, server = gateway_over(upstream, backend={"engine": "llamacpp"}, breaker={"consecutive_failures": 2})
        with server as gw, httpx.Client(timeout=30) as client:
            statuses = [client.post(gw.url + "/v1/chat/completions", json=FAST).status_code for _ in range(6)]
            assert statuses == [500] * 6
            assert app.gateway.pool.get("scripted").breaker.state.value == "closed"
