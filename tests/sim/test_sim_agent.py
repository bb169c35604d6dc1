"""Agent features of the emulators: forced and automatic tool calls, reasoning models, each in its engine's fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from gateway.sim import FleetThread, SimSpec
from tests.sim.conftest import ask_usage

ENGINES = ("llamacpp", "vllm", "sglang", "tabbyapi")
MODEL = "sim-llama-2-7b"
REASONING_FIELD = {"vllm": "reasoning", "sglang": "reasoning_content", "llamacpp": "reasoning_content",
                   "tabbyapi": "reasoning_content"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                            "units": {"type": "string", "enum": ["c", "f"]}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "noop", "description": "nothing",
                                           "parameters": {"type": "object", "properties": {}}}}]
MSG = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agents() -> Iterator[FleetThread]:
    specs = []
    for e in ENGINES:
        specs += [SimSpec(engine=e, model=MODEL, name=f"plain-{e}", time_scale=50),  # type: ignore[arg-type]
                  SimSpec(engine=e, model=MODEL, name=f"auto-{e}", time_scale=50, tool_call_rate=1.0),  # type: ignore[arg-type]
                  SimSpec(engine=e, model=MODEL, name=f"think-{e}", time_scale=50, reasoning=True)]  # type: ignore[arg-type]
    with FleetThread(specs) as ft:
        yield ft


def post(ft: FleetThread, name: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": MSG, "max_tokens": 300, **ask_usage(name), **extra}
    with httpx.Client(timeout=20) as c:
        return c.post(ft.fleet[name].url + "/v1/chat/completions", json=body)


def events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.replace("\r\n", "\n").split("\n"):
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    assert "data: [DONE]" in r.text
    return out


def deltas(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in evs if c.get("choices") and "delta" in c["choices"][0]]


def finish(evs: list[dict[str, Any]]) -> str:
    reasons = [c["choices"][0]["finish_reason"] for c in evs if c.get("choices") and c["choices"][0]["finish_reason"]]
    assert len(reasons) == 1, reasons
    return reasons[0]  # type: ignore[no-any-return]


def assembled_calls(evs: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Tool calls put together from their streamed fragments, as an OpenAI client does."""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas(evs):
        for tc in d.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": "", "fragments": 0})
            call["id"] = call["id"] or tc.get("id")
            fn = tc.get("function") or {}
            call["name"] = call["name"] or fn.get("name")
            if fn.get("arguments"):
                call["arguments"] += fn["arguments"]
                call["fragments"] += 1
    return calls


FORCED = [("required", "get_weather"), ({"type": "function", "function": {"name": "noop"}}, "noop"),
          ({"type": "function", "function": {"name": "get_weather"}}, "get_weather")]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(("choice", "name"), FORCED)
def test_forced_tool_call_non_streamed(agents: FleetThread, engine: str, choice: Any, name: str) -> None:
    body = post(agents, f"plain-{engine}", tools=TOOLS, tool_choice=choice).json()
    ch = body["choices"][0]
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == name
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, TOOLS[0 if name == "get_weather" else 1]["function"]["parameters"])
    if name == "get_weather":
        assert {"city", "days"} <= set(args)
    assert not ch["message"]["content"]
    named = isinstance(choice, dict)
    assert ch["finish_reason"] == ("stop" if engine == "vllm" and named else "tool_calls")
    assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("engine", ENGINES)
def test_forced_tool_call_streamed_arguments_assemble_to_valid_json(agents: FleetThread, engine: str) -> None:
    evs = events(post(agents, f"plain-{engine}", tools=TOOLS, tool_choice="required", stream=True,
                      stream_options={"include_usage": True}))
    calls = assembled_calls(evs)
    assert list(calls) == [0]
    call = calls[0]
    assert call["id"] and call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    jsonschema.validate(args, WEATHER)
    assert {"city", "days"} <= set(args)
    if engine == "tabbyapi":  # parsed at the end of the stream: the whole call in one delta
        assert call["fragments"] == 1
    else:  # name first with empty arguments, then the arguments token by token
        first = next(d for d in deltas(evs) if d.get("tool_calls"))["tool_calls"][0]
        assert first["function"]["name"] == "get_weather" and first["function"]["arguments"] == ""
        assert call["fragments"] > 3
    assert not any(d.get("content") for d in deltas(evs))
    assert finish(evs) == "tool_calls"
    usage = [c["usage"] for c in evs if c.get("usage")][-1]
    assert usage["completion_tokens"] >= call["fragments"]


