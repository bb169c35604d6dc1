"""The agent APIs through the gateway with the unmodified official SDKs (``anthropic`` messages, ``openai``
responses), on each emulated engine, translated to chat completions; the same measurements as chat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.translate.messages import messages_to_chat
from gateway.api.translate.responses import responses_to_chat
from gateway.app import create_app
from gateway.routing.prompt import BLOCK_BYTES
from gateway.routing.request import RouteRequest
from gateway.sim import FleetThread, SimSpec
from gateway.sim.template import render_chat
from tests.api.conftest import ENGINES, TIME_SCALE, Running, gateway_settings
from tests.conftest import serve_in_thread

WEATHER_ANTHROPIC = {"name": "get_weather", "description": "The weather in a city",
                     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                      "required": ["city"]}}
WEATHER_OPENAI = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                  "parameters": WEATHER_ANTHROPIC["input_schema"]}


def claude(running: Running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.url, api_key="client-key", max_retries=0)


def oai(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="client-key", max_retries=0)


GENERATION = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens",
              "/v1/token/encode")


def last_generation(running: Running, engine: str) -> Any:
    """The last generation request the engine received (health checks and scrapes come in between). The
    engine's thread appends to its deque meanwhile: list() copies it in one C call, a comprehension would not."""
    return [r for r in list(running.server(f"sim-{engine}").received) if r.path in GENERATION][-1]


