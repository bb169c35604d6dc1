"""Reloading the configuration while serving: a reload that adds a backend, removes one and changes a limit
under 100 streams drops none; an invalid file changes nothing; the routing section changed from the admin API;
SIGHUP and the file watch reload as the admin API does."""

from __future__ import annotations

import asyncio
import contextlib
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

from gateway.app import GatewayApp, create_app
from gateway.config import load_settings
from gateway.sim import FleetThread, SimSpec
from tests.conftest import ServerThread, free_port, serve_in_thread
from tests.waiting import until, until_true, wait_until

CLIENT_KEY, SMALL_KEY, OPS_KEY = "sk-client-0123", "sk-small-8910", "sk-ops-4567"
CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}
SMALL = {"authorization": f"Bearer {SMALL_KEY}"}
OPS = {"authorization": f"Bearer {OPS_KEY}"}
ASK = {"model": "m", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 48}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def config(fleet: FleetThread, names: list[str], *, small_rpm: int | None = None, **extra: Any) -> dict[str, Any]:
    servers = {s.spec.name: s for s in fleet.fleet.servers}
    small: dict[str, Any] = {"name": "small", "key_sha256": digest(SMALL_KEY)}
    if small_rpm is not None:
        small["requests_per_minute"] = small_rpm
    return {
        "backends": [{"name": n, "engine": "vllm", "url": servers[n].url} for n in names],
        "scrape": {"interval": 0.1, "timeout": 1.0},
        "auth": {"keys": [{"name": "client", "key_sha256": digest(CLIENT_KEY)}, small,
                          {"name": "ops", "key_sha256": digest(OPS_KEY), "scopes": ["admin"]}]},
        **extra,
    }


def write(path: Path, raw: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(raw))


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    """Three emulated vLLM serving one model at half their real time: a 48-token stream takes ~0.4 s."""
    with FleetThread([SimSpec(engine="vllm", model="m", name=f"v{x}", time_scale=2.0) for x in "abc"]) as running:
        yield running


@contextlib.contextmanager
def serving(path: Path) -> Iterator[tuple[ServerThread, GatewayApp]]:
    app = create_app(load_settings(path), config_path=str(path))
    with serve_in_thread(app) as gateway:
        yield gateway, app


