"""What one key's request may cost, bounded before the work is done (the hostile sweep's medium and low
findings): its tokens-per-minute reservation counts every choice it asks for and every input it sends; an agent
API request's items are counted before they are translated; a body nested too deep is a 400 on every route; the
parameter schemas of a forced tool call are a constraint like any other; a fallback serves only a model the key
may use."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

import gateway.api.agent_apis as agent_apis
import gateway.api.proxy_endpoint as proxy_endpoint
import gateway.structured.constraint as constraint_module
from gateway.api.body_head import BodyHead, check_same
from gateway.api.proxy_endpoint import reservation
from gateway.api.validation import parse_body, validate_heavy
from gateway.app import create_app
from gateway.config import LimitSettings
from gateway.errors import GatewayError
from gateway.proxy.exchange import estimate_tokens
from gateway.sim import FleetThread, SimSpec
from gateway.structured.offload import ValidationWorkers
from tests.api.conftest import TIME_SCALE, Running, gateway_settings, streaming
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
                                          models={"small": {"fallbacks": ["big"]},
                                                  "alias-m": {"targets": [{"model": "m", "weight": 1}]}}))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


def post(running: Running, name: str, body: Any, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60, headers={"authorization": f"Bearer sk-{name}"})


def test_the_token_reservation_counts_every_choice_and_every_input() -> None:
    """40 requests with n=128 used 41x a key's tokens/min in one burst; one embeddings request, 1.9M tokens:
    the reservation counted one choice and no input. 512 prompts in one completions request: one prompt."""
    limits = LimitSettings()

    def reserved(route: str, size: int, body: dict[str, Any], history: int = 0) -> int:
        return reservation(route, estimate_tokens(b"x" * size), BodyHead.read(orjson.dumps(body)), 1024, limits,
                           history)

    body = {"model": "m", "messages": ASK, "max_tokens": 100}
    assert reserved("chat", 400, body) == 100 + 100
    assert reserved("chat", 400, {**body, "n": 128}) == 100 + 128 * 100
    assert reserved("completions", 400, {**body, "best_of": 5, "n": 2}) == 100 + 5 * 100
    assert reserved("chat", 400, {**body, "n": 10**9}) == 100 + 128 * 100  # (refused later: 400)
    assert reserved("chat", 400, {"model": "m", "messages": ASK}) == 100 + 1024
    assert reserved("responses", 400, {"model": "m", "input": "x", "max_output_tokens": 7}) == 107
    assert reserved("responses", 400, {"model": "m", "input": "x", "max_output_tokens": 7}, history=4000) == 1107
    assert reserved("chat", 400, {**body, "max_tokens": "lots"}) == 100 + 1024
    assert reserved("completions", 400, {"model": "m", "prompt": ["x"] * 512, "max_tokens": 10}) == 100 + 5120
    assert reserved("completions", 400, {"model": "m", "prompt": [[1, 2], [3]], "max_tokens": 10}) == 100 + 20
    assert reserved("completions", 400, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 10}) == 100 + 10
    assert reserved("embeddings", 8_000_000, {"model": "m", "input": ["x"] * 10}) == 2_000_000
    assert reserved("rerank", 4000, {"model": "m", "max_tokens": 99}) == 1000


def test_a_burst_of_many_choice_requests_is_held_to_the_key_s_budget(running: Running) -> None:
    """A stream asking for 8 choices of 1,000 tokens reserves 8,000 of the key's 5,000 tokens/min: while it
    runs, the key's next request waits for the budget to refill (429), where it used to pass."""
    body = {"model": "m-slow", "messages": ASK, "max_tokens": 1000, "n": 8, "ignore_eos": True, "stream": True}
    with streaming(running.url, "sk-tokens", body):
        reply = post(running, "tokens", {"model": "m", "messages": ASK, "max_tokens": 2})
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
    """280,000 tiny items in an 8 MiB body held the event loop half a second in translation: such a body is
    refused for its JSON objects (below); 5,000 items, each an object, are refused for their count, before
    any is translated."""
    translated: list[str] = []
    for name in ("responses_to_chat", "messages_to_chat"):
        original = getattr(agent_apis, name)
        monkeypatch.setattr(agent_apis, name, lambda *a, _f=original, **k: translated.append("x") or _f(*a, **k))
    body = {"model": "m", "max_tokens": 4, "max_output_tokens": 4, field: [item] * 5_000}
    if path == "/v1/messages":
        del body["max_output_tokens"]
    else:
        del body["max_tokens"]
    reply = post(running, "open", body, path)
    assert reply.status_code == 400, reply.text[:300]
    assert "5000 entries" in reply.text and "4096" in reply.text
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


