"""The emulators' native agent routes, driven by the real SDKs: Responses (``openai``) and Messages (``anthropic``).

llama.cpp, vLLM and SGLang serve ``/v1/responses``, ``/v1/messages`` and ``/v1/messages/count_tokens``;
TabbyAPI serves none of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway.sim import FleetThread, SimSpec
from gateway.sim.generation import _WORDS as WORDS

AGENT_ENGINES = ("llamacpp", "vllm", "sglang")
MODEL = "sim-llama-2-7b"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city", "days"]}
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "weather", "parameters": WEATHER}]
MSG_TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agents() -> Iterator[FleetThread]:
    specs = []
    for e in (*AGENT_ENGINES, "tabbyapi"):
        specs += [SimSpec(engine=e, model=MODEL, name=f"plain-{e}", time_scale=50),  # type: ignore[arg-type]
                  SimSpec(engine=e, model=MODEL, name=f"think-{e}", time_scale=50, reasoning=True)]  # type: ignore[arg-type]
    with FleetThread(specs) as ft:
        yield ft


def oai(ft: FleetThread, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=ft.fleet[name].url + "/v1", api_key="none", max_retries=0, timeout=20)


def claude(ft: FleetThread, name: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=ft.fleet[name].url, api_key="none", max_retries=0, timeout=20)


def raw_events(ft: FleetThread, name: str, path: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    with httpx.Client(timeout=20) as c:
        r = c.post(ft.fleet[name].url + path, json=body)
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) == 2 and lines[0].startswith("event: "):
            data = json.loads(lines[1].removeprefix("data: "))
            assert data["type"] == lines[0].removeprefix("event: ")
            out.append(data)
    return r.text, out


# -- Responses ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_responses_plain(agents: FleetThread, engine: str) -> None:
    server = agents.fleet[f"plain-{engine}"]
    before = server.stats.tokens_generated
    r = oai(agents, f"plain-{engine}").responses.create(model=MODEL, input="hello there", instructions="be brief",
                                                       max_output_tokens=300)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    (item,) = r.output
    assert item.type == "message" and r.output_text and item.content[0].type == "output_text"
    assert r.usage is not None and r.usage.output_tokens >= 1 and r.usage.input_tokens > 3
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert server.stats.tokens_generated - before == r.usage.output_tokens  # counted like any generation
    rec = server.received[-1]
    assert rec.path == "/v1/responses" and rec.body["instructions"] == "be brief"


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_responses_streamed_text(agents: FleetThread, engine: str) -> None:
    stream = oai(agents, f"plain-{engine}").responses.create(model=MODEL, input=USER, stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    for t in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.output_item.done"):
        assert t in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text
    assert final.usage.output_tokens == types.count("response.output_text.delta")
    if engine != "llamacpp":  # llama.cpp numbers nothing and reports no usage details
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert final.usage.input_tokens_details.cached_tokens >= 0


def test_responses_stream_has_no_done_marker(agents: FleetThread) -> None:
    for engine in AGENT_ENGINES:
        text, evs = raw_events(agents, f"plain-{engine}", "/v1/responses", {"model": MODEL, "input": "hi",
                                                                            "stream": True})
        assert "[DONE]" not in text and evs[-1]["type"] == "response.completed"


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_responses_forced_tool_call(agents: FleetThread, engine: str) -> None:
    client = oai(agents, f"plain-{engine}")
    r = client.responses.create(model=MODEL, input=USER, tools=RESP_TOOLS, tool_choice="required")  # type: ignore[arg-type]
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events = list(client.responses.create(model=MODEL, input=USER, tools=RESP_TOOLS, stream=True,  # type: ignore[arg-type]
                                          tool_choice={"type": "function", "name": "get_weather"}))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    jsonschema.validate(json.loads(args), WEATHER)
    (done,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert done.type == "function_call" and done.arguments == args
    # the call's output goes back as an input item
    follow = client.responses.create(model=MODEL, input=[*USER, {"type": "function_call", "call_id": call.call_id,
                                                                 "name": call.name, "arguments": call.arguments},
                                                         {"type": "function_call_output", "call_id": call.call_id,
                                                          "output": "sunny"}],
                                     tools=RESP_TOOLS, tool_choice="none")  # type: ignore[arg-type]
    assert follow.output_text
    assert follow.usage is not None and r.usage is not None and follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_responses_reasoning_model(agents: FleetThread, engine: str) -> None:
    client = oai(agents, f"think-{engine}")
    r = client.responses.create(model=MODEL, input="think", max_output_tokens=300)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    assert r.output[0].content and r.output[0].content[0].text  # type: ignore[union-attr]
    if engine != "llamacpp":
        assert r.usage is not None and 12 <= r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="think", stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert reasoning and final.output[0].content[0].text == reasoning


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_responses_json_schema_text_format(agents: FleetThread, engine: str) -> None:
    r = oai(agents, f"plain-{engine}").responses.create(
        model=MODEL, input="give me weather", text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_responses_retrieved_by_id(agents: FleetThread, engine: str) -> None:
    client = oai(agents, f"plain-{engine}")
    r = client.responses.create(model=MODEL, input="remember me")
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")


def test_llamacpp_responses_input_tokens(agents: FleetThread) -> None:
    with httpx.Client(timeout=20) as c:
        r = c.post(agents.fleet["plain-llamacpp"].url + "/v1/responses/input_tokens", json={"input": "hello there"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 2


# -- Messages -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_plain(agents: FleetThread, engine: str) -> None:
    m = claude(agents, f"plain-{engine}").messages.create(model=MODEL, max_tokens=300, system="be brief",
                                                          messages=USER)  # type: ignore[arg-type]
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    (block,) = m.content
    assert block.type == "text" and block.text
    assert m.usage.output_tokens >= 1 and m.usage.input_tokens > 3
    rec = agents.fleet[f"plain-{engine}"].received[-1]
    assert rec.path == "/v1/messages" and rec.body["system"] == "be brief"


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_streamed(agents: FleetThread, engine: str) -> None:
    client = claude(agents, f"plain-{engine}")
    with client.messages.stream(model=MODEL, max_tokens=300, messages=USER) as stream:  # type: ignore[arg-type]
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens >= 1
    raw, evs = raw_events(agents, f"plain-{engine}", "/v1/messages",
                          {"model": MODEL, "max_tokens": 5, "messages": USER, "stream": True})
    types = [e["type"] for e in evs]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"] and "[DONE]" not in raw
    assert evs[-2]["delta"]["stop_reason"] == "max_tokens" and evs[-2]["usage"]["output_tokens"] == 5


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_forced_tool_use(agents: FleetThread, engine: str) -> None:
    client = claude(agents, f"plain-{engine}")
    m = client.messages.create(model=MODEL, max_tokens=300, messages=USER, tools=MSG_TOOLS,  # type: ignore[arg-type]
                               tool_choice={"type": "any"})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER)
    assert m.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=300, messages=USER, tools=MSG_TOOLS,  # type: ignore[arg-type]
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    # vLLM finishes a forced named tool with "stop", which its Anthropic router maps to end_turn
    assert final.stop_reason == ("end_turn" if engine == "vllm" else "tool_use")
    follow = client.messages.create(model=MODEL, max_tokens=50, tools=MSG_TOOLS, messages=[  # type: ignore[arg-type]
        *USER, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name,
                                                  "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}],
        tool_choice={"type": "none"})
    assert follow.content[-1].type == "text" and follow.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_reasoning_model_thinking_blocks(agents: FleetThread, engine: str) -> None:
    client = claude(agents, f"think-{engine}")
    m = client.messages.create(model=MODEL, max_tokens=300, messages=USER)  # type: ignore[arg-type]
    assert [b.type for b in m.content] == ["thinking", "text"]
    with client.messages.stream(model=MODEL, max_tokens=300, messages=USER) as stream:  # type: ignore[arg-type]
        thinking = "".join(e.delta.thinking for e in stream if e.type == "content_block_delta"
                           and e.delta.type == "thinking_delta")
        final = stream.get_final_message()
    assert thinking and final.content[0].thinking == thinking  # type: ignore[union-attr]
    assert final.content[1].text  # type: ignore[union-attr]


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_stop_sequence(agents: FleetThread, engine: str) -> None:
    client = claude(agents, f"plain-{engine}")
    stops = [" " + w for w in WORDS]  # the emulators' answers are words from this list: the second one stops
    m = client.messages.create(model=MODEL, max_tokens=300, messages=USER, stop_sequences=stops)  # type: ignore[arg-type]
    text = m.content[0].text  # type: ignore[union-attr]
    assert text in WORDS and m.stop_reason == "end_turn"
    assert m.usage.output_tokens == 1
    # llama.cpp reports the word it stopped on; vLLM's Anthropic router never fills stop_sequence
    assert (m.stop_sequence in stops) if engine == "llamacpp" else m.stop_sequence is None


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_count_tokens(agents: FleetThread, engine: str) -> None:
    client = claude(agents, f"plain-{engine}")
    n = client.messages.count_tokens(model=MODEL, messages=USER).input_tokens  # type: ignore[arg-type]
    m = client.messages.create(model=MODEL, max_tokens=5, messages=USER)  # type: ignore[arg-type]
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)  # (Anthropic: cached apart)
    assert client.messages.count_tokens(model=MODEL, messages=USER, system="long system prompt here",  # type: ignore[arg-type]
                                        tools=MSG_TOOLS).input_tokens > n  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", AGENT_ENGINES)
def test_messages_errors(agents: FleetThread, engine: str) -> None:
    with httpx.Client(timeout=20) as c:
        r = c.post(agents.fleet[f"plain-{engine}"].url + "/v1/messages", json={"model": MODEL, "messages": USER})
    assert r.status_code == 400
    body = r.json()
    if engine == "llamacpp":
        assert body["error"]["code"] == 400 and "max_tokens" in body["error"]["message"]
    else:
        assert body["type"] == "error" and "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude(agents, f"plain-{engine}").messages.create(model=MODEL, max_tokens=10, messages=[])


def test_tabbyapi_serves_no_agent_routes(agents: FleetThread) -> None:
    url = agents.fleet["plain-tabbyapi"].url
    with httpx.Client(timeout=20) as c:
        for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens"):
            assert c.post(url + path, json={"model": MODEL, "input": "hi"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        oai(agents, "plain-tabbyapi").responses.create(model=MODEL, input="hi")
    with pytest.raises(anthropic.NotFoundError):
        claude(agents, "plain-tabbyapi").messages.create(model=MODEL, max_tokens=5, messages=USER)  # type: ignore[arg-type]


def test_agent_routes_show_in_engine_metrics(agents: FleetThread) -> None:
    server = agents.fleet["plain-vllm"]
    with httpx.Client(timeout=20) as c:
        before = c.get(server.url + "/metrics").text
        claude(agents, "plain-vllm").messages.create(model=MODEL, max_tokens=7, messages=USER)  # type: ignore[arg-type]
        after = c.get(server.url + "/metrics").text

    def gen_tokens(text: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith("vllm:generation_tokens_total"))
        return float(line.rsplit(" ", 1)[1])

    assert gen_tokens(after) - gen_tokens(before) == 7