def samples(running: Running, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(running.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# --- Anthropic Messages ------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_messages_create_and_stream_on_every_engine(engines: Running, engine: str) -> None:
    c = claude(engines)
    model = f"m-{engine}"
    before = samples(engines, "gateway_time_to_first_token_seconds_count", model=model)
    requests = samples(engines, "gateway_requests_total", route="messages", model=model)
    message = c.messages.create(model=f"m-{engine}", max_tokens=32, system="You are terse.",
                                messages=[{"role": "user", "content": "Say something."}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content and message.content[-1].type == "text" and message.content[-1].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with c.messages.stream(model=f"m-{engine}", max_tokens=32,
                           messages=[{"role": "user", "content": "Say something else."}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[-1].type == "text" and final.content[-1].text == text
    assert final.usage.output_tokens > 0
    # vLLM and SGLang write message_start without type and role: the SDK's final message had role None, and
    # sending the conversation back with it was refused
    assert (final.type, final.role) == ("message", "assistant")
    again = c.messages.create(model=f"m-{engine}", max_tokens=4, messages=[
        {"role": "user", "content": "Say something else."}, {"role": final.role, "content": final.content},
        {"role": "user", "content": "Go on."}])
    assert again.content
    # the stream's first generated token was timed like a chat stream's; requests counted under their route
    assert samples(engines, "gateway_time_to_first_token_seconds_count", model=model) == before + 1
    assert samples(engines, "gateway_requests_total", route="messages", model=model) == requests + 3


FORCING = [e for e in ENGINES if e != "tabbyapi"]  # TabbyAPI does not force a tool call: the gateway refuses


@pytest.mark.system
def test_a_forced_tool_call_on_an_engine_that_cannot_force_one_is_refused_in_each_apis_shape(
        engines: Running) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(engines).messages.create(model="m-tabbyapi", max_tokens=64, tools=[WEATHER_ANTHROPIC],
                                        tool_choice={"type": "tool", "name": "get_weather"},
                                        messages=[{"role": "user", "content": "Weather?"}])
    assert refused.value.body["type"] == "error" and "tool_choice" in refused.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as also:
        oai(engines).responses.create(model="m-tabbyapi", input="Weather?", tools=[WEATHER_OPENAI],
                                      tool_choice="required")
    assert also.value.code is not None and "tool_choice" in also.value.message


@pytest.mark.parametrize("engine", FORCING)
def test_a_messages_tool_use_round_trip(engines: Running, engine: str) -> None:
    c = claude(engines)
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = c.messages.create(model=f"m-{engine}", max_tokens=64, tools=[WEATHER_ANTHROPIC],
                              tool_choice={"type": "tool", "name": "get_weather"}, messages=asked)
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    answer = c.messages.create(model=f"m-{engine}", max_tokens=32, tools=[WEATHER_ANTHROPIC], messages=[
        *asked, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}])
    assert answer.content and answer.content[-1].type in ("text", "tool_use")
    # the forced call took the chat path (the gateway enforces the constraint): the engine was asked for it
    forced = [r for r in list(engines.server(f"sim-{engine}").received) if r.path == "/v1/chat/completions"][-1].body
    assert forced["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    # the answer, unconstrained, went as the client sent it to an engine that serves /v1/messages
    sent = last_generation(engines, engine)
    assert sent.path == "/v1/messages"
    assert sent.body["messages"][-1]["content"] == [
        {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]


@pytest.mark.parametrize("engine", ENGINES)
def test_count_tokens_is_the_engines_own_count(engines: Running, engine: str) -> None:
    c = claude(engines)
    asked: list[Any] = [{"role": "user", "content": "How many tokens is this?"}]
    counted = c.messages.count_tokens(model=f"m-{engine}", messages=asked, system="Be brief.")
    # the engine counted: on its own count_tokens route, or TabbyAPI on its tokenizing route
    assert last_generation(engines, engine).path == COUNTED_ON[engine]
    message = c.messages.create(model=f"m-{engine}", max_tokens=4, messages=asked, system="Be brief.")
    assert counted.input_tokens > 0
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_count_tokens_goes_where_the_engines_own_count_takes_the_request() -> None:
    """SGLang's Messages API refuses a system message inside messages (Claude Code sends one): its count_tokens
    does too. Such a count goes to an engine whose own count takes it; what changes no count (thinking.display)
    is not sent, nor a deferred tool no tool search loaded (the model does not see it)."""
    specs = [SimSpec(engine=e, model="shared", name=f"sim-{e}", time_scale=TIME_SCALE) for e in ("sglang", "vllm")]
    with FleetThread(specs) as fleet, serve_in_thread(create_app(gateway_settings(fleet.fleet.servers))) as gw:
        c = claude(gw)
        inline = [{"role": "user", "content": "Count me."}, {"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Now."}]
        tools = [{"name": "now", "input_schema": {"type": "object"}},
                 {"name": "later", "input_schema": {"type": "object"}, "defer_loading": True}]
        for _ in range(4):
            raw = c.messages.with_raw_response.count_tokens(
                model="shared", messages=inline, tools=tools,  # type: ignore[arg-type]
                extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}})
            assert raw.headers["x-gateway-backend"] == "sim-vllm" and raw.parse().input_tokens > 0
        sent = [r for r in list(fleet.fleet["sim-vllm"].received) if r.path in GENERATION][-1]
        assert [t["name"] for t in sent.body["tools"]] == ["now"] and "display" not in sent.body["thinking"]
        assert c.messages.count_tokens(model="shared", messages=inline[:1]).input_tokens > 0


def test_tools_are_counted_before_any_is_translated_those_left_out_included(engines: Running) -> None:
    """Sweep 9: 40,000 web_search tools (left out, so never counted against limits.max_tools) held the event loop
    8 s in translation; and a tool type with a line break went into a response header."""
    many = [{"type": "web_search"}] * 513
    r = httpx.post(engines.url + "/v1/responses", json={"model": "m-vllm", "input": "hi", "tools": many})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    reply = oai(engines).responses.with_raw_response.create(model="m-vllm", input="hi", max_output_tokens=4,
                                                            tools=[{"type": "web_search"}] * 3)  # type: ignore[list-item]
    assert reply.headers["x-gateway-tools-omitted"] == "web_search"


COUNTED_ON = {"llamacpp": "/v1/messages/count_tokens", "vllm": "/v1/messages/count_tokens",
              "sglang": "/v1/messages/count_tokens", "tabbyapi": "/v1/token/encode"}


def test_count_tokens_on_tabbyapi_is_its_tokenizer_on_the_rendered_conversation_tools_included(
        engines: Running) -> None:
    """TabbyAPI's /v1/token/encode renders chat messages through the model's template but never its tools:
    the gateway sends the Messages request's chat translation with the tool definitions (as JSON, a line
    each) appended to the system message, so the count is the engine's tokenizer on that rendering."""
    c = claude(engines)
    sim = engines.server("sim-tabbyapi")
    conversation: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                     {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]}]
    counted = c.messages.count_tokens(model="m-tabbyapi", system="Be brief.", messages=conversation,
                                      tools=[WEATHER_ANTHROPIC])
    chat = messages_to_chat({"model": "m-tabbyapi", "max_tokens": 1, "system": "Be brief.",
                             "messages": conversation, "tools": [WEATHER_ANTHROPIC]})
    listed = json.dumps(chat["tools"][0], separators=(",", ":"))
    rendered = render_chat([{**chat["messages"][0], "content": "Be brief.\n" + listed}, *chat["messages"][1:]])
    assert counted.input_tokens == len(sim.tokenizer.encode(rendered))
    sent = last_generation(engines, "tabbyapi")
    assert sent.path == "/v1/token/encode" and sent.body["add_bos_token"] is True
    assert all(isinstance(m["content"], str | None) for m in sent.body["text"])  # (as its chat path joins parts)
    # the tools are counted: more than the same conversation without them, by their JSON's tokens
    bare = c.messages.count_tokens(model="m-tabbyapi", system="Be brief.", messages=conversation)
    assert counted.input_tokens - bare.input_tokens >= len(sim.tokenizer.encode(listed, add_bos=False))
    # ... and what generation reads differs only by the template's own words around the tool list (the
    # emulator's "Tools:" line), which TabbyAPI renders on no tokenizing route
    prompt = render_chat(chat["messages"], chat["tools"])
    assert len(sim.tokenizer.encode(prompt)) - counted.input_tokens == len(sim.tokenizer.encode("Tools:\n",
                                                                                                add_bos=False))


def test_count_tokens_with_an_image_is_not_guessed_on_tabbyapi(engines: Running) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(engines).messages.count_tokens(model="m-tabbyapi", messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    assert refused.value.body["type"] == "error" and "count_tokens" in refused.value.body["error"]["message"]


NATIVE = {"llamacpp": "native", "vllm": "native", "sglang": "native", "tabbyapi": "translated"}
# llama.cpp's own /v1/responses stream lacks the events' sequence and output indices the OpenAI SDK needs
NATIVE_RESPONSES = {**NATIVE, "llamacpp": "translated"}


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_that_serves_an_agent_api_gets_the_request_as_sent_the_others_chat(engines: Running,
                                                                                    engine: str) -> None:
    ask = {"model": f"m-{engine}", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}
    reply = httpx.post(engines.url + "/v1/messages", json=ask, headers={"x-api-key": "k"})
    assert reply.status_code == 200 and reply.headers["x-gateway-agent-api"] == NATIVE[engine]
    assert reply.json()["type"] == "message"
    if NATIVE[engine] == "native":
        assert last_generation(engines, engine).path == "/v1/messages"
        assert last_generation(engines, engine).body == ask
    else:
        assert last_generation(engines, engine).path == "/v1/chat/completions"
    reply = httpx.post(engines.url + "/v1/responses", json={"model": f"m-{engine}", "input": "Hi",
                                                            "max_output_tokens": 16})
    assert reply.status_code == 200 and reply.headers["x-gateway-agent-api"] == NATIVE_RESPONSES[engine]
    assert reply.json()["object"] == "response"
    if NATIVE_RESPONSES[engine] == "native":  # the engine is told not to keep a copy: the gateway keeps it
        sent = last_generation(engines, engine)
        assert sent.path == "/v1/responses" and sent.body["store"] is False


def test_messages_errors_come_in_anthropics_shape(engines: Running) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(engines).messages.create(model="m-vllm", max_tokens=0,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude(engines).messages.create(model="no-such-model", max_tokens=8,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    raw = httpx.post(engines.url + "/v1/messages", content=b"{not json", headers={"x-api-key": "k"})
    assert raw.status_code == 400 and raw.json()["type"] == "error"


# --- OpenAI Responses --------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ENGINES)
def test_responses_create_stream_and_continue_on_every_engine(engines: Running, engine: str) -> None:
    c = oai(engines)
    first = c.responses.create(model=f"m-{engine}", instructions="You are terse.", input="Say something.",
                               max_output_tokens=32)
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage is not None and first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    events = list(c.responses.create(model=f"m-{engine}", input="Say more.", max_output_tokens=32, stream=True,
                                     previous_response_id=first.id))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == events[-1].response.output_text
    # the engine was sent the whole conversation: the first turn (from the gateway's store; its instructions
    # are not carried over, as OpenAI does not), then this one
    sent = [r for r in list(engines.server(f"sim-{engine}").received) if r.path == "/v1/chat/completions"][-1].body
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["messages"][1]["content"] == first.output_text


@pytest.mark.parametrize("engine", ENGINES)
def test_the_sdks_responses_stream_helper_works_on_every_engine(engines: Running, engine: str) -> None:
    """The helper indexes output items by each event's output_index and checks sequence numbers: llama.cpp's
    own stream has neither (it failed with "list indices must be integers or slices, not NoneType")."""
    with oai(engines).responses.stream(model=f"m-{engine}", input="Hi", max_output_tokens=8) as stream:
        events = list(stream)  # (the helper builds the response event by event as they are read)
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers)), "sequence numbers increase"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response  # (get_final_response insists on "completed"; 8 tokens may cut the answer)
    assert final.output_text and final.output_text == "".join(
        e.delta for e in events if e.type == "response.output_text.delta")


@pytest.mark.parametrize("engine", FORCING)
def test_a_responses_function_call_round_trip(engines: Running, engine: str) -> None:
    c = oai(engines)
    first = c.responses.create(model=f"m-{engine}", input="What is the weather in Oslo?", tools=[WEATHER_OPENAI],
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64)
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = c.responses.create(model=f"m-{engine}", previous_response_id=first.id, tools=[WEATHER_OPENAI],
                                input=[{"type": "function_call_output", "call_id": call.call_id,
                                        "output": "Sunny, 21 C"}], max_output_tokens=32)
    assert answer.output
    sent = [r for r in list(engines.server(f"sim-{engine}").received) if r.path == "/v1/chat/completions"][-1].body
    assert sent["messages"][-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}


CODEX_METADATA = {"client_metadata": {"session_id": "0199a", "turn_id": "1"}}
SPAWN = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
         "tools": [{**WEATHER_OPENAI, "name": "spawn_agent", "strict": False}]}


@pytest.mark.parametrize("engine", ENGINES)
def test_codex_bookkeeping_is_accepted_on_every_engine_and_not_passed_on(engines: Running, engine: str) -> None:
    """Codex sends ``client_metadata`` with every streamed request: each was a 400 (issue 42)."""
    events = list(oai(engines).responses.create(model=f"m-{engine}", input="Hi", max_output_tokens=8, stream=True,
                                                store=False, extra_body=CODEX_METADATA))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "client_metadata" not in last_generation(engines, engine).body


@pytest.mark.parametrize("engine", FORCING)
def test_a_codex_namespace_tool_is_called_and_comes_back_in_its_namespace(engines: Running, engine: str) -> None:
    """Codex's default tools include the ``multi_agent_v1`` namespace: it was refused as a built-in tool."""
    with oai(engines).responses.stream(model=f"m-{engine}", input="Spawn one.", tools=[SPAWN, WEATHER_OPENAI],
                                       tool_choice="required", max_output_tokens=64,
                                       extra_body=CODEX_METADATA) as stream:
        events = list(stream)
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(c.name, c.namespace) for c in done][:1] == [("spawn_agent", "multi_agent_v1")]
    sent = last_generation(engines, engine)
    assert sent.path == "/v1/chat/completions"
    assert [t["function"]["name"] for t in sent.body["tools"]] == ["multi_agent_v1__spawn_agent", "get_weather"]


@pytest.mark.parametrize("engine", ENGINES)
def test_responses_text_format_json_schema_is_enforced_on_every_engine(engines: Running, engine: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    reply = oai(engines).responses.create(model=f"m-{engine}", input="A trip.", max_output_tokens=200,
                                          text={"format": {"type": "json_schema", "name": "trip", "schema": schema,
                                                           "strict": True}})
    doc = json.loads(reply.output_text)
    assert set(doc) == {"city", "days"} and isinstance(doc["days"], int)


STRICT_WEATHER = {**WEATHER_OPENAI, "strict": True}  # (what the Agents SDK's @function_tool sends)


@pytest.mark.parametrize("engine", ENGINES)
def test_strict_tools_with_auto_are_served_on_every_engine(engines: Running, engine: str) -> None:
    """They were refused on every engine but OpenAI's (issue 42): the Agents SDK failed on all self-hosted ones."""
    reply = oai(engines).responses.with_raw_response.create(model=f"m-{engine}", input="Weather in Oslo?",
                                                            tools=[STRICT_WEATHER], max_output_tokens=16)
    assert reply.parse().status in ("completed", "incomplete")
    assert "x-gateway-output-invalid" not in reply.headers


def strict_fleet(engines: tuple[str, ...]) -> Any:
    specs = [SimSpec(engine=e, model="shared", name=f"sim-{e}", time_scale=TIME_SCALE, tool_call_rate=1.0)
             for e in engines]
    return FleetThread(specs)


def test_strict_tools_go_to_an_engine_that_enforces_them_where_one_serves_the_model() -> None:
    with strict_fleet(("tabbyapi", "vllm")) as fleet:
        settings = gateway_settings(fleet.fleet.servers, routing={"policy": "round-robin"})
        with serve_in_thread(create_app(settings)) as gateway:
            served = {oai(gateway).responses.with_raw_response.create(
                model="shared", input="Weather?", tools=[STRICT_WEATHER], max_output_tokens=32
            ).headers["x-gateway-backend"] for _ in range(4)}
    assert served == {"sim-vllm"}


def test_strict_tool_arguments_nothing_enforced_are_checked_and_marked_never_refused() -> None:
    """Only TabbyAPI serves the model: the tools go as sent, and with validate_outputs a call's arguments are
    checked against their schema after the fact (here cut short by max_output_tokens: not even JSON); the answer
    is marked. Without it (the default, as for every constraint) the answer is not checked."""
    with strict_fleet(("tabbyapi",)) as fleet, serve_in_thread(create_app(gateway_settings(fleet.fleet.servers))) \
            as gateway:
        unchecked = oai(gateway).responses.with_raw_response.create(model="shared", input="Weather?",
                                                                    tools=[STRICT_WEATHER], max_output_tokens=3)
    assert "x-gateway-output-invalid" not in unchecked.headers
    with strict_fleet(("tabbyapi",)) as fleet, serve_in_thread(create_app(
            gateway_settings(fleet.fleet.servers, structured_output={"validate_outputs": "mark"}))) as gateway:
        whole = oai(gateway).responses.with_raw_response.create(model="shared", input="Weather?",
                                                                tools=[STRICT_WEATHER], max_output_tokens=64)
        cut = oai(gateway).responses.with_raw_response.create(model="shared", input="Weather?",
                                                              tools=[STRICT_WEATHER], max_output_tokens=3)
    call = next(item for item in whole.parse().output if item.type == "function_call")
    assert "city" in json.loads(call.arguments) and "x-gateway-output-invalid" not in whole.headers
    assert "strict tool 'get_weather'" in cut.headers["x-gateway-output-invalid"]


def test_an_unknown_previous_response_is_404_in_openais_shape(engines: Running) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        oai(engines).responses.create(model="m-vllm", input="Hi", previous_response_id="resp_nope")
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_responses_errors_name_the_fields_the_client_sent() -> None:
    """The request was validated as its chat translation: its errors named max_tokens and response_format."""
    from gateway.api.agent_apis import _Responses, _responses_field

    assert [_responses_field(f) for f in ("max_tokens", "messages", "messages[1].role", "response_format",
                                          "response_format.json_schema.schema", "tools", "tools[].function.strict",
                                          "tools[2].function.parameters")] == [
        "max_output_tokens", "input", "messages[1].role", "text.format", "text.format.schema", "tools",
        "tools[].strict", "tools[2].parameters"]
    body = b'{"error": {"message": "\'max_tokens\' is 200000; this gateway accepts at most 32768", ' \
        b'"type": "invalid_request_error", "param": "max_tokens", "code": "invalid_value"}}'
    error = json.loads(_Responses.error(None, 400, body))["error"]  # type: ignore[arg-type]
    assert error["param"] == "max_output_tokens" and error["message"].startswith("'max_output_tokens' is 200000")
    assert _Responses.error(None, 502, b"not json") == b"not json"  # type: ignore[arg-type]


def test_a_responses_request_too_large_is_refused_naming_max_output_tokens(engines: Running) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai(engines).responses.create(model="m-vllm", input="Hi", max_output_tokens=10_000_000)
    assert refused.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    assert "max_output_tokens" in refused.value.message and "max_tokens'" not in refused.value.message


# --- one conversation, three APIs, one prefix --------------------------------------------------------------
def test_routing_sees_the_same_conversation_whichever_api_carried_it() -> None:
    system = "You are a careful assistant. " * 20  # several prefix blocks long
    turns = ["What is the capital of France?", "Paris.", "And of Italy?"]
    chat = {"model": "m", "max_tokens": 16, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": turns[0]},
        {"role": "assistant", "content": turns[1]}, {"role": "user", "content": turns[2]}]}
    messages = messages_to_chat({"model": "m", "max_tokens": 16, "system": system, "messages": [
        {"role": "user", "content": turns[0]}, {"role": "assistant", "content": turns[1]},
        {"role": "user", "content": [{"type": "text", "text": turns[2]}]}]})
    responses = responses_to_chat({"model": "m", "max_output_tokens": 16, "instructions": system, "input": [
        {"role": "user", "content": turns[0]}, {"role": "assistant", "content": turns[1]},
        {"role": "user", "content": [{"type": "input_text", "text": turns[2]}]}]})

    def blocks(body: dict[str, Any]) -> list[bytes]:
        return RouteRequest(route="chat", model="m", stream=False, max_tokens=16, body=body).blocks

    reference = blocks(chat)
    assert len(reference) >= len(system) // BLOCK_BYTES >= 4
    for other in (messages, responses):
        shared = 0
        for mine, theirs in zip(reference, blocks(other), strict=False):
            if mine != theirs:
                break
            shared += 1
        assert shared >= len(system) // BLOCK_BYTES  # the whole system prompt at least, whichever API


# --- reasoning and tool calls, measured, on both paths -------------------------------------------------------
@pytest.fixture(scope="module")
def thinkers() -> Iterator[Running]:
    """Reasoning models that call tools when they may: TabbyAPI (translated) and vLLM (native)."""
    specs = [SimSpec(engine=e, model=f"think-{e}", name=f"sim-{e}", time_scale=TIME_SCALE, reasoning=True,
                     tool_call_rate=1.0) for e in ("tabbyapi", "vllm")]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


@pytest.mark.parametrize("engine", ["tabbyapi", "vllm"])
def test_reasoning_then_text_streams_as_thinking_and_its_first_token_is_timed(thinkers: Running,
                                                                             engine: str) -> None:
    model = f"think-{engine}"
    before = samples(thinkers, "gateway_time_to_first_token_seconds_count", model=model)
    with claude(thinkers).messages.stream(model=model, max_tokens=80,
                                          messages=[{"role": "user", "content": "Think, then say hi."}]) as stream:
        final = stream.get_final_message()
    kinds = [b.type for b in final.content]
    assert kinds[0] == "thinking" and final.content[0].thinking  # type: ignore[union-attr]
    assert samples(thinkers, "gateway_time_to_first_token_seconds_count", model=model) == before + 1
    events = list(oai(thinkers).responses.create(model=model, input="Think, then say hi.", max_output_tokens=80,
                                                 stream=True))
    done = events[-1].response  # type: ignore[union-attr]
    assert done.output[0].type == "reasoning"
    assert samples(thinkers, "gateway_time_to_first_token_seconds_count", model=model) == before + 2
    if engine == "vllm":  # vLLM reports its reasoning tokens (TabbyAPI does not): counted apart
        assert samples(thinkers, "gateway_reasoning_tokens_total", model=model) > 0


@pytest.mark.parametrize("engine", ["tabbyapi", "vllm"])
def test_a_tool_call_only_stream_is_timed_and_round_trips(thinkers: Running, engine: str) -> None:
    """tool_choice auto (no constraint): the model calls the tool on its own, on both paths; the stream carries
    reasoning and tool-call arguments only, and its first token is timed all the same."""
    model = f"think-{engine}"
    before = samples(thinkers, "gateway_time_to_first_token_seconds_count", model=model)
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with claude(thinkers).messages.stream(model=model, max_tokens=120, tools=[WEATHER_ANTHROPIC],
                                          messages=asked) as stream:
        first = stream.get_final_message()
    assert first.stop_reason == "tool_use"
    use = next(b for b in first.content if b.type == "tool_use")
    assert "city" in use.input  # type: ignore[operator]
    assert samples(thinkers, "gateway_time_to_first_token_seconds_count", model=model) == before + 1
    answer = claude(thinkers).messages.create(model=model, max_tokens=64, tools=[WEATHER_ANTHROPIC], messages=[
        *asked, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}])
    assert answer.content
    reply = oai(thinkers).responses.create(model=model, input="Weather in Oslo?", tools=[WEATHER_OPENAI],
                                           max_output_tokens=120)
    call = next(item for item in reply.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)


# what Claude Code sends with its default tools: a system message inside messages, and adaptive thinking
CLAUDE_CODE = {"max_tokens": 16, "thinking": {"type": "adaptive"},
               "messages": [{"role": "user", "content": "Hello"}, {"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Go on."}]}
# the engines whose own Messages accepts both (the real llama-server; current vLLM); SGLang's refuses both
ACCEPTS_CLAUDE_CODE = {"llamacpp": "native", "vllm": "native", "sglang": "translated", "tabbyapi": "translated"}


@pytest.mark.parametrize("engine", ENGINES)
def test_claude_codes_first_request_is_served_natively_only_where_the_engine_accepts_it(engines: Running,
                                                                                       engine: str) -> None:
    """Claude Code failed at turn 1 on llama.cpp, vLLM and SGLang (issue 42)."""
    reply = httpx.post(engines.url + "/v1/messages", json={"model": f"m-{engine}", **CLAUDE_CODE},
                       headers={"x-api-key": "k"})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-gateway-agent-api"] == ACCEPTS_CLAUDE_CODE[engine]
    sent = last_generation(engines, engine)
    if ACCEPTS_CLAUDE_CODE[engine] == "native":
        assert sent.path == "/v1/messages" and sent.body["messages"][1] == {"role": "system", "content": "Be brief."}
    else:
        assert sent.path == "/v1/chat/completions"


THOUGHT = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "s"},
                                          {"type": "text", "text": "Hi."}]}