def test_the_parameter_schemas_of_tools_are_bounded_like_any_constraint(running: Running) -> None:
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
    # an optional call too: an engine may compile every tool (llama.cpp builds a lazy grammar of them all)
    bomb = {"type": "object", "properties": {"a": {"type": "string", "pattern": "((a{999}){999}){999}"}}}
    for tools in ([tool("f", deep)], [tool("f", bomb)]):
        reply = post(running, "open", {"model": "m", "messages": ASK, "max_tokens": 4, "tools": tools})
        assert reply.status_code == 400 and "tools[0]" in reply.json()["error"]["param"], reply.text[:300]
    fine = post(running, "open", {"model": "m", "messages": ASK, "max_tokens": 4,
                                  "tools": [tool("f", {"type": "object", "properties": {"a": {"type": "string"}}})]})
    assert fine.status_code == 200, fine.text[:300]


def test_tools_too_costly_for_the_event_loop_are_checked_in_a_worker(running: Running,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep 27: 512 tools, each with one regex distinct per request (no memo holds it), were checked on the event
    loop, each schema with its own search budget: 2-4 s a request, another key's p50 from 5 ms to 3 s, and the
    request then refused, its tokens given back. Past a few milliseconds (or a schema past 4 KB) the rest goes to a
    validation worker, in the key's turn: its verdict is the same, a 400 naming the tool or the answer."""
    checked: list[str] = []
    original = constraint_module._checked_parameters
    monkeypatch.setattr(constraint_module, "_checked_parameters",
                        lambda text, param, bounds: checked.append(param) or original(text, param, bounds))

    def tools(count: int, pattern: str, bad: int | None = None) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "((a{999}){999}){999}" if i == bad else pattern.format(i)}}}}}
            for i in range(count)]

    body = {"model": "m", "messages": ASK, "max_tokens": 4}
    # the attack: its worker runs out of time (a 400 in ~2 s, in the key's own turn), the loop holds no one
    reply = post(running, "open", {**body, "tools": tools(512, "(?:(?:[a-z][a-z]){{10}}){{50}}s{}")})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "constraint_too_complex", reply.text[:300]
    assert 1 <= len(checked) <= 3, f"{len(checked)} of 512 tools checked on the event loop"
    checked.clear()
    reply = post(running, "open", {**body, "tools": tools(20, "(?:[a-z][a-z]){{60}}t{}")})  # (~2 ms each)
    assert reply.status_code == 200, reply.text[:300]
    assert len(checked) < 20, "some, not all, checked on the event loop"
    reply = post(running, "open", {**body, "tools": tools(20, "(?:[a-z][a-z]){{60}}u{}", bad=15)})
    assert reply.status_code == 400 and "tools[15].function.parameters" in reply.json()["error"]["message"]
    large = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                              for i in range(60)}}  # (~7 KB: one schema past 4 KB)
    checked.clear()
    one = post(running, "open", {**body, "tools": [{"type": "function", "function": {"name": "f",
                                                                                     "parameters": large}}]})
    assert one.status_code == 200 and checked == [], one.text[:300]


@pytest.mark.system  # (it starts a validation worker)
def test_the_verdict_of_tools_checked_in_a_worker_routes_as_one_checked_inline() -> None:
    """What the worker finds in the tools (llama.cpp's parse of their patterns going too many ways at once) keeps
    the request from llama.cpp as it does when found on the event loop."""
    fans = "^(" + "|".join("a" * k for k in range(1, 21)) + ")+$"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": fans if i == 7 else f"[a-z]+{i}", "description": "d" * 4200}}}}}
        for i in range(10)]  # (each schema past 4 KB: all go to the worker)
    request = parse_body("chat", {"model": "m", "messages": ASK, "tools": tools}, LimitSettings())
    assert request.tools_pending and request.fanout is None

    async def run() -> None:
        workers = ValidationWorkers(LimitSettings(validation_timeout=30.0), workers=1)
        try:
            await validate_heavy(request, workers, "k")
        finally:
            await workers.close()

    asyncio.run(run())
    assert not request.tools_pending and "tools[7].function.parameters" in (request.fanout or "")


