"""Readiness means "can serve": a model whose every backend is ejected by its circuit breaker is not ready,
in /ready and in the Prometheus gauges, and the gateway leaves the Service only when no model is ready. With
API keys, /ready tells its details only to an operator's key."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

FAR = 3600.0  # an ejection that outlasts the test, whatever the machine's load


def ready(running: Running) -> httpx.Response:
    return httpx.get(running.url + "/ready")


def all_ready(running: Running) -> bool:
    body = ready(running).json()
    return all(b["health"] == "ready" for b in body["backends"].values())


def eject(running: Running, name: str) -> None:
    """Open the backend's breaker, as enough failed requests would, on the gateway's own loop."""
    breaker = running.app.gateway.pool.get(name).breaker

    async def trip() -> None:
        for _ in range(breaker.settings.consecutive_failures):
            breaker.record(False, now=time.monotonic() + FAR)

    running.gateway.call(trip())
    assert breaker.state.value == "open"


def restore(running: Running, name: str) -> None:
    """A successful half-open probe closes the breaker again."""
    breaker = running.app.gateway.pool.get(name).breaker

    async def probe_succeeds() -> None:
        breaker.begin(now=time.monotonic() + 2 * FAR + breaker.settings.max_cooldown_seconds)
        breaker.record(True)

    running.gateway.call(probe_succeeds())
    assert breaker.state.value == "closed"


def gauges(running: Running, name: str) -> dict[str, float]:
    """The samples of one gauge, keyed by their first label's value."""
    text = httpx.get(running.url + "/metrics").text
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return {next(iter(s.labels.values())): s.value for s in family.samples}


def test_one_model_down_leaves_the_others_served_and_says_which(engines: Running) -> None:
    wait_until(lambda: all_ready(engines), "every backend ready")
    eject(engines, "sim-vllm")
    try:
        response = ready(engines)
        body: dict[str, Any] = response.json()
        assert response.status_code == 200 and body["status"] == "ready", "the other models can be served"
        assert body["models"]["m-vllm"] == {"ready": False, "backends": []}
        assert body["models"]["m-sglang"] == {"ready": True, "backends": ["sim-sglang"]}
        vllm = body["backends"]["sim-vllm"]
        assert (vllm["health"], vllm["breaker"], vllm["routable"]) == ("ready", "open", False)
        assert body["backends"]["sim-llamacpp"]["breaker"] == "closed"

        backend_ready = gauges(engines, "gateway_backend_ready")
        assert backend_ready["sim-vllm"] == 0.0, "healthy but ejected: it cannot take requests"
        assert backend_ready["sim-sglang"] == 1.0
        model_ready = gauges(engines, "gateway_model_ready")
        assert model_ready == {"m-llamacpp": 1.0, "m-sglang": 1.0, "m-tabbyapi": 1.0, "m-vllm": 0.0}
        assert "m-vllm" not in {m["id"] for m in httpx.get(engines.url + "/v1/models").json()["data"]}
    finally:
        restore(engines, "sim-vllm")
    assert ready(engines).json()["models"]["m-vllm"] == {"ready": True, "backends": ["sim-vllm"]}
    assert gauges(engines, "gateway_model_ready")["m-vllm"] == 1.0


def test_no_model_servable_is_503_though_every_backend_is_healthy(pair: Running) -> None:
    wait_until(lambda: all_ready(pair), "every backend ready")
    eject(pair, "vllm-a")
    body = ready(pair).json()
    assert ready(pair).status_code == 200
    assert body["models"] == {"shared": {"ready": True, "backends": ["vllm-b"]}}

    eject(pair, "vllm-b")
    response = ready(pair)
    assert response.status_code == 503 and response.json()["status"] == "not_ready"
    assert response.json()["models"] == {"shared": {"ready": False, "backends": []}}
    assert {b["health"] for b in response.json()["backends"].values()} == {"ready"}
    assert gauges(pair, "gateway_model_ready") == {"shared": 0.0}
    assert httpx.get(pair.url + "/health").status_code == 200, "alive all the same"


def test_with_keys_an_anonymous_ready_tells_counts_not_the_models_a_key_cannot_see() -> None:
    """Security sweep, item 4: /ready, which a probe reads without a key, listed every model and backend, among
    them models that a key's allow-list hides from its /v1/models."""
    keys = {name: f"sk-{name}-0123" for name in ("client", "ops", "prometheus")}
    specs = [SimSpec(engine="vllm", model=m, name=f"b-{m}", time_scale=TIME_SCALE) for m in ("m-public", "m-secret")]
    with FleetThread(specs) as fleet:
        auth = {"keys": [
            {"name": "client", "key_sha256": hashlib.sha256(keys["client"].encode()).hexdigest(),
             "models": ["m-public"]},
            {"name": "ops", "key_sha256": hashlib.sha256(keys["ops"].encode()).hexdigest(), "scopes": ["admin"]},
            {"name": "prometheus", "key_sha256": hashlib.sha256(keys["prometheus"].encode()).hexdigest(),
             "scopes": ["metrics"]}]}
        app = create_app(gateway_settings(fleet.fleet.servers, auth=auth))
        with serve_in_thread(app) as gateway:

            def ready(key: str | None) -> httpx.Response:
                return httpx.get(gateway.url + "/ready",
                                 headers={"authorization": f"Bearer {key}"} if key is not None else {})

            wait_until(lambda: ready(keys["ops"]).json()["models"].get("m-secret", {}).get("ready") is True,
                       "m-secret ready")
            sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=keys["client"], max_retries=0)
            assert [m.id for m in sdk.models.list()] == ["m-public"]
            for key in (None, keys["client"], "sk-wrong"):
                response = ready(key)
                assert response.status_code == 200, (key, response.text)
                assert "m-secret" not in response.text and "b-m-" not in response.text, (key, response.text)
                body = response.json()
                assert (body["status"], body["ready_models"], body["known_models"], body["routable_backends"],
                        body["known_backends"]) == ("ready", 2, 2, 2, 2), body
            for key in (keys["ops"], keys["prometheus"]):
                body = ready(key).json()
                assert set(body["models"]) == {"m-public", "m-secret"} and set(body["backends"]) == {
                    "b-m-public", "b-m-secret"}, body
            # the status a probe reads follows readiness as before: nothing servable, 503 for everyone
            running = Running(fleet, gateway, app)
            for name in ("b-m-public", "b-m-secret"):
                eject(running, name)
            assert [ready(key).status_code for key in (None, keys["client"], keys["ops"])] == [503, 503, 503]
            assert ready(None).json()["status"] == "not_ready"