async def stream(client: httpx.AsyncClient, content: str = "tell me") -> tuple[str, bool]:
    body = {**ASK, "messages": [{"role": "user", "content": content}], "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        text = "".join([chunk async for chunk in response.aiter_text()])
        return response.headers["x-gateway-backend"], text.rstrip().endswith("data: [DONE]")


def test_a_reload_that_adds_removes_and_changes_a_limit_drops_none_of_100_streams(fleet: FleetThread,
                                                                                  tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va", "vb"]))
    with serving(path) as (gateway, app):

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=gateway.url, headers=CLIENT, timeout=60,
                                         limits=httpx.Limits(max_connections=300)) as client:
                first = [asyncio.create_task(stream(client)) for _ in range(100)]
                pool = app.gateway.pool
                await until(lambda: all(pool.get(n).in_flight for n in ("va", "vb")), "streams on both backends")
                write(path, config(fleet, ["vb", "vc"], small_rpm=2, timeouts={"first_byte": 30}))
                reply = await client.post("/admin/reload", headers=OPS)
                assert reply.status_code == 200, reply.text
                result = reply.json()
                assert (result["added"], result["removed"], result["changed"]) == (["vc"], ["va"], [])
                assert set(result["sections"]) == {"backends", "auth", "timeouts"}
                assert result["restart_needed"] == []
                # (prompts of their own: the one above is cached on vb, where the prefix scorer would keep them)
                later = [asyncio.create_task(stream(client, f"{i} later")) for i in range(40)]
                done = await asyncio.gather(*first)
                assert all(complete for _, complete in done), "a stream was cut by the reload"
                assert "va" in {b for b, _ in done}  # (va had streams in flight when it was removed)
                after = await asyncio.gather(*later)
                assert all(complete for _, complete in after)
                assert "va" not in {b for b, _ in after}, "the removed backend got new requests"
                assert "vc" in {b for b, _ in after}  # (the added one, idle, takes them first)
                # the changed limit holds from the reload on
                small = [(await client.post("/v1/chat/completions", json={**ASK, "max_tokens": 2},
                                            headers=SMALL)).status_code for _ in range(3)]
                assert small == [200, 200, 429]
                # the removed backend leaves once its streams ended
                async def left() -> bool:
                    listed = (await client.get("/admin/backends", headers=OPS)).json()["backends"]
                    return {b["name"] for b in listed} == {"vb", "vc"}

                await until_true(left, "va gone from the backends listed")
                assert (await client.get("/admin/config", headers=OPS)).json()["timeouts"]["first_byte"] == 30

        asyncio.run(scenario())
        metrics = httpx.get(gateway.url + "/metrics").text
        assert 'gateway_config_reloads_total{result="applied"} 1.0' in metrics


def test_an_invalid_reload_changes_nothing_and_names_the_field(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va"]))
    with serving(path) as (gateway, _app):
        before = httpx.get(gateway.url + "/admin/config", headers=OPS).json()
        bad = config(fleet, ["va", "vb"])
        bad["backends"][1]["max_concurrency"] = -1
        write(path, bad)
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_config"
        assert "backends[1] (vb).max_concurrency" in reply.json()["error"]["message"]
        path.write_text("backends: [unclosed\n")
        reply = httpx.post(gateway.url + "/admin/reload", headers=OPS)
        assert reply.status_code == 400 and "not valid YAML" in reply.json()["error"]["message"]
        assert httpx.get(gateway.url + "/admin/config", headers=OPS).json() == before
        ok = httpx.post(gateway.url + "/v1/chat/completions", json={**ASK, "max_tokens": 2}, headers=CLIENT)
        assert ok.status_code == 200 and ok.headers["x-gateway-backend"] == "va"
        assert 'gateway_config_reloads_total{result="rejected"} 2.0' in httpx.get(gateway.url + "/metrics").text


def test_restart_only_sections_keep_their_running_values(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va"]))
    with serving(path) as (gateway, _app):
        write(path, config(fleet, ["va"], scrape={"interval": 0.5, "timeout": 1.0}, limits={"max_messages": 8}))
        result = httpx.post(gateway.url + "/admin/reload", headers=OPS).json()
        assert result["restart_needed"] == ["scrape"] and result["sections"] == ["limits"]
        effective = httpx.get(gateway.url + "/admin/config", headers=OPS).json()
        assert effective["scrape"]["interval"] == 0.1 and effective["limits"]["max_messages"] == 8
        many = {**ASK, "messages": [{"role": "user", "content": "x"}] * 9}
        assert httpx.post(gateway.url + "/v1/chat/completions", json=many, headers=CLIENT).status_code == 400


def test_routing_is_changed_from_the_admin_api_and_validated(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va", "vb"]))
    with serving(path) as (gateway, app):
        reply = httpx.put(gateway.url + "/admin/routing", headers=OPS, json={"policy": "round-robin"})
        assert reply.status_code == 200 and reply.json()["sections"] == ["routing"]
        assert app.gateway.dispatcher.pipeline.policy == "round-robin"
        seen = [httpx.post(gateway.url + "/v1/chat/completions", json={**ASK, "max_tokens": 2},
                           headers=CLIENT).headers["x-gateway-backend"] for _ in range(4)]
        assert sorted(seen) == ["va", "va", "vb", "vb"]
        unknown = httpx.put(gateway.url + "/admin/routing", headers=OPS, json={"policy": "nope"})
        assert unknown.status_code == 400 and "unknown policy" in unknown.json()["error"]["message"]
        typo = httpx.put(gateway.url + "/admin/routing", headers=OPS, json={"polcy": "least-load"})
        assert typo.status_code == 400 and "polcy" in typo.json()["error"]["message"]
        assert app.gateway.dispatcher.pipeline.policy == "round-robin"
        assert httpx.put(gateway.url + "/admin/routing", headers=CLIENT, json={}).status_code == 403


def test_the_file_watch_reloads_a_changed_file(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va"], server={"reload_watch_seconds": 0.1}))
    with serving(path) as (_gateway, app):
        write(path, config(fleet, ["va", "vb"], server={"reload_watch_seconds": 0.1}))
        wait_until(lambda: {b.name for b in app.gateway.pool} == {"va", "vb"}, "the watch reloading the file")


@pytest.mark.system
def test_sighup_reloads_the_file_of_gateway_serve(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    port = free_port()
    # the file's port is overridden by the flag: a reload must not take that for a change (QA: every reload
    # answered restart_needed ["server"])
    write(path, config(fleet, ["va"], server={"port": 9}))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(path), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def backends() -> set[str]:
        return {b["name"] for b in httpx.get(url + "/admin/backends", headers=OPS).json()["backends"]}

    def ready() -> bool:
        assert proc.poll() is None, "gateway serve exited"
        try:
            return httpx.get(url + "/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, "gateway serve ready", within=30)
        assert backends() == {"va"}
        write(path, config(fleet, ["va", "vc"], server={"port": 9}))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: backends() == {"va", "vc"}, "SIGHUP reloading the file")
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "reload by SIGHUP applied" in output, output[-3000:]
    assert "needs a restart" not in output, output[-3000:]


def test_a_reload_applies_a_new_alias(fleet: FleetThread, tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    write(path, config(fleet, ["va"]))
    with serving(path) as (gateway, _app):
        aliased = {**ASK, "model": "chat", "max_tokens": 2}
        assert httpx.post(gateway.url + "/v1/chat/completions", json=aliased, headers=CLIENT).status_code == 404
        write(path, config(fleet, ["va"], models={"chat": {"targets": [{"model": "m"}]}}))
        result = httpx.post(gateway.url + "/admin/reload", headers=OPS).json()
        assert result["sections"] == ["models"]
        reply = httpx.post(gateway.url + "/v1/chat/completions", json=aliased, headers=CLIENT)
        assert reply.status_code == 200 and reply.headers["x-gateway-model"] == "m"
