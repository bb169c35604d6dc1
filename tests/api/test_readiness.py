"""Readiness means "can serve": a model whose every backend is ejected by its circuit breaker is not ready,
in /ready and in the Prometheus gauges, and the gateway leaves the Service only when no model is ready."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import Running

FAR = 3600.0  # an ejection that outlasts the test, whatever the machine's load


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


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
    wait_until(lambda: all_ready(engines))
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
    wait_until(lambda: all_ready(pair))
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
