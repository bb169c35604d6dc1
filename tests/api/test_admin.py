"""The admin API over HTTP, in front of emulated engines: who may reach it, what it reports, and a drain under
load that loses no stream and sends no new request to the drained backend."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.config import ConfigError, settings_from_mapping
from gateway.errors import GatewayError
from gateway.routing.policies import check_settings
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import Running, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import until, until_true

CLIENT_KEY, OPS_KEY = "sk-client-0123", "sk-ops-4567"
AUTH = {"keys": [
    {"name": "client", "key_sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()},
    {"name": "ops", "key_sha256": hashlib.sha256(OPS_KEY.encode()).hexdigest(), "scopes": ["admin"]},
]}
OPS = {"authorization": f"Bearer {OPS_KEY}"}
CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}


@pytest.fixture(scope="module")
def two() -> Iterator[Running]:
    """Two emulated vLLM serving one model at half their real time: a 64-token stream takes ~0.5 s."""
    specs = [SimSpec(engine="vllm", model="m", name=f"v{x}", time_scale=2.0, api_key="sk-upstream-secret")
             for x in "ab"]
    with FleetThread(specs) as fleet:
        settings = gateway_settings(fleet.fleet.servers, auth=AUTH)
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


def test_the_admin_api_refuses_client_keys_and_missing_keys(two: Running) -> None:
    for method, path in (("GET", "/admin/backends"), ("POST", "/admin/backends/va/drain"), ("GET", "/admin/config")):
        missing = httpx.request(method, two.url + path)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        client = httpx.request(method, two.url + path, headers=CLIENT)
        assert client.status_code == 403 and client.json()["error"]["code"] == "insufficient_scope"
    assert not two.app.gateway.pool.get("va").drained  # (the refused drain did nothing)
    # a change from another site's page is refused on the main port as on the admin listener (QA drained va
    # with Origin: http://evil.example); reading is not a change
    evil = {**OPS, "origin": "http://evil.example"}
    cross = httpx.post(two.url + "/admin/backends/va/drain", headers=evil)
    assert cross.status_code == 403 and cross.json()["error"]["code"] == "cross_origin_refused"
    assert not two.app.gateway.pool.get("va").drained
    assert httpx.get(two.url + "/admin/backends", headers=evil).status_code == 200
    # and an admin key is not a client key
    chat = httpx.post(two.url + "/v1/chat/completions", headers=OPS,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 403


def test_a_gateway_without_keys_serves_no_admin_api() -> None:
    fleet = FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=20.0)])
    with fleet, serve_in_thread(create_app(gateway_settings(fleet.fleet.servers))) as gateway:
        reply = httpx.post(gateway.url + "/admin/backends/v/drain")
        assert reply.status_code == 403 and reply.json()["error"]["code"] == "admin_disabled"
        assert httpx.get(gateway.url + "/ready").status_code == 200


def test_backends_report_state_load_and_capacity(two: Running) -> None:
    reply = httpx.get(two.url + "/admin/backends", headers=OPS)
    assert reply.status_code == 200 and "x-request-id" in reply.headers
    backends = {b["name"]: b for b in reply.json()["backends"]}
    assert set(backends) == {"va", "vb"}
    va = backends["va"]
    assert va["engine"] == "vllm" and va["models"] == ["m"] and va["state"] == "serving" and va["routable"]
    assert va["health"] == "ready" and va["breaker"] == "closed" and va["drained"] is False
    assert va["load"] is not None and va["load"]["fresh"] and 0 <= va["load"]["age_seconds"] < 5
    assert va["in_flight"] == 0 and isinstance(va["slots"], int)
    unknown = httpx.get(two.url + "/admin/backends/nope", headers=OPS)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "backend_not_found"


def test_the_effective_config_has_every_secret_redacted(two: Running) -> None:
    reply = httpx.get(two.url + "/admin/config", headers=OPS)
    assert reply.status_code == 200
    text = reply.text
    config = orjson.loads(text)
    assert {b["name"] for b in config["backends"]} == {"va", "vb"}
    assert config["auth"]["keys"][1]["scopes"] == ["admin"]
    for secret in ("sk-upstream-secret", hashlib.sha256(OPS_KEY.encode()).hexdigest(), OPS_KEY, CLIENT_KEY):
        assert secret not in text
    assert config["backends"][0]["api_key"] == "[redacted]" and config["auth"]["keys"][0]["key_sha256"] == "[redacted]"


def test_redaction_of_urls_and_nested_secrets() -> None:
    from gateway.control import redact, redact_url

    assert redact_url("redis://:hunter2@redis:6379/0") == "redis://[redacted]@redis:6379/0"
    assert redact_url("http://10.0.0.7:8000") == "http://10.0.0.7:8000"
    assert redact({"state": {"url": "rediss://user:pw@h/1"}, "x": [{"basic_auth": "u:p"}], "api_key": None}) == {
        "state": {"url": "rediss://[redacted]@h/1"}, "x": [{"basic_auth": "[redacted]"}], "api_key": None}


STREAM = {"model": "m", "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 64, "stream": True}


async def stream(client: httpx.AsyncClient) -> tuple[str, bool]:
    """One 64-token stream: the backend that served it, and whether it ended with [DONE]."""
    async with client.stream("POST", "/v1/chat/completions", json=STREAM) as response:
        assert response.status_code == 200
        text = "".join([chunk async for chunk in response.aiter_text()])
        return response.headers["x-gateway-backend"], text.rstrip().endswith("data: [DONE]")


def test_drain_under_50_streams_loses_none_and_routes_nothing_new_to_it(two: Running) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=two.url, headers=CLIENT, timeout=60,
                                     limits=httpx.Limits(max_connections=200)) as client:
            first = [asyncio.create_task(stream(client)) for _ in range(50)]
            pool = two.app.gateway.pool
            await until(lambda: all(pool.get(n).in_flight for n in ("va", "vb")), "streams on both backends")
            reply = await client.post("/admin/backends/va/drain", headers=OPS)
            assert reply.status_code == 200 and reply.json()["drained"] is True
            assert reply.json()["state"] == "draining"  # its streams are still running
            later = [asyncio.create_task(stream(client)) for _ in range(30)]
            done = await asyncio.gather(*first)
            assert all(complete for _, complete in done), "a stream was cut by the drain"
            assert {backend for backend, _ in done} == {"va", "vb"}  # (va had streams to finish)
            after = await asyncio.gather(*later)
            assert all(complete for _, complete in after)
            assert {backend for backend, _ in after} == {"vb"}, "a request went to the drained backend"
            # once its last stream ended it is reported idle
            async def drained() -> bool:
                return bool((await client.get("/admin/backends/va", headers=OPS)).json()["state"] == "drained")

            await until_true(drained, "va reported drained")
            assert (await client.get("/admin/backends/va", headers=OPS)).json()["in_flight"] == 0
            assert (await client.post("/admin/backends/va/undrain", headers=OPS)).json()["state"] == "serving"
            # routed to again: with the other drained it is the only one left (the prefix index would otherwise
            # keep this prompt on vb, where the 30 went)
            assert (await client.post("/admin/backends/vb/drain", headers=OPS)).status_code == 200
            again = await asyncio.gather(*(stream(client) for _ in range(8)))
            assert {backend for backend, _ in again} == {"va"}
            assert (await client.post("/admin/backends/vb/undrain", headers=OPS)).status_code == 200

    try:
        asyncio.run(scenario())
    finally:
        for name in ("va", "vb"):
            two.app.gateway.pool.get(name).drained = False
    metrics = httpx.get(two.url + "/metrics").text
    assert 'gateway_admin_changes_total{action="drain"} 2.0' in metrics
    assert 'gateway_admin_changes_total{action="undrain"} 2.0' in metrics


def test_a_model_whose_every_backend_is_drained_is_unavailable_not_unknown(two: Running) -> None:
    try:
        for name in ("va", "vb"):
            assert httpx.post(f"{two.url}/admin/backends/{name}/drain", headers=OPS).status_code == 200
        reply = httpx.post(two.url + "/v1/chat/completions", headers=CLIENT,
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        # (how many and in what state, naming none: sweep 24)
        assert "left none of 2: 2 drained, 2 ready" in message and "va" not in message, message
    finally:
        for name in ("va", "vb"):
            httpx.post(f"{two.url}/admin/backends/{name}/undrain", headers=OPS)
    ok = httpx.post(two.url + "/v1/chat/completions", headers=CLIENT,
                    json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200


def test_backends_report_recent_ttft_tokens_and_decisions(two: Running) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 16, "stream": True}
    for i in range(6):
        with httpx.stream("POST", two.url + "/v1/chat/completions", headers={**CLIENT, "x-session-id": f"r{i}"},
                          json=body, timeout=30) as reply:
            assert reply.status_code == 200
            reply.read()
    backends = httpx.get(two.url + "/admin/backends", headers=OPS).json()["backends"]
    recent = [b["recent"] for b in backends]
    assert sum(r["requests"] for r in recent) >= 6 and all(r["window_seconds"] == 60.0 for r in recent)
    busy = max(recent, key=lambda r: r["requests"])
    assert busy["ttft_p50_ms"] > 0 and busy["ttft_p95_ms"] >= busy["ttft_p50_ms"]
    assert busy["tokens_per_second"] > 0 and busy["errors"] == 0
    assert sum(busy["decisions"].values()) == busy["requests"]
    one = httpx.get(two.url + "/admin/backends/va", headers=OPS).json()
    assert set(one["recent"]) == set(recent[0])


def test_the_status_reading_has_series_queue_models_and_decisions(two: Running) -> None:
    status = httpx.get(two.url + "/admin/status", headers=OPS).json()
    assert status["step_seconds"] == 2.0 and status["window_seconds"] == 60.0 and status["workers"] == 1
    assert {b["name"] for b in status["backends"]} == {"va", "vb"}
    for b in status["backends"]:
        assert set(b["series"]) == {"requests", "ttft_ms", "tokens_per_second", "in_flight"}
        assert all(len(v) == 60 for v in b["series"].values())
    assert status["queue"]["queued"] == 0 and len(status["queue"]["series"]) == 60
    assert status["models"] == {"served": {"m": ["va", "vb"]}, "aliases": {}}
    assert isinstance(status["decisions"], dict)
    assert httpx.get(two.url + "/admin/status", headers=CLIENT).status_code == 403


def test_backends_added_and_removed_at_runtime() -> None:
    """Add a backend through the admin API (probed, then routed to), remove one under 20 streams (drained first:
    none cut, nothing new sent to it, then gone); refusals name what is wrong."""
    specs = [SimSpec(engine="vllm", model="m", name=name, time_scale=4.0) for name in ("va", "vb")]
    with FleetThread(specs) as fleet:
        va, vb = fleet.fleet.servers
        settings = gateway_settings([va], auth=AUTH)
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            url = gateway.url
            added = httpx.post(url + "/admin/backends", headers=OPS,
                               json={"name": "vb", "engine": "vllm", "url": vb.url, "max_concurrency": 64})
            assert added.status_code == 200, added.text
            assert added.json()["added"] == ["vb"] and added.json()["backend"]["state"] == "serving"
            assert added.json()["backend"]["max_concurrency"] == 64
            names = [b["name"] for b in httpx.get(url + "/admin/backends", headers=OPS).json()["backends"]]
            assert names == ["va", "vb"]
            # refusals: the same name again, a field at fault, a DNS entry, an unknown name to remove
            again = httpx.post(url + "/admin/backends", headers=OPS, json={"name": "vb", "engine": "vllm",
                                                                            "url": vb.url})
            assert again.status_code == 409 and again.json()["error"]["code"] == "backend_exists"
            bad = httpx.post(url + "/admin/backends", headers=OPS, json={"name": "vc", "engine": "nope",
                                                                          "url": vb.url})
            assert bad.status_code == 400 and "engine" in bad.json()["error"]["message"]
            dns = httpx.post(url + "/admin/backends", headers=OPS, json={"name": "vd", "engine": "vllm",
                                                                          "dns": "x.local", "port": 1})
            assert dns.status_code == 400 and dns.json()["error"]["param"] == "dns"
            assert httpx.delete(url + "/admin/backends/nope", headers=OPS).status_code == 404
            assert httpx.post(url + "/admin/backends", headers=CLIENT, json={}).status_code == 403

            async def scenario() -> None:
                async with httpx.AsyncClient(base_url=url, headers=CLIENT, timeout=60) as client:
                    first = [asyncio.create_task(stream(client)) for _ in range(20)]
                    pool = app.gateway.pool
                    await until(lambda: pool.get("va").in_flight, "a stream on va")
                    removed = await client.delete("/admin/backends/va", headers=OPS)
                    assert removed.status_code == 200 and removed.json()["removed"] == ["va"]
                    assert removed.json()["backend"]["state"] == "removing"
                    later = await asyncio.gather(*(stream(client) for _ in range(10)))
                    assert {b for b, _ in later} == {"vb"} and all(done for _, done in later)
                    done = await asyncio.gather(*first)
                    assert all(complete for _, complete in done), "a stream was cut by the removal"
                    assert "va" in {b for b, _ in done}
                    async def gone() -> bool:  # once its last stream ended
                        listed = (await client.get("/admin/backends", headers=OPS)).json()["backends"]
                        return [b["name"] for b in listed] == ["vb"]

                    await until_true(gone, "va gone from the backends listed")

            asyncio.run(scenario())
            metrics = httpx.get(url + "/metrics").text
            assert 'gateway_admin_changes_total{action="add_backend"} 1.0' in metrics
            assert 'gateway_admin_changes_total{action="remove_backend"} 1.0' in metrics


def test_the_admin_api_reads_no_environment_variable_and_no_file_of_the_gateway(
        two: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """An admin key added a backend with ``api_key_env: AWS_SECRET_ACCESS_KEY`` at a URL of its own and was sent
    the variable's value; a routing change named any file to read (engine_profile) or probe (tokenizers), and
    could make the session header a credential one."""
    monkeypatch.setenv("GATEWAY_TEST_SECRET", "aws-secret-0123")
    catcher = {"name": "catch", "engine": "vllm", "url": "http://127.0.0.1:9", "models": ["m"]}
    before = httpx.get(two.url + "/admin/config", headers=OPS).json()
    for body in ({**catcher, "api_key_env": "GATEWAY_TEST_SECRET"},
                 {**catcher, "kv_events": {"port": 5557, "endpoint_env": "GATEWAY_TEST_SECRET"}}):
        reply = httpx.post(two.url + "/admin/backends", headers=OPS, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_config", reply.text
        assert "send api_key, or add the backend to the file" in reply.json()["error"]["message"]
        # the same body from another replica (the shared state's message) is refused alike
        with pytest.raises(GatewayError) as remote:
            two.gateway.call(two.app.gateway.control.add_backend(body, "another replica (r2)", tell=False))
        assert remote.value.status == 400
    assert [b.name for b in two.app.gateway.pool] == ["va", "vb"]
    answers = set()
    for field, value in (("engine_profile", "/etc/passwd"), ("engine_profile", "/no/such/file"),
                         ("engine_profile", "/dev/zero"), ("tokenizers", {"m": "/etc"})):
        reply = httpx.put(two.url + "/admin/routing", headers=OPS, json={field: value}, timeout=20)
        assert reply.status_code == 400, reply.text
        answers.add(reply.json()["error"]["message"].replace(field, "FIELD"))
    assert len(answers) == 1 and "read at start only" in answers.pop()  # (nothing tells a file exists)
    for header in ("Authorization", "x-api-key", "Cookie", "proxy-authorization"):
        reply = httpx.put(two.url + "/admin/routing", headers=OPS, json={"session_header": header})
        assert reply.status_code == 400 and "carries credentials" in reply.json()["error"]["message"], reply.text
    assert httpx.get(two.url + "/admin/config", headers=OPS).json() == before


@pytest.mark.parametrize(("plugin", "param"), [
    ({"filters": ["healthy", {"name": "fits-context", "bytes_per_token": 0}]}, "bytes_per_token"),
    ({"scorers": [{"name": "session", "ttl": "an hour"}]}, "ttl"),
    ({"scorers": [{"name": "prefix", "wait_credit": 7}]}, "wait_credit"),
    ({"picker": {"name": "consistent-hash", "vnodes": 10**9}}, "vnodes"),
    ({"picker": {"name": "max-score", "rng": 5}}, "rng"),
])
def test_a_routing_change_with_a_bad_plugin_parameter_is_refused_naming_it(two: Running, plugin: dict[str, object],
                                                                          param: str) -> None:
    """Plugin parameters were handed to the plugin unchecked, and each of these was applied (200): with
    ``bytes_per_token: 0`` every request then divided by zero in the filter (a 500), ``vnodes: 10**9`` left a ring
    of a billion points per backend to build at the next request. Now the change is refused naming the parameter,
    as the file's is, and nothing changes."""
    before = httpx.get(two.url + "/admin/config", headers=OPS).json()
    body = {"policy": "mine", "profiles": {"mine": plugin}}
    reply = httpx.put(two.url + "/admin/routing", headers=OPS, json=body)
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_config", reply.text
    assert f": {param}: " in reply.json()["error"]["message"]
    assert httpx.get(two.url + "/admin/config", headers=OPS).json() == before
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(two.url + "/v1/chat/completions", headers=CLIENT, json=ask).status_code == 200
    with pytest.raises(ConfigError, match=rf": {param}: "):  # (the file's load refuses it alike)
        check_settings(settings_from_mapping({"routing": body}))
