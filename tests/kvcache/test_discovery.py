"""``kv_events: discover`` end to end: emulated vLLM and SGLang publishing their KV events on a wildcard host
(``tcp://*:PORT``) and saying so (vLLM ``/kv_event_sources``, SGLang ``/server_info``); the gateway reads where,
connects at the backend's own host, and routes on the engines' events. A vLLM publishing nothing keeps the
approximate index, said once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from gateway.sim.tokenizer_files import ensure_tokenizer
from tests.conftest import serve_in_thread
from tests.kvcache.test_e2e import MODEL, chat
from tests.waiting import wait_until

WILDCARD = {"endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*", "topic": "kv@here"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def discovered(tokenizer: Path) -> Iterator[tuple[Any, Any, Any]]:
    specs = [SimSpec(engine="vllm", model=MODEL, name="dv", time_scale=50.0, tokenizer=str(tokenizer),
                     kv_events=WILDCARD),
             SimSpec(engine="sglang", model=MODEL, name="ds", time_scale=50.0, tokenizer=str(tokenizer),
                     kv_events=WILDCARD),
             SimSpec(engine="vllm", model=MODEL, name="dn", time_scale=50.0, tokenizer=str(tokenizer))]
    with FleetThread(specs) as fleet:
        backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url, "kv_events": "discover"}
                    for s in fleet.fleet.servers]
        settings = settings_from_mapping({"backends": backends, "scrape": {"interval": 0.1, "timeout": 1.0},
                                          "routing": {"tokenizers": {MODEL: str(tokenizer)},
                                                      "policy": "precise-prefix"}})
        app = create_app(settings)
        with serve_in_thread(app) as gateway:
            yield fleet, gateway, app


def test_the_engines_say_where_they_publish_as_the_released_engines_do(discovered: tuple[Any, Any, Any]) -> None:
    fleet, _gateway, _app = discovered
    v, s, n = (fleet.fleet[name] for name in ("dv", "ds", "dn"))
    sources = httpx.get(v.url + "/kv_event_sources").json()
    port = v.kv_events_endpoint.rsplit(":", 1)[1]
    assert sources["0"]["endpoint"] == f"tcp://*:{port}" and sources["0"]["topic"] == "kv@here"
    assert httpx.get(n.url + "/kv_event_sources").json() == {}
    info = httpx.get(s.url + "/server_info").json()["kv_events"]
    assert info["endpoint_host"] == "*" and info["endpoint_port_base"] == int(s.kv_events_endpoint.rsplit(":", 1)[1])
    assert info["replay_endpoint_port_base"] == int(s.kv_replay_endpoint.rsplit(":", 1)[1])


def test_discovered_streams_are_followed_at_the_backends_host_and_route_requests(
        discovered: tuple[Any, Any, Any]) -> None:
    fleet, gateway, app = discovered
    hub = app.gateway.kv_events
    for name in ("dv", "ds"):
        server = fleet.fleet[name]
        settings = hub.streams[name].settings
        assert settings.endpoint == "tcp://127.0.0.1:" + server.kv_events_endpoint.rsplit(":", 1)[1]
        assert settings.replay_endpoint == "tcp://127.0.0.1:" + server.kv_replay_endpoint.rsplit(":", 1)[1]
        assert settings.topic == "kv@here"
    assert "dn" not in hub.streams  # it publishes nothing: the approximate index
    for name in ("dv", "ds"):  # straight to each engine: what it stores reaches the gateway's index by its events
        assert httpx.post(fleet.fleet[name].url + "/v1/chat/completions", json=chat(f"to {name}")).status_code == 200
    wait_until(lambda: all(hub.streams[name].live() and hub.streams[name].counters.batches > 0
                           for name in ("dv", "ds")), "both streams live, with a batch each")
    metrics = httpx.get(f"{gateway.url}/metrics").text
    for name in ("dv", "ds"):
        assert f'gateway_kv_events_live{{backend="{name}"}} 1.0' in metrics
        assert float(metrics.split(f'gateway_kv_event_index_blocks{{backend="{name}"}} ')[1].split()[0]) > 0
    # and routing follows them: a conversation sent to one engine is routed back to it by its events
    home = fleet.fleet["ds"]
    body = chat("a question held by ds")
    stored = hub.streams["ds"].index.stored_blocks
    httpx.post(home.url + "/v1/chat/completions", json=body)
    wait_until(lambda: hub.streams["ds"].index.stored_blocks > stored, "its blocks announced")
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json={**body, "max_tokens": 4},
                   headers={"x-gateway-debug": "route"})
    assert r.headers["x-gateway-backend"] == "ds"
    assert r.headers["x-gateway-route-reason"].startswith("precise-prefix")


def test_an_engine_that_shows_no_source_is_said_once(tokenizer: Path, caplog: pytest.LogCaptureFixture) -> None:
    with FleetThread([SimSpec(engine="sglang", model=MODEL, name="q", time_scale=50.0)]) as fleet:
        server = fleet.fleet["q"]
        settings = settings_from_mapping({"backends": [{"name": "q", "engine": "sglang", "url": server.url,
                                                        "kv_events": {"discover": True, "silence_seconds": 5}}],
                                          "scrape": {"interval": 0.05, "timeout": 1.0}})
        app = create_app(settings)
        pool = app.gateway.pool
        scrape, scraped = pool.scrape_once, [0]

        async def counted(backend: Any) -> None:
            await scrape(backend)
            scraped[0] += 1

        pool.scrape_once = counted  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, "gateway"), serve_in_thread(app) as gateway:
            assert httpx.post(f"{gateway.url}/v1/chat/completions", json=chat("hi")).status_code == 200
            seen = scraped[0]
            wait_until(lambda: scraped[0] >= seen + 5, "several scrapes")
    said = [r for r in caplog.records if "no KV-event source" in r.getMessage()]
    assert len(said) == 1 and "kv_events" in said[0].getMessage()
