"""Each engine's own API-key rules."""

from __future__ import annotations

import httpx
import pytest

from gateway.sim import FleetThread, default_fleet_specs

KEY = "sekrit"
CHAT = {"model": "sim-llama-2-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def keyed() -> FleetThread:  # type: ignore[misc]
    with FleetThread(default_fleet_specs(base_port=0, time_scale=50, api_key=KEY)) as ft:
        yield ft


def call(ft: FleetThread, engine: str, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    with httpx.Client(timeout=10) as c:
        r = c.request(method, ft.fleet[f"sim-{engine}"].url + path, headers=headers,
                      json=CHAT if method == "POST" else None)
        return r.status_code


@pytest.mark.parametrize("engine", ["llamacpp", "vllm", "sglang", "tabbyapi"])
def test_bearer_works_everywhere_and_no_key_is_refused(keyed: FleetThread, engine: str) -> None:
    assert call(keyed, engine, "POST", "/v1/chat/completions", {"Authorization": f"Bearer {KEY}"}) == 200
    assert call(keyed, engine, "POST", "/v1/chat/completions") == 401
    assert call(keyed, engine, "POST", "/v1/chat/completions", {"Authorization": "Bearer wrong"}) == 401
    assert call(keyed, engine, "GET", "/health") == 200


@pytest.mark.parametrize(("engine", "x_api_key_ok"),
                         [("llamacpp", True), ("tabbyapi", True), ("vllm", False), ("sglang", False)])
def test_x_api_key_header(keyed: FleetThread, engine: str, x_api_key_ok: bool) -> None:
    status = call(keyed, engine, "POST", "/v1/chat/completions", {"X-Api-Key": KEY})
    assert (status == 200) == x_api_key_ok


@pytest.mark.parametrize(("engine", "metrics_open"), [("llamacpp", False), ("vllm", True), ("sglang", True)])
def test_metrics_auth(keyed: FleetThread, engine: str, metrics_open: bool) -> None:
    assert (call(keyed, engine, "GET", "/metrics") == 200) == metrics_open


def test_error_bodies_for_401(keyed: FleetThread) -> None:
    with httpx.Client(timeout=10) as c:
        llama = c.get(keyed.fleet["sim-llamacpp"].url + "/slots").json()
        vllm = c.get(keyed.fleet["sim-vllm"].url + "/v1/models").json()
        tabby = c.get(keyed.fleet["sim-tabbyapi"].url + "/v1/model").json()
    assert llama == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert vllm == {"error": "Unauthorized"}
    assert tabby == {"detail": "Invalid API key"}