def test_an_embeddings_request_of_more_inputs_than_the_limit_is_a_400(running: Running) -> None:
    reply = post(running, "open", {"model": "m", "input": ["x"] * 3000}, "/v1/embeddings")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input"
    assert "2048" in reply.json()["error"]["message"]


def test_a_body_of_a_million_empty_arrays_is_never_decoded(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 MiB of ``[[],[],...]`` is 2.8 million Python lists, 0.3 to 1.5 s of the event loop to decode: the key's
    checks read the body's head without decoding the rest, and a body of more ``[`` and ``{`` than
    limits.max_json_containers is refused before it is decoded."""
    decoded: list[int] = []
    original = proxy_endpoint.decode_body
    monkeypatch.setattr(proxy_endpoint, "decode_body", lambda raw: decoded.append(len(raw)) or original(raw))
    arrays = b",".join([b"[]"] * 2_700_000)
    for name, model, status in (("small-only", "m", 403), ("open", "m", 400)):
        body = b'{"model":"' + model.encode() + b'","messages":[{"role":"user","content":"x"}],"x":[' + arrays + b"]}"
        reply = httpx.post(running.url + "/v1/chat/completions", content=body, timeout=60,
                           headers={"authorization": f"Bearer sk-{name}", "content-type": "application/json"})
        assert reply.status_code == status, reply.text[:300]
    assert "max_json_containers" in reply.json()["error"]["message"]
    assert decoded == []
    # brackets in strings count too (telling them apart cost 0.4 s for 8 MiB of short strings): a prompt holding
    # 100,000 of them in its text would fit no model's context anyway
    code = "[{" * 25_000
    fine = post(running, "open", {"model": "m", "messages": [{"role": "user", "content": code}], "max_tokens": 2})
    assert "max_json_containers" not in fine.text, fine.text[:300]
    assert decoded


def test_a_body_of_one_object_with_600000_keys_is_never_decoded(running: Running,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweep 13: one object of 700,000 distinct keys (8 MiB) is one container, under max_json_containers, and
    took 0.23-0.31 s of the event loop to decode: other keys' Redis admissions timed out meanwhile. Its keys are
    counted (limits.max_json_values) and it is refused undecoded, written '"k":1' or (sweep 14) '"k" :1'; an
    embeddings request of 2,048 inputs of 512 token ids each (~1M values) is not."""
    decoded: list[int] = []
    original = proxy_endpoint.decode_body
    monkeypatch.setattr(proxy_endpoint, "decode_body", lambda raw: decoded.append(len(raw)) or original(raw))
    for spaced in (b"", b" "):  # (sweep 14: '"k" :1' passed a count of '":')
        keys = b",".join(b'"k%d"%s:1' % (i, spaced) for i in range(600_000))
        body = b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":{' + keys + b"}}"
        reply = httpx.post(running.url + "/v1/chat/completions", content=body, timeout=60,
                           headers={"authorization": "Bearer sk-open", "content-type": "application/json"})
        assert reply.status_code == 400 and "max_json_values" in reply.json()["error"]["message"], reply.text[:300]
    assert decoded == []
    tokens = post(running, "open", {"model": "m", "input": [list(range(512))] * 2048}, "/v1/embeddings")
    assert "max_json_values" not in tokens.text, tokens.text[:300]
    assert decoded


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": ASK, "tools": True}, "tools"),
    ("/v1/completions", {"prompt": "x", "tools": 1}, "tools"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function"}] * 600}, "tools"),
    ("/v1/completions", {"prompt": ["x"] * 3000, "max_tokens": 2}, "prompt"),
    ("/v1/responses", {"input": "x", "include": [[]]}, "include"),
    ("/v1/responses", {"input": "x", "include": [{}]}, "include"),
    ("/v1/responses", {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]}, None),
])
def test_small_malformed_bodies_are_a_400_never_a_500(running: Running, path: str, body: dict[str, Any],
                                                     param: str | None) -> None:
    """What a fuzzer found answering 500 (a TypeError inside the gateway), each a few bytes."""
    reply = post(running, "open", {"model": "m", **body}, path)
    assert reply.status_code == 400, reply.text[:300]
    if param is not None:
        assert reply.json()["error"]["param"] == param


