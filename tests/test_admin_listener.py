"""``server.admin_port``: `gateway serve` runs a second listener with the admin API alone, beside the main one,
and stops both on SIGTERM."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port
from tests.files import write_config
from tests.waiting import wait_until

pytestmark = pytest.mark.system

CLIENT_KEY, OPS_KEY = "sk-client-0123", "sk-ops-4567"


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread([SimSpec(engine="vllm", model="m", name="va", time_scale=20.0)]) as running:
        yield running


def serve(path: Path, raw: dict[str, Any]) -> subprocess.Popen[str]:
    write_config(path, yaml.safe_dump(raw))
    return subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_ready(proc: subprocess.Popen[Any], url: str) -> None:
    def ready() -> bool:
        assert proc.poll() is None, "gateway exited"
        try:
            return httpx.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, "gateway ready", within=30)


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    return output


def keys(admin: bool) -> dict[str, Any]:
    entries: list[dict[str, Any]] = [{"name": "client", "key_sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}]
    if admin:
        entries.append({"name": "ops", "key_sha256": hashlib.sha256(OPS_KEY.encode()).hexdigest(), "scopes": ["admin"]})
    return {"keys": entries}


def test_the_admin_listener_serves_the_admin_api_alone_and_stops_with_the_gateway(fleet: FleetThread,
                                                                                 tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    proc = serve(tmp_path / "gateway.yaml", {
        "server": {"port": port, "admin_port": admin_port},
        "backends": [{"name": "va", "engine": "vllm", "url": fleet.fleet.servers[0].url}],
        "auth": keys(admin=False)})
    main, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, main)
        # no key has the admin scope: the loopback listener is trusted by its address
        backends = httpx.get(admin + "/admin/backends").json()["backends"]
        assert [b["name"] for b in backends] == ["va"]
        assert httpx.post(admin + "/admin/backends/va/drain").json()["state"] in ("draining", "drained")
        assert httpx.post(admin + "/admin/backends/va/undrain").json()["state"] == "serving"
        # ... and serves nothing else
        assert httpx.post(admin + "/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 404
        assert httpx.get(admin + "/metrics").status_code == 404
        # the main port's admin API still wants an admin key, which no key has here
        refused = httpx.get(main + "/admin/backends", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert refused.status_code == 403
        chat = httpx.post(main + "/v1/chat/completions", headers={"authorization": f"Bearer {CLIENT_KEY}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200
    finally:
        output = stop(proc)
    assert "admin: a caller on the admin listener (no key) drained backend va" in output
    for url in (main, admin):
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)


def test_with_admin_keys_the_admin_listener_asks_for_one(fleet: FleetThread, tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    proc = serve(tmp_path / "gateway.yaml", {
        "server": {"port": port, "admin_port": admin_port},
        "backends": [{"name": "va", "engine": "vllm", "url": fleet.fleet.servers[0].url}],
        "auth": keys(admin=True)})
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        assert httpx.get(admin + "/admin/backends").status_code == 401
        client = httpx.get(admin + "/admin/backends", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert client.status_code == 403 and client.json()["error"]["code"] == "insufficient_scope"
        assert httpx.get(admin + "/admin/backends", headers={"authorization": f"Bearer {OPS_KEY}"}).status_code == 200
    finally:
        stop(proc)
