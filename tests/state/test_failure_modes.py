"""With its Redis unreachable from the start, a gateway still serves: limited keys pass (on_failure: open,
counted) or get a clear 503 (closed); unlimited keys and routing are not affected either way."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port, serve_in_thread


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=20)]) as running:
        yield running


def gateway(fleet: FleetThread, on_failure: str) -> object:
    keys = [{"name": n, "key_sha256": hashlib.sha256(n.encode()).hexdigest(), **limits}
            for n, limits in (("limited", {"requests_per_minute": 100}), ("open", {}))]
    return create_app(settings_from_mapping({
        "backends": [{"name": "v", "engine": "vllm", "url": fleet.fleet["v"].url, "max_concurrency": 2}],
        "auth": {"keys": keys},
        "state": {"url": f"redis://127.0.0.1:{free_port()}/0", "on_failure": on_failure, "timeout_ms": 50},
    }))


def ask(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.mark.parametrize("on_failure", ["open", "closed"])
def test_limits_fail_as_configured_while_everything_else_serves(fleet: FleetThread, on_failure: str) -> None:
    with serve_in_thread(gateway(fleet, on_failure)) as gw:
        limited = ask(gw.url, "limited")
        if on_failure == "open":
            assert limited.status_code == 200
        else:
            assert limited.status_code == 503 and limited.json()["error"]["code"] == "limits_unavailable"
            assert limited.headers["retry-after"] == "1"
        assert ask(gw.url, "open").status_code == 200  # (its backend's max_concurrency is kept locally)
        metrics = httpx.get(gw.url + "/metrics").text
        assert "gateway_state_up 0.0" in metrics
        assert f"gateway_state_fail_open_total {1.0 if on_failure == 'open' else 0.0}" in metrics