def test_count_tokens_through_an_alias_asks_the_engine_for_the_model_it_serves(running: Running) -> None:
    body = {"model": "alias-m", "messages": [{"role": "user", "content": "hello there"}]}
    reply = post(running, "open", body, "/v1/messages/count_tokens")
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["input_tokens"] > 0


def test_the_checks_and_the_request_read_one_model_whatever_the_duplicate_keys(running: Running) -> None:
    """Both decoders keep the last of duplicate keys: a key may not slip a model past its allow-list by naming
    an allowed one first (or last)."""
    def send(raw: bytes) -> httpx.Response:
        return httpx.post(running.url + "/v1/chat/completions", content=raw, timeout=30,
                          headers={"authorization": "Bearer sk-small-only", "content-type": "application/json"})

    rest = b'"messages":[{"role":"user","content":"x"}],"max_tokens":2'
    assert send(b'{"model":"small",' + rest + b',"model":"big"}').status_code == 403
    assert send(b'{"model":"big",' + rest + b',"model":"small"}').status_code == 200
    head = BodyHead.read(b'{"model":"small","max_tokens":2}')
    with pytest.raises(GatewayError) as refused:
        check_same(head, {"model": "big", "max_tokens": 2})
    assert refused.value.status == 400
    with pytest.raises(GatewayError):
        check_same(head, {"model": "small", "max_tokens": 2, "n": 64})  # (more than was reserved)
    check_same(head, {"model": "small", "max_tokens": 2})


def test_a_conversation_grown_past_the_body_limit_is_not_continued() -> None:
    """Each turn kept adds to the conversation a continuation sends the engine whole: reasoning items, which the
    engine counts as almost no tokens, grew one to 35 MB, 4x the body limit, charged 101 tokens."""
    spec = SimSpec(engine="llamacpp", model="m", name="l", time_scale=TIME_SCALE, overrides={"context_length": 65536})
    with FleetThread([spec]) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers, server={"max_body_bytes": 64 * 1024}))
        with serve_in_thread(app) as gateway:
            def turn(text: str, previous: str | None = None) -> httpx.Response:
                body: dict[str, Any] = {"model": "m", "input": text, "max_output_tokens": 4}
                if previous is not None:
                    body["previous_response_id"] = previous
                return httpx.post(gateway.url + "/v1/responses", json=body, timeout=60)

            first = turn("word " * 8000)  # 40 KB
            assert first.status_code == 200, first.text[:300]
            second = turn("word " * 6000, first.json()["id"])  # 30 KB more: past 64 KiB with what is kept
            assert second.status_code == 400, second.text[:300]
            assert second.json()["error"]["code"] == "conversation_too_large"
            assert turn("short", first.json()["id"]).status_code == 200


def test_a_conversation_costing_more_than_max_json_values_to_decode_is_not_continued() -> None:
    """Sweep 15: a continuation's stored conversation is decoded and translated with its input in one turn of the
    event loop, bounded only in bytes: three chained inputs of 90,000 parts held the loop 0.2-0.3 s each. It is
    now counted as a body is (limits.max_json_values) before it is decoded."""
    spec = SimSpec(engine="llamacpp", model="m", name="l", time_scale=TIME_SCALE, overrides={"context_length": 65536})
    parts = [{"type": "input_text", "text": "a"}] * 2_500  # (~90 KB, ~60,000 units: each body passes on its own)
    with FleetThread([spec]) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers, limits={"max_json_values": 100_000}))
        with serve_in_thread(app) as gateway:
            def turn(previous: str | None = None) -> httpx.Response:
                body: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": parts}],
                                        "max_output_tokens": 4}
                if previous is not None:
                    body["previous_response_id"] = previous
                return httpx.post(gateway.url + "/v1/responses", json=body, timeout=60)

            first = turn()
            assert first.status_code == 200, first.text[:300]
            second = turn(first.json()["id"])  # (its history: one input's worth)
            assert second.status_code == 200, second.text[:300]
            third = turn(second.json()["id"])  # (two inputs' worth: past the bound)
            assert third.status_code == 400, third.text[:300]
            error = third.json()["error"]
            assert error["code"] == "conversation_too_large" and "max_json_values" in error["message"]


