"""The generated agent model on a real llama-server: what the agent-client tests rely on, checked at the source.
llama.cpp reads the tool-call and reasoning formats from its chat template, builds the call's grammar from the
tools' schemas and parses the answer; the model reasons (unless thinking is off), calls a tool when offered
tools, answers once a tool's result is in, and answers when no tool is offered."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from gateway.llamacpp.server import LlamaServer

pytestmark = pytest.mark.system

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": {
             "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
ASK = {"role": "user", "content": "What is the weather in Oslo?"}


def _chat(server: LlamaServer, **body: object) -> dict:
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": "x", "max_tokens": 200, **body},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_the_server_reads_tool_support_from_the_template(agent_llama: LlamaServer) -> None:
    caps = httpx.get(agent_llama.url + "/props", timeout=10).json()["chat_template_caps"]
    assert caps["supports_tools"] and caps["supports_tool_calls"]


def test_it_calls_an_offered_tool_with_arguments_its_schema_allows(agent_llama: LlamaServer) -> None:
    choice = _chat(agent_llama, messages=[ASK], tools=TOOLS)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning_content"] == "I will look at it"
    (call,) = choice["message"]["tool_calls"]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    # the same call streamed, as tool_calls deltas
    with httpx.stream("POST", agent_llama.url + "/v1/chat/completions", timeout=60,
                      json={"model": "x", "messages": [ASK], "tools": TOOLS, "stream": True}) as stream:
        deltas = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    names = [c["function"]["name"] for d in deltas for c in d["choices"][0]["delta"].get("tool_calls") or []
             if c.get("function", {}).get("name")]
    assert names == [call["function"]["name"]]


def test_it_answers_once_the_tools_result_is_in_and_without_tools(agent_llama: LlamaServer) -> None:
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "", "days": 0}'}}]}
    after = _chat(agent_llama, messages=[ASK, called, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                  tools=TOOLS)
    plain = _chat(agent_llama, messages=[ASK])
    unthinking = _chat(agent_llama, messages=[ASK], chat_template_kwargs={"enable_thinking": False})
    for choice in (after, plain, unthinking):
        assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
        assert choice["message"]["content"] == "answer from the call."
    assert after["message"]["reasoning_content"] == plain["message"]["reasoning_content"] == "I will look at it"
    assert not unthinking["message"].get("reasoning_content")


def test_with_thinking_off_it_calls_at_once(agent_llama: LlamaServer) -> None:
    choice = _chat(agent_llama, messages=[ASK], tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert choice["finish_reason"] == "tool_calls" and not choice["message"].get("reasoning_content")
