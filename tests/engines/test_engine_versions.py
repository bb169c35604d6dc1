"""The engines as their releases behave, where releases differ in what the gateway relies on: each emulator runs as
the newest release and as an older one (``SimSpec.version``), behind one gateway.

* TabbyAPI since its rework of 2026-03-30 answers a non-streamed request without ``usage`` unless
  ``stream_options.include_usage`` asks for it: the gateway asks, and the request is counted.
* TabbyAPI's ``/health`` answers 503 for good once a generation raised (a context overflow): the backend keeps
  serving, and stays in rotation.
* vLLM's default block size is 64 from 0.34 (16 before): the prefix index counts a shared prefix in the pages
  the server shows in ``vllm:cache_config_info``.
* SGLang 0.5.20 and later: ``/ready`` is 503 while generation is paused (requests then wait), and ``/v1/models``
  200 all along; the backend leaves rotation while paused. SGLang 0.5.19 has no ``/ready``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.pool.state import Health
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread
from tests.waiting import wait_until

VERSIONS = {"tabbyapi": ("e632af4", "2026-03-29"), "sglang": ("0.5.23", "0.5.19"), "vllm": ("0.34.0", "0.33.0")}
ASK = [{"role": "user", "content": "Say something."}]
KEY = {"authorization": "Bearer k"}


@pytest.fixture(scope="module")
def fleet() -> Iterator[Running]:
    """Each version of each engine serving its own model ``<engine>-<version>``, behind one gateway."""
    specs = [SimSpec(engine=engine, model=f"{engine}-{version}", name=f"{engine}-{version}", version=version,  # type: ignore[arg-type]
                     time_scale=TIME_SCALE, api_key="k", overrides={"context_length": 512})
             for engine, versions in VERSIONS.items() for version in versions]
    with FleetThread(specs) as ft:
        app = create_app(gateway_settings(ft.fleet.servers))
        with serve_in_thread(app) as gateway:
            running = Running(ft, gateway, app)
            wait_until(lambda: all(b.health is Health.READY for b in app.gateway.pool.backends), "every backend ready")
            yield running


def completion_tokens(running: Running, model: str) -> float:
    text = httpx.get(running.url + "/metrics", timeout=5).text
    found = re.findall(r'^gateway_completion_tokens_total\{[^}]*model="' + re.escape(model) + r'"[^}]*\} (\S+)$',
                       text, re.M)
    return sum(map(float, found))


@pytest.mark.parametrize("version", VERSIONS["tabbyapi"])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_non_streamed_tabbyapi_answer_is_counted(fleet: Running, version: str, route: str) -> None:
    model = f"tabbyapi-{version}"
    before = completion_tokens(fleet, model)
    if route == "chat":
        r = httpx.post(fleet.url + "/v1/chat/completions", timeout=20,
                       json={"model": model, "messages": ASK, "max_tokens": 5, "ignore_eos": True})
    else:
        r = httpx.post(fleet.url + "/v1/completions", timeout=20,
                       json={"model": model, "prompt": "Once", "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5  # (the client gets usage, as OpenAI answers carry it)
    wait_until(lambda: completion_tokens(fleet, model) == before + 5, "the answer's tokens counted")
    sent = [x for x in fleet.server(model).received if x.method == "POST"][-1].body
    assert sent["stream_options"] == {"include_usage": True}


def test_a_tabbyapi_whose_health_says_unhealthy_for_good_stays_in_rotation(fleet: Running) -> None:
    model = "tabbyapi-e632af4"
    long = " ".join(["word"] * 2000)  # past its 512-token context: the generation raises (sent to the engine
    # itself: the gateway refuses such a prompt before it reaches a backend whose context it knows)
    r = httpx.post(fleet.server(model).url + "/v1/chat/completions", timeout=20, headers={"x-api-key": "k"},
                   json={"model": model, "messages": [{"role": "user", "content": long}], "max_tokens": 5})
    assert r.status_code == 400, r.text
    assert httpx.get(fleet.server(model).url + "/health", timeout=5).status_code == 503  # (and stays so)
    backend = fleet.app.gateway.pool.find(model)
    assert backend is not None
    probes = fleet.server(model).stats.requests
    wait_until(lambda: fleet.server(model).stats.requests > probes + 3,  # (probes went on after the error)
               "more probes of the unhealthy engine")
    assert backend.health is Health.READY
    r = httpx.post(fleet.url + "/v1/chat/completions", timeout=20,
                   json={"model": model, "messages": ASK, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_a_paused_sglang_leaves_rotation_and_comes_back(fleet: Running) -> None:
    model = "sglang-0.5.23"
    server = fleet.server(model)
    backend = fleet.app.gateway.pool.find(model)
    assert backend is not None
    try:
        assert httpx.post(server.url + "/pause_generation", json={}, headers=KEY, timeout=5).status_code == 200
        assert httpx.get(server.url + "/v1/models", headers=KEY, timeout=5).status_code == 200
        wait_until(lambda: backend.health is Health.LOADING, "the paused engine out of rotation")
        r = httpx.post(fleet.url + "/v1/chat/completions", timeout=20,
                       json={"model": model, "messages": ASK, "max_tokens": 3})
        assert r.status_code == 503, r.text  # (no backend for the model is ready; it would wait on the engine)
    finally:
        httpx.post(server.url + "/continue_generation", json={}, headers=KEY, timeout=5)
    wait_until(lambda: backend.health is Health.READY, "the engine back in rotation")
    r = httpx.post(fleet.url + "/v1/chat/completions", timeout=20,
                   json={"model": model, "messages": ASK, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_an_sglang_without_ready_is_probed_on_its_models_list(fleet: Running) -> None:
    old, new = fleet.server("sglang-0.5.19"), fleet.server("sglang-0.5.23")
    assert httpx.get(old.url + "/ready", timeout=5).status_code == 404
    probed = {s.spec.name: {x.path for x in s.received} for s in (old, new)}
    assert "/v1/models" in probed["sglang-0.5.19"] and "/ready" in probed["sglang-0.5.23"]
    assert "/health" not in probed["sglang-0.5.19"] | probed["sglang-0.5.23"]  # (it generates a token)


def test_vllms_block_size_is_read_from_what_it_shows(fleet: Running) -> None:
    pool = fleet.app.gateway.pool
    wait_until(lambda: all(pool.find(f"vllm-{v}").capacity.page_tokens is not None  # type: ignore[union-attr]
                           for v in VERSIONS["vllm"]), "both vLLM block sizes read")
    assert [pool.find(f"vllm-{v}").capacity.page_tokens for v in VERSIONS["vllm"]] == [64, 16]  # type: ignore[union-attr]