def test_what_a_request_may_generate_is_the_most_any_of_its_fields_says(running: Running) -> None:
    """TabbyAPI generates max_tokens and llama.cpp n_predict (before max_tokens) where the gateway read
    max_completion_tokens: {"max_completion_tokens": 1, "max_tokens": 1500} reserved one token and generated 1,500."""
    limits = LimitSettings()
    head = BodyHead.read(orjson.dumps({"model": "m", "max_completion_tokens": 1, "max_tokens": 1500, "n_predict": 9}))
    assert reservation("chat", 100, head, 1024, limits) == 100 + 1500
    for extra, param in (({"max_completion_tokens": 1, "max_tokens": 10**9}, "max_tokens"),
                         ({"n_predict": -1}, "n_predict"), ({"max_tokens": 1, "n_predict": 10**9}, "n_predict")):
        reply = post(running, "open", {"model": "m", "messages": ASK, **extra})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text[:300]


def test_a_large_body_nested_past_what_its_head_reader_takes_is_a_400() -> None:
    deep = b'{"model":"m","pad":"' + b"x" * 20_000 + b'","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(GatewayError) as refused:
        BodyHead.read(deep)
    assert refused.value.status == 400


@pytest.mark.parametrize("padding", [0, 2000])  # (small: checked on the event loop; large: in a worker)
def test_a_schema_whose_type_is_not_a_name_is_a_400(running: Running, padding: int) -> None:
    schema = {"type": "object", "description": "d" * padding,
              "properties": {"a": {"type": [[]], "enum": [1]}, "b": {"type": ["string", {}]}}}
    reply = post(running, "open", {"model": "m", "messages": ASK, "max_tokens": 4,
                                   "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": schema}}})
    assert reply.status_code == 400, reply.text[:300]
    assert reply.json()["error"]["param"].startswith("response_format")


