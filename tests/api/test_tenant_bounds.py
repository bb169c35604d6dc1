"""What one key's request may cost, bounded before the work is done (the hostile sweep's medium and low
findings): its tokens-per-minute reservation counts every choice it asks for and every input it sends; an agent
API request's items are counted before they are translated; a body nested too deep is a 400 on every route; the
parameter schemas of a forced tool call are a constraint like any other; a fallback serves only a model the key
may use."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

import gateway.api.agent_apis as agent_apis
from gateway.api.proxy_endpoint import reservation
from gateway.app import create_app
from gateway.sim import FleetThread, SimSpec
from tests.api.conftest import TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread

ASK: Any = [{"role": "user", "content": "Answer."}]


def key(name: str, **limits: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": hashlib.sha256(f"sk-{name}".encode()).hexdigest(), **limits}


@pytest.fixture(scope="module")
def running() -> Iterator[Running]:
    specs = [SimSpec(engine="vllm", model="m", name="v0", time_scale=TIME_SCALE),
             SimSpec(engine="vllm", model="m-slow", name="v1", time_scale=1.0),
             SimSpec(engine="vllm", model="small", name="vs", time_scale=TIME_SCALE,
                     overrides={"context_length": 512}),
             SimSpec(engine="vllm", model="big", name="vb", time_scale=TIME_SCALE)]
    keys = [key("open"), key("tokens", tokens_per_minute=5000), key("small-only", models=["small"]),
            key("small-and-big", models=["small", "big"])]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers, auth={"keys": keys},
                                          models={"small": {"fallbacks": ["big"]}}))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


def post(running: Running, name: str, body: Any, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60, headers={"authorization": f"Bearer sk-{name}"})


def test_the_token_reservation_counts_every_choice_and_every_input() -> None:
    """40 requests with n=128 used 41x a key's tokens/min in one burst; one embeddings request, 1.9M tokens:
    the reservation counted one choice and no input."""
    body = {"model": "m", "messages": ASK, "max_tokens": 100}
    assert reservation("chat", 400, body, 1024, 128) == 100 + 100
    assert reservation("chat", 400, {**body, "n": 128}, 1024, 128) == 100 + 128 * 100
    assert reservation("completions", 400, {**body, "best_of": 5, "n": 2}, 1024, 128) == 100 + 5 * 100
    assert reservation("chat", 400, {**body, "n": 10**9}, 1024, 128) == 100 + 128 * 100  # (refused later: 400)
    assert reservation("chat", 400, {"model": "m", "messages": ASK}, 1024, 128) == 100 + 1024
    assert reservation("responses", 400, {"model": "m", "input": "x", "max_output_tokens": 7}, 1024, 128) == 107
    assert reservation("chat", 400, {**body, "max_tokens": "lots"}, 1024, 128) == 100 + 1024
    assert reservation("embeddings", 8_000_000, {"model": "m", "input": ["x"] * 10}, 1024, 128) == 2_000_000
    assert reservation("rerank", 4000, {"model": "m", "max_tokens": 99}, 1024, 128) == 1000


def test_a_burst_of_many_choice_requests_is_held_to_the_key_s_budget(running: Running) -> None:
    """A stream asking for 8 choices of 1,000 tokens reserves 8,000 of the key's 5,000 tokens/min: while it
    runs, the key's next request waits for the budget to refill (429), where it used to pass."""
    begun, done = threading.Event(), threading.Event()
    body = {"model": "m-slow", "messages": ASK, "max_tokens": 1000, "n": 8, "ignore_eos": True, "stream": True}

    def hold() -> None:
        with httpx.stream("POST", running.url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": "Bearer sk-tokens"}) as held:
            assert held.status_code == 200, held.read()
            for _ in held.iter_raw():
                begun.set()
                if done.is_set():
                    break

    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(hold)
        assert begun.wait(30)
        try:
            reply = post(running, "tokens", {"model": "m", "messages": ASK, "max_tokens": 2})
        finally:
            done.set()
        holding.result()
    assert reply.status_code == 429 and reply.json()["error"]["code"] == "rate_limit_tokens", reply.text


def test_a_fallback_serves_only_a_model_the_key_may_use(running: Running) -> None:
    long = " ".join(["word"] * 900)  # past small's 512-token context: big would serve it
    body = {"model": "small", "messages": [{"role": "user", "content": long}], "max_tokens": 8}
    refused = post(running, "small-only", body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "x-gateway-fallback" not in refused.headers
    allowed = post(running, "small-and-big", body)
    assert allowed.status_code == 200 and allowed.headers["x-gateway-model"] == "big"


@pytest.mark.parametrize(("path", "field", "item"), [
    ("/v1/responses", "input", {"role": "user", "content": ""}),
    ("/v1/messages", "messages", {"role": "user", "content": ""}),
])
def test_an_agent_api_request_with_too_many_items_is_refused_before_translation(
        running: Running, path: str, field: str, item: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """280,000 tiny items in an 8 MiB body held the event loop half a second in translation (here 250,000: the
    item the sweep used was a few bytes shorter than this one, and the body stays under the 8 MiB limit)."""
    translated: list[str] = []
    for name in ("responses_to_chat", "messages_to_chat"):
        original = getattr(agent_apis, name)
        monkeypatch.setattr(agent_apis, name, lambda *a, _f=original, **k: translated.append("x") or _f(*a, **k))
    body = {"model": "m", "max_tokens": 4, "max_output_tokens": 4, field: [item] * 250_000}
    if path == "/v1/messages":
        del body["max_output_tokens"]
    else:
        del body["max_tokens"]
    reply = post(running, "open", body, path)
    assert reply.status_code == 400, reply.text[:300]
    assert "250000 entries" in reply.text and "4096" in reply.text
    assert not translated


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(("path", "extra"), [
    ("/v1/messages", {"max_tokens": 4, "messages": ASK, "metadata": {"user_id": "u", "deep": nested(300)}}),
    ("/v1/messages", {"max_tokens": 4, "messages": ASK,
                      "tools": [{"name": "f", "input_schema": {"type": "object", "properties": nested(300)}}]}),
    ("/v1/responses", {"max_output_tokens": 4, "input": "x", "metadata": {"deep": nested(300)}}),
    ("/v1/responses", {"max_output_tokens": 4, "input": "x",
                       "tools": [{"type": "function", "name": "f", "parameters": nested(300)}]}),
])
def test_a_body_nested_too_deep_is_a_400_on_the_agent_apis_too(running: Running, path: str,
                                                                extra: dict[str, Any]) -> None:
    reply = post(running, "open", {"model": "m", **extra}, path)
    assert reply.status_code == 400, reply.text[:300]


def test_the_parameter_schemas_of_a_forced_tool_call_are_bounded_like_any_constraint(running: Running) -> None:
    def tool(name: str, parameters: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                            for i in range(1500)}}  # ~190 KB, past max_constraint_bytes
    deep: Any = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    for tools, choice, code in [
        ([tool("f", big)], "required", "constraint_too_large"),
        ([tool("f", deep)], {"type": "function", "function": {"name": "f"}}, "constraint_too_deep"),
        ([tool("g", {"type": "object"}), {**tool("f", deep), "function": {**tool("f", deep)["function"],
                                                                            "strict": True}}],
         "auto", "constraint_too_deep"),
    ]:
        reply = post(running, "open", {"model": "m", "messages": ASK, "max_tokens": 4, "tools": tools,
                                       "tool_choice": choice})
        assert reply.status_code == 400, reply.text[:300]
        assert reply.json()["error"]["code"] == code and "tools[" in reply.json()["error"]["param"]
    # an unforced call of the same tool is the engine's to judge, as before
    fine = post(running, "open", {"model": "m", "messages": ASK, "max_tokens": 4, "tools": [tool("f", deep)]})
    assert fine.status_code == 200, fine.text[:300]


def test_an_embeddings_request_of_more_inputs_than_the_limit_is_a_400(running: Running) -> None:
    reply = post(running, "open", {"model": "m", "input": ["x"] * 3000}, "/v1/embeddings")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert "2048" in reply.json()["error"]["message"]
