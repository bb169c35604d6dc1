"""What the gateway exposes beyond the OpenAI API: API docs only when asked for, /metrics only to keys with
the metrics scope, models only to keys allowed them, no redirect built from the client's Host header, no server
software named."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import ServerThread, serve_in_thread
from tests.waiting import wait_until

ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
APP, PROM, OPS = "sk-app", "sk-prometheus", "sk-ops"


def key(name: str, secret: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(), **extra}


@pytest.fixture(scope="module")
def keyed() -> Iterator[Running]:
    specs = [SimSpec(engine="vllm", model=m, name=m, time_scale=TIME_SCALE) for m in ("m", "other")]
    auth = {"keys": [key("app", APP, models=["m"]),
                     key("prometheus", PROM, scopes=["metrics"]),
                     key("ops", OPS, scopes=["inference", "metrics"])],
            "protect_metrics": True, "protect_health": True}
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers, auth=auth))
        with serve_in_thread(app) as gateway:
            running = Running(fleet, gateway, app)
            wait_until(lambda: {m.id for m in sdk(running, OPS).models.list()} == {"m", "other"},
                       "the backends up, their models listed")
            yield running


def sdk(running: Running, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key=secret, max_retries=0)


def get(running: Running, path: str, secret: str | None = None, **headers: str) -> httpx.Response:
    if secret is not None:
        headers["authorization"] = f"Bearer {secret}"
    return httpx.get(running.url + path, headers=headers)


def assert_refused(response: httpx.Response, status: int, code: str | None) -> None:
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_metrics_need_the_metrics_scope(keyed: Running) -> None:
    assert_refused(get(keyed, "/metrics"), 401, "missing_api_key")
    assert_refused(get(keyed, "/metrics", APP), 403, "insufficient_scope")
    for secret in (PROM, OPS):
        response = get(keyed, "/metrics", secret)
        assert response.status_code == 200 and "gateway_backend_ready" in response.text


def test_the_api_needs_the_inference_scope(keyed: Running) -> None:
    with pytest.raises(openai.PermissionDeniedError) as err:
        sdk(keyed, PROM).chat.completions.create(model="m", messages=ASK, max_tokens=2)
    assert err.value.code == "insufficient_scope"
    with pytest.raises(openai.PermissionDeniedError):
        sdk(keyed, PROM).models.list()
    assert sdk(keyed, APP).chat.completions.create(model="m", messages=ASK, max_tokens=2).choices
    assert get(keyed, "/health", PROM).status_code == 200, "health takes any valid key"
    assert_refused(get(keyed, "/health"), 401, "missing_api_key")


def test_models_are_listed_only_to_keys_allowed_them(keyed: Running) -> None:
    assert [m.id for m in sdk(keyed, APP).models.list()] == ["m"]
    assert [m.id for m in sdk(keyed, OPS).models.list()] == ["m", "other"]
    assert sdk(keyed, APP).models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as err:
        sdk(keyed, APP).models.retrieve("other")
    assert err.value.code == "model_not_found", "as if it did not exist"
    assert sdk(keyed, OPS).models.retrieve("other").id == "other"


def test_a_trailing_slash_is_not_redirected_to_the_clients_host(keyed: Running) -> None:
    for path in ("/metrics/", "/health/", "/ready/", "/openapi.json/"):
        response = get(keyed, path, OPS, host="attacker.example")
        assert_refused(response, 404, None)
        assert "location" not in response.headers
    assert get(keyed, "/metrics", OPS).status_code == 200


@pytest.fixture(scope="module")
def bare() -> Iterator[ServerThread]:
    with serve_in_thread(create_app(settings_from_mapping({}))) as server:
        yield server


def test_api_docs_are_off_by_default_and_the_schema_stays(bare: ServerThread) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert_refused(httpx.get(bare.url + path), 404, None)
    schema = httpx.get(bare.url + "/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]


def test_api_docs_when_asked_for() -> None:
    with serve_in_thread(create_app(settings_from_mapping({"server": {"docs": True}}))) as server:
        for path in ("/docs", "/redoc"):
            page = httpx.get(server.url + path)
            assert page.status_code == 200 and "/openapi.json" in page.text


def test_responses_do_not_announce_the_server_software(keyed: Running) -> None:
    reply = httpx.post(keyed.url + "/v1/chat/completions", headers={"authorization": f"Bearer {APP}"},
                       json={"model": "m", "messages": ASK, "max_tokens": 2})
    assert reply.status_code == 200 and "server" not in reply.headers and "date" in reply.headers
    assert "server" not in httpx.get(keyed.url + "/health").headers