@pytest.mark.parametrize(("path", "field", "value", "said"), [
    ("/v1/chat/completions", "stop", [f"s{i}" for i in range(33)], "'stop' has 33 entries"),
    ("/v1/completions", "stop", [f"s{i}" for i in range(90_000)], "'stop' has 90000 entries"),
    ("/v1/chat/completions", "stop", ["x" * 3000, "y" * 3000], "more than 4096 characters"),
    ("/v1/messages", "stop_sequences", [f"s{i}" for i in range(33)], "'stop' has 33 entries"),
    ("/v1/chat/completions", "bad_words", [f"w{i}" for i in range(40)], "'bad_words' has 40 entries"),
    ("/v1/chat/completions", "logit_bias", {str(i): 1 for i in range(3000)}, "'logit_bias' has 3000 entries"),
    ("/v1/chat/completions", "stop_token_ids", list(range(5000)), "'stop_token_ids' has 5000 entries"),
    ("/v1/chat/completions", "stop", 7, "must be a string or an array of strings"),
    ("/v1/completions", "dry_sequence_breakers", [f"b{i}" for i in range(8000)], "'dry_sequence_breakers' has 8000"),
    ("/v1/chat/completions", "samplers", "e" * 2000, "at most 16 samplers"),
    ("/v1/completions", "samplers", ["penalties"] * 2000, "at most 16 samplers"),
    ("/v1/chat/completions", "repeat_last_n", 50_000_000, "'repeat_last_n' must be an integer from -1 to 131072"),
    ("/v1/completions", "dry_penalty_last_n", 2**31 - 1, "'dry_penalty_last_n' must be an integer from -1"),
    ("/v1/chat/completions", "top_logprobs", 5000, "'top_logprobs' must be an integer from 0 to 20"),
    ("/v1/completions", "n_probs", 5000, "'n_probs' must be an integer from 0 to 20"),
    ("/v1/chat/completions", "banned_strings", [f"b{i}" for i in range(100)], "'banned_strings' has 100 entries"),
    ("/v1/chat/completions", "custom_token_bans", ",".join(map(str, range(5000))), "'custom_token_bans' has 5000"),
    ("/v1/chat/completions", "allowed_tokens", list(range(5000)), "'allowed_tokens' has 5000 entries"),
    ("/v1/chat/completions", "logit_bias", {"9" * 4000: 1}, "a key of more than 64 characters"),
    ("/v1/completions", "logit_bias", [["0123456789" * 1000, 0.5]], "a key of more than 64 characters"),
    ("/v1/completions", "logprobs", 1638, "'logprobs' must be an integer from 0 to 20"),
    ("/v1/chat/completions", "samplers", "yy", "each once"),
    ("/v1/chat/completions", "samplers", ["typ_p", "TYP-P", "typ"], "each once"),  # (one sampler, three names)
    # sweep 22: a float is a number llama.cpp reads as n_probs; infill is quadratic in the candidates; a DRY
    # breaker costs a pass over the vocabulary (TabbyAPI reads a string as a JSON array's inside); TabbyAPI's
    # other spellings of its ranges
    ("/v1/completions", "logprobs", 1638.0, "'logprobs' must be an integer from 0 to 20"),
    ("/v1/chat/completions", "samplers", ["top_k", "infill"], "may not name infill"),
    ("/v1/chat/completions", "dry_sequence_breakers", [str(i) for i in range(5)], "'dry_sequence_breakers' has 5"),
    ("/v1/chat/completions", "dry_sequence_breakers", ",".join(f'"{i}"' for i in range(20)),
     "'dry_sequence_breakers' has 20 entries"),
    ("/v1/chat/completions", "repetition_range", 10**9, "'repetition_range' must be an integer from -1 to 131072"),
    ("/v1/chat/completions", "repetition_penalty_range", 10**9, "'repetition_penalty_range' must be an integer"),
    ("/v1/chat/completions", "dry_range", 10**9, "'dry_range' must be an integer from -1 to 131072"),
    ("/v1/chat/completions", "stop_sequence", [f"s{i}" for i in range(100)], "'stop_sequence' has 100 entries"),
    ("/v1/chat/completions", "rep_pen_range", 10**9, "'rep_pen_range' must be an integer from -1 to 131072"),
    ("/v1/chat/completions", "min_tokens", 10**6, "'min_tokens' must be an integer from 0 to 131072"),
    ("/v1/chat/completions", "max_length", 10**6, "'max_length' is 1000000; this gateway accepts at most"),
])
def test_what_an_engine_reads_at_every_token_is_bounded(running: Running, path: str, field: str, value: Any,
                                                        said: str) -> None:
    """Sweep 19: ~900,000 stop strings passed the gateway, and an engine matches each at every token it generates,
    for every request beside it: another key's stream fell from 3,855 to 318 tokens a second on a llama-server
    (vLLM and SGLang match them in a Python loop). Stop sequences are bounded in number and characters, and the
    token lists and maps an engine reads each step in entries: a 400 naming the field, as OpenAI caps stop at 4."""
    ask = {"messages": ASK} if path != "/v1/completions" else {"prompt": "hi"}
    reply = post(running, "open", {"model": "m", "max_tokens": 4, **ask, field: value}, path)
    assert reply.status_code == 400, reply.text[:300]
    assert said in reply.text, reply.text[:300]
    fine = value[:1] if isinstance(value, list | str) else {"1": 1} if isinstance(value, dict) else 1
    if field == "stop" and not isinstance(value, list | str):
        fine = "stop"
    if field == "logit_bias":  # (in OpenAI's spelling: the emulated vLLM takes no other, as vLLM)
        fine = {"1": 1}
    extra = {"logprobs": True} if field == "top_logprobs" else {}  # (with logprobs only, as OpenAI)
    within = post(running, "open", {"model": "m", "max_tokens": 4, **ask, field: fine, **extra}, path)
    assert within.status_code == 200, within.text[:300]