@pytest.mark.parametrize("engine", ENGINES)
def test_auto_at_rate_one_calls_and_at_rate_zero_answers(agents: FleetThread, engine: str) -> None:
    called = post(agents, f"auto-{engine}", tools=TOOLS).json()["choices"][0]
    assert called["finish_reason"] == "tool_calls"
    assert called["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = post(agents, f"plain-{engine}", tools=TOOLS, tool_choice="auto").json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"]
    assert not plain["message"].get("tool_calls")


@pytest.mark.parametrize("engine", ENGINES)
def test_auto_answers_a_tools_result_rather_than_calling_again(agents: FleetThread, engine: str) -> None:
    """So an agent's round trip ends, as with a real model; a forced call is still made."""
    called = post(agents, f"auto-{engine}", tools=TOOLS).json()["choices"][0]["message"]
    result = [*MSG, {k: called[k] for k in ("role", "content", "tool_calls")},
              {"role": "tool", "tool_call_id": called["tool_calls"][0]["id"], "content": "sunny"}]
    answered = post(agents, f"auto-{engine}", tools=TOOLS, messages=result).json()["choices"][0]
    assert answered["finish_reason"] == "stop" and answered["message"]["content"]
    assert not answered["message"].get("tool_calls")
    forced = post(agents, f"auto-{engine}", tools=TOOLS, messages=result, tool_choice="required").json()
    assert forced["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("engine", ENGINES)
def test_tool_choice_none_never_calls(agents: FleetThread, engine: str) -> None:
    ch = post(agents, f"auto-{engine}", tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"] and not ch["message"].get("tool_calls")


def test_a_named_tool_that_is_not_offered_is_refused(agents: FleetThread) -> None:
    r = post(agents, "plain-vllm", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}})
    assert r.status_code == 400


@pytest.mark.parametrize("engine", ENGINES)
def test_reasoning_model_non_streamed(agents: FleetThread, engine: str) -> None:
    body = post(agents, f"think-{engine}").json()
    msg = body["choices"][0]["message"]
    field = REASONING_FIELD[engine]
    assert msg[field] and msg["content"]
    other = "reasoning_content" if field == "reasoning" else "reasoning"
    assert other not in msg
    details = body["usage"].get("completion_tokens_details")
    if engine in ("vllm", "sglang"):
        n = details["reasoning_tokens"]
        assert 0 < n < body["usage"]["completion_tokens"]
    else:
        assert details is None


@pytest.mark.parametrize("engine", ENGINES)
def test_reasoning_model_streams_reasoning_before_content(agents: FleetThread, engine: str) -> None:
    ds = deltas(events(post(agents, f"think-{engine}", stream=True)))
    field = REASONING_FIELD[engine]
    kinds = ["r" if d.get(field) else "c" for d in ds if d.get(field) or d.get("content")]
    assert kinds[0] == "r" and "c" in kinds
    assert kinds == sorted(kinds, key=lambda k: k == "c")  # all reasoning, then all content
    other = "reasoning_content" if field == "reasoning" else "reasoning"
    assert not any(other in d for d in ds)


@pytest.mark.parametrize("engine", ENGINES)
def test_enable_thinking_false_gets_no_reasoning(agents: FleetThread, engine: str) -> None:
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    msg = post(agents, f"think-{engine}", **kw).json()["choices"][0]["message"]
    assert msg["content"] and not msg.get(REASONING_FIELD[engine])
    ds = deltas(events(post(agents, f"think-{engine}", stream=True, **kw)))
    assert not any(d.get(REASONING_FIELD[engine]) for d in ds)


@pytest.mark.parametrize("engine", ENGINES)
def test_plain_model_has_no_reasoning(agents: FleetThread, engine: str) -> None:
    msg = post(agents, f"plain-{engine}").json()["choices"][0]["message"]
    assert msg["content"] and not msg.get(REASONING_FIELD[engine])


def test_reasoning_then_tool_call(agents: FleetThread) -> None:
    ds = deltas(events(post(agents, "think-vllm", tools=TOOLS, tool_choice="required", stream=True)))
    first_tool = next(i for i, d in enumerate(ds) if d.get("tool_calls"))
    assert any(d.get("reasoning") for d in ds[:first_tool])
    assert not any(d.get("reasoning") for d in ds[first_tool:])


def test_tool_call_rate_is_validated() -> None:
    with pytest.raises(ValueError, match="tool_call_rate"):
        SimSpec(engine="vllm", model=MODEL, tool_call_rate=1.5)
    with pytest.raises(ValueError, match="tool_template"):  # (only llama.cpp's emulator honours it)
        SimSpec(engine="vllm", model=MODEL, tool_template=False)