@pytest.mark.parametrize("keep", ["all", {"type": "thinking_turns", "value": 0}], ids=["keep-all", "clear"])
@pytest.mark.parametrize("engine", ["llamacpp", "vllm"])
def test_context_management_that_clears_reasoning_is_translated_where_the_engine_would_drop_it(
        engines: Running, engine: str, keep: Any) -> None:
    """No engine's own Messages reads ``context_management`` (llama-server's conversion leaves it out; vLLM's
    and SGLang's request models have no such field, and pydantic drops it): passed through, an edit clearing
    earlier turns' reasoning was silently not applied. Claude Code's ``keep: "all"`` clears nothing."""
    body = {"model": f"m-{engine}", "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]},
            "messages": [{"role": "user", "content": "Hello"}, THOUGHT, {"role": "user", "content": "Go on."}]}
    reply = httpx.post(engines.url + "/v1/messages", json=body, headers={"x-api-key": "k"})
    assert reply.status_code == 200, reply.text
    sent = last_generation(engines, engine)
    if keep == "all":
        assert reply.headers["x-gateway-agent-api"] == "native" and sent.path == "/v1/messages"
    else:
        assert reply.headers["x-gateway-agent-api"] == "translated" and sent.path == "/v1/chat/completions"
        assert all("reasoning_content" not in m for m in sent.body["messages"])  # (cleared, as asked)


@pytest.mark.parametrize(("change", "refused_by_sglang"), [
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi"}]}, True),
    ({"thinking": {"type": "adaptive"}}, True),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, False),
])
def test_each_emulator_accepts_and_refuses_messages_as_its_engine_does(engines: Running, change: dict[str, Any],
                                                                       refused_by_sglang: bool) -> None:
    body = {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **change}
    for engine in ("llamacpp", "vllm", "sglang"):
        server = engines.server(f"sim-{engine}")
        reply = httpx.post(server.url + "/v1/messages", json={"model": f"m-{engine}", **body},
                           headers={"x-api-key": f"key-{engine}", "authorization": f"Bearer key-{engine}"})
        assert reply.status_code == (400 if engine == "sglang" and refused_by_sglang else 200), (engine, reply.text)
