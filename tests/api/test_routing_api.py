"""Routing as a client and an operator see it: decisions explained in headers and metrics, sessions stick,
shared prefixes find the emulated engine that cached them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread

SYSTEM = "You are the assistant of a team that runs many inference servers behind one gateway. " * 25


@pytest.fixture(scope="module")
def quad() -> Iterator[Running]:
    specs = [SimSpec(engine="vllm", model="shared", name=f"v{i}", time_scale=TIME_SCALE) for i in range(4)]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


def ask(running: Running, system: str, question: str, debug: str | None = "route", **kwargs: object
        ) -> httpx.Headers:
    c = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0,
                      default_headers={"x-gateway-debug": debug} if debug else None)
    raw = c.chat.completions.with_raw_response.create(
        model="shared", max_tokens=2, messages=[{"role": "system", "content": system},
                                                {"role": "user", "content": question}], **kwargs)
    raw.parse()
    return raw.headers


def test_decisions_are_explained_in_headers_when_asked_and_counted(quad: Running) -> None:
    quiet = ask(quad, "short", "hi", debug=None)
    assert "x-gateway-route-reason" not in quiet and "x-gateway-policy" not in quiet
    assert quiet["x-gateway-backend"]
    headers = ask(quad, "short", "hi")
    assert headers["x-gateway-policy"] == "default"
    reason = headers["x-gateway-route-reason"]
    assert reason.split(":")[0] in {"session", "precise-prefix", "engine-shape", "least-load", "tie"}
    metrics = httpx.get(quad.url + "/metrics").text
    assert f'gateway_routing_decisions_total{{backend="{headers["x-gateway-backend"]}"' in metrics
    assert 'gateway_routing_plugin_seconds_count{plugin="precise-prefix"}' in metrics


def test_shared_prefix_finds_the_engine_that_cached_it(quad: Running) -> None:
    first = ask(quad, SYSTEM, "question zero")["x-gateway-backend"]
    for i in range(1, 6):
        headers = ask(quad, SYSTEM, f"question {i}")
        assert headers["x-gateway-backend"] == first
        assert headers["x-gateway-route-reason"].startswith("precise-prefix")
    # the emulated vLLM really served the shared part from its prefix cache
    server = quad.server(first)
    assert server.stats.cached_tokens > 5 * 300


def test_session_header_and_user_field_stick(quad: Running) -> None:
    homes = {ask(quad, "x", f"turn {t}", extra_headers={"x-session-id": "abc"})["x-gateway-backend"]
             for t in range(6)}
    assert len(homes) == 1
    homes = {ask(quad, "y", f"turn {t}", user="alice")["x-gateway-backend"] for t in range(6)}
    assert len(homes) == 1
    # a long one sticks too, and is kept as a digest (QA pinned 88 MiB with twenty 4 MB "user" values)
    long_user = "bob-" + "x" * 100_000
    homes = {ask(quad, "z", f"turn {t}", user=long_user)["x-gateway-backend"] for t in range(4)}
    assert len(homes) == 1
    table = quad.app.gateway.pipeline.state.kept["session"]
    assert max(map(len, table._entries)) <= 128 and not any(long_user in key for key in table._entries)


def test_round_robin_policy_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GATEWAY_ROUTING__POLICY", "round-robin")
    specs = [SimSpec(engine="sglang", model="m", name=f"s{i}", time_scale=TIME_SCALE) for i in range(2)]
    with FleetThread(specs) as fleet, serve_in_thread(create_app(gateway_settings(fleet.fleet.servers))) as gw:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        served = [c.chat.completions.with_raw_response.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "hi"}]).headers["x-gateway-backend"]
            for _ in range(4)]
        assert served in (["s0", "s1", "s0", "s1"], ["s1", "s0", "s1", "s0"])
