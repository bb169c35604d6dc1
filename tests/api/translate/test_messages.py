"""The Anthropic Messages API <-> chat completions translation: requests, answers, stream events, errors.

Every Message is validated with the SDK's ``Message`` model and every stream event with its
``RawMessageStreamEvent`` type; streams and answers are also read by the real SDK client (``messages.stream``,
``messages.create``) through a mock transport (``httpx2``, the HTTP library this SDK
version uses), so its accumulator checks block order, indexes and the
tool input assembled from ``partial_json`` fragments."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx2
import orjson
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.api.translate.messages import (
    MessagesStream,
    anthropic_error,
    anthropic_error_from_openai,
    chat_to_message,
    count_tokens_chat,
    messages_to_chat,
)
from gateway.errors import GatewayError

pytestmark = pytest.mark.unit

_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **fields}


def _refused(body: dict[str, Any], param: str, code: str = "unsupported_field") -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        messages_to_chat(body)
    error = caught.value
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error", param, code)
    assert error.message
    return error


# ---- requests ----------------------------------------------------------------------------------------------

def test_string_system_and_settings_map() -> None:
    chat = messages_to_chat(_body(system="be brief", temperature=0.2, top_p=0.9, top_k=40,
                                  stop_sequences=["END", "###"], metadata={"user_id": "u1"},
                                  service_tier="auto", cache_control={"type": "ephemeral"}))
    assert chat == {"model": "m", "max_tokens": 100, "temperature": 0.2, "top_p": 0.9, "top_k": 40,
                    "stop": ["END", "###"], "user": "u1",
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}


def test_system_blocks_are_joined_and_cache_hints_ignored() -> None:
    chat = messages_to_chat(_body(system=[
        {"type": "text", "text": "You are a coding agent."},
        {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]))
    assert chat["messages"][0] == {"role": "system", "content": "You are a coding agent.\nBe terse."}


def test_stream_asks_for_usage() -> None:
    chat = messages_to_chat(_body(stream=True))
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "stream" not in messages_to_chat(_body(stream=False))


def test_multi_turn_with_tool_use_thinking_and_tool_results() -> None:
    chat = messages_to_chat(_body(messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "weather?"},
            {"type": "text", "text": "in two cities", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look both up", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "cold"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "retry later"}]},
            {"type": "text", "text": "and tomorrow?"}]},
    ]))
    assert chat["messages"] == [
        {"role": "user", "content": "weather?\nin two cities"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look both up", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout\nretry later"},
        {"role": "user", "content": "and tomorrow?"},
    ]
    assert "continue_final_message" not in chat


def test_assistant_with_only_tool_calls_has_null_content() -> None:
    chat = messages_to_chat(_body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]))
    assert chat["messages"][1]["content"] is None
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "t", "content": ""}


def test_images_become_image_url_parts() -> None:
    chat = messages_to_chat(_body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "compare"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}]}]))
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]}]


def test_system_role_message_and_prefill() -> None:
    chat = messages_to_chat(_body(messages=[
        {"role": "system", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": "pick A or B"},
        {"role": "assistant", "content": "The answer is ("}]))
    assert chat["messages"][0] == {"role": "system", "content": "rules"}
    assert chat["messages"][-1] == {"role": "assistant", "content": "The answer is ("}
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False


def test_raw_tool_input_goes_back_as_the_text_the_model_wrote() -> None:
    chat = messages_to_chat(_body(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"_raw": "{oops"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "bad input"}]}]))
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{oops"


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"),
    ({"type": "any"}, "required"),
    ({"type": "none"}, "none"),
    ({"type": "tool", "name": "weather"}, {"type": "function", "function": {"name": "weather"}}),
])
def test_tools_and_each_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    chat = messages_to_chat(_body(tool_choice=choice, tools=[
        {"name": "weather", "description": "Weather in a city", "input_schema": _WEATHER,
         "cache_control": {"type": "ephemeral"}},
        {"type": "custom", "name": "clock", "input_schema": {"type": "object"}, "strict": True}]))
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "weather", "parameters": _WEATHER,
                                          "description": "Weather in a city"}},
        {"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}, "strict": True}}]
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_disable_parallel_tool_use() -> None:
    chat = messages_to_chat(_body(tools=[{"name": "f", "input_schema": {"type": "object"}}],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False


def test_tool_choice_without_tools() -> None:
    assert "tool_choice" not in messages_to_chat(_body(tool_choice={"type": "auto"}))
    _refused(_body(tool_choice={"type": "any"}), "tool_choice", "invalid_value")


@pytest.mark.parametrize(("thinking", "enabled"), [
    ({"type": "enabled", "budget_tokens": 2048}, True),
    ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False),
])
def test_thinking_switches_the_chat_template(thinking: dict[str, Any], enabled: bool) -> None:
    chat = messages_to_chat(_body(thinking=thinking))
    assert chat["chat_template_kwargs"] == {"enable_thinking": enabled, "thinking": enabled}
    assert "budget_tokens" not in orjson.dumps(chat).decode()


def test_output_config_maps_to_response_format_and_effort() -> None:
    chat = messages_to_chat(_body(output_config={"effort": "low", "format": {"type": "json_schema",
                                                                               "schema": _WEATHER}}))
    assert chat["reasoning_effort"] == "low"
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": _WEATHER, "strict": True}}


def test_context_management_clears_older_thinking() -> None:
    def turn(thought: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": ""},
                                                  {"type": "text", "text": "a"}]}]
    history = [*turn("one"), *turn("two"), *turn("three"), {"role": "user", "content": "q"}]
    keep_all = messages_to_chat(_body(messages=history, context_management={
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}))
    assert [m["reasoning_content"] for m in keep_all["messages"] if "reasoning_content" in m] == ["one", "two",
                                                                                                  "three"]
    keep_two = messages_to_chat(_body(messages=history, context_management={
        "edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}}]}))
    assert [m.get("reasoning_content") for m in keep_two["messages"] if m["role"] == "assistant"] == [
        None, "two", "three"]
    _refused(_body(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}),
             "context_management.edits[0]")


@pytest.mark.parametrize(("fields", "param", "code"), [
    ({"max_tokens": None}, "max_tokens", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"container": "container_1"}, "container", "unsupported_field"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}]}, "mcp_servers",
     "unsupported_field"),
    ({"inference_geo": "us"}, "inference_geo", "unsupported_field"),
    ({"speed": "fast"}, "speed", "unsupported_field"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team", "unsupported_field"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]", "unsupported_field"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]", "unsupported_field"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{}]}]},
     "tools[0].input_examples", "unsupported_field"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "defer_loading": "yes"}]},
     "tools[0].defer_loading", "invalid_value"),
    ({"tool_choice": {"type": "whatever"}}, "tool_choice", "unsupported_field"),
    ({"thinking": {"type": "between_tools"}}, "thinking", "unsupported_field"),
    ({"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens", "invalid_value"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens", "invalid_value"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048, "display": "hidden"}}, "thinking.display",
     "invalid_value"),
    ({"output_config": {"effort": "max"}}, "output_config.effort", "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "messages[0].content[0]",
     "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result", "source": "s", "title": "t",
                                                  "content": []}]}]}, "messages[0].content[0]", "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source", "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"type": "x"}]}]}]},
     "messages[0].content[0].citations", "unsupported_field"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                 {"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[1]", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]}]},
     "messages[0].content[0].content[0]", "unsupported_field"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search",
                                                       "input": {}}]}]}, "messages[0].content[0]",
     "unsupported_field"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"some_new_field": 1}, "some_new_field", "unsupported_field"),
])
def test_refusals_name_the_field(fields: dict[str, Any], param: str, code: str) -> None:
    body = _body(**fields)
    if body.get("max_tokens") is None:
        del body["max_tokens"]
    _refused(body, param, code)


def test_count_tokens_translates_the_prompt_and_refuses_generation_settings() -> None:
    chat = count_tokens_chat({"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"name": "f", "input_schema": {"type": "object"}}],
                              "thinking": {"type": "disabled"}})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                    "chat_template_kwargs": {"enable_thinking": False, "thinking": False}}
    for field, value in (("max_tokens", 10), ("stream", True), ("temperature", 1.0)):
        with pytest.raises(GatewayError) as caught:
            count_tokens_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value})
        assert caught.value.param == field
    with pytest.raises(GatewayError) as caught:
        count_tokens_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "document"}]}]})
    assert caught.value.param == "messages[0].content[0]"


# ---- answers -----------------------------------------------------------------------------------------------

def _chat(message: dict[str, Any], finish: str | None = "stop", usage: dict[str, Any] | None = None,
          **choice: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "engine-name",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}],
            "usage": usage or {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}


def _message(chat: dict[str, Any]) -> dict[str, Any]:
    message = chat_to_message(chat, "claude-local")
    Message.model_validate(message)
    return message


def test_text_answer() -> None:
    message = _message(_chat({"content": "Hello!"}))
    assert message["id"].startswith("msg_")
    assert {k: v for k, v in message.items() if k != "id"} == {
        "type": "message", "role": "assistant", "model": "claude-local",
        "content": [{"type": "text", "text": "Hello!"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 5}}


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_comes_first_as_a_thinking_block(field: str) -> None:
    message = _message(_chat({"content": "42", field: "think hard"}))
    assert message["content"] == [{"type": "thinking", "thinking": "think hard", "signature": ""},
                                  {"type": "text", "text": "42"}]


def test_tool_calls_become_tool_use_blocks() -> None:
    message = _message(_chat({"content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "", "type": "function", "function": {"name": "clock", "arguments": ""}},
        {"id": "call_3", "type": "function", "function": {"name": "weather", "arguments": "{not json"}}]},
        finish="tool_calls"))
    blocks = message["content"]
    assert blocks[0] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}}
    assert blocks[1]["id"].startswith("toolu_") and blocks[1]["input"] == {}
    assert blocks[2]["input"] == {"_raw": "{not json"}
    assert message["stop_reason"] == "tool_use"


@pytest.mark.parametrize(("finish", "extra", "stop_reason", "stop_sequence"), [
    ("stop", {}, "end_turn", None),
    ("length", {}, "max_tokens", None),
    ("tool_calls", {}, "tool_use", None),
    ("content_filter", {}, "refusal", None),
    (None, {}, "end_turn", None),
    ("stop", {"stop_reason": "###"}, "stop_sequence", "###"),  # vLLM
    ("stop", {"matched_stop": "END"}, "stop_sequence", "END"),  # SGLang
    ("stop", {"stop_reason": 151645}, "end_turn", None),  # vLLM: a stop token id, not a stop sequence
])
def test_each_finish_reason(finish: str | None, extra: dict[str, Any], stop_reason: str,
                            stop_sequence: str | None) -> None:
    message = _message(_chat({"content": "x"}, finish, **extra))
    assert (message["stop_reason"], message["stop_sequence"]) == (stop_reason, stop_sequence)


def test_cached_tokens_are_reported_as_cache_reads() -> None:
    message = _message(_chat({"content": "x"}, usage={"prompt_tokens": 100, "completion_tokens": 3,
                                                      "prompt_tokens_details": {"cached_tokens": 64}}))
    assert message["usage"] == {"input_tokens": 36, "output_tokens": 3, "cache_read_input_tokens": 64}


def test_empty_answer_has_no_blocks() -> None:
    assert _message(_chat({"content": ""}, "length"))["content"] == []


# ---- errors ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (422, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
    (504, "timeout_error"), (529, "overloaded_error"),
])
def test_anthropic_error_type_by_status(status: int, kind: str) -> None:
    assert orjson.loads(anthropic_error(status, "boom")) == {"type": "error",
                                                             "error": {"type": kind, "message": "boom"}}


def test_openai_error_bodies_are_reshaped() -> None:
    openai_body = orjson.dumps({"error": {"message": "context too long", "type": "invalid_request_error",
                                          "param": None, "code": "context_length_exceeded"}})
    assert orjson.loads(anthropic_error_from_openai(400, openai_body)) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "context too long"}}
    assert orjson.loads(anthropic_error_from_openai(503, b'{"detail": "loading"}'))["error"] == {
        "type": "overloaded_error", "message": "loading"}
    assert orjson.loads(anthropic_error_from_openai(500, b"Internal Server Error"))["error"]["message"] == (
        "Internal Server Error")
    assert "502" in orjson.loads(anthropic_error_from_openai(502, b""))["error"]["message"]


# ---- streams -----------------------------------------------------------------------------------------------

def _sse(doc: dict[str, Any], spaced: bool = False) -> bytes:
    text = orjson.dumps(doc).decode()
    if spaced:  # what Python servers (json.dumps) send
        text = text.replace('":', '": ').replace(",", ", ")
    return f"data: {text}\n\n".encode()


def _delta(delta: dict[str, Any], finish: str | None = None, **choice: Any) -> bytes:
    return _sse({"id": "c", "object": "chat.completion.chunk", "model": "e",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}]})


def _usage_chunk(prompt: int = 9, completion: int = 4, **extra: Any) -> bytes:
    return _sse({"id": "c", "object": "chat.completion.chunk", "choices": [],
                 "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion, **extra}})


def _events(data: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Parse Anthropic SSE; every event but ping and error is validated with the SDK's type."""
    events = []
    assert data == b"" or data.endswith(b"\n\n")
    for raw in data.split(b"\n\n")[:-1]:
        name_line, data_line = raw.split(b"\n")
        assert name_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        name, doc = name_line[7:].decode(), orjson.loads(data_line[6:])
        assert doc["type"] == name
        if name not in ("ping", "error"):
            _EVENT.validate_python(doc)
        events.append((name, doc))
    return events


def _run(stream: MessagesStream, *feeds: bytes) -> bytes:
    return b"".join(stream.feed(f) for f in feeds) + stream.close()


def _through_sdk(data: bytes, stream: bool = True) -> Any:
    """The real anthropic client reads ``data`` as the gateway's answer."""
    def handler(request: httpx2.Request) -> httpx2.Response:
        if stream:
            return httpx2.Response(200, content=data, headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, content=data, headers={"content-type": "application/json"})
    client = anthropic.Anthropic(api_key="k", base_url="http://gateway.test", max_retries=0,
                                 http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))
    params: dict[str, Any] = {"model": "claude-local", "max_tokens": 100,
                              "messages": [{"role": "user", "content": "hi"}]}
    if not stream:
        return client.messages.create(**params)
    with client.messages.stream(**params) as events:
        return events.get_final_message()


def test_text_only_stream() -> None:
    stream = MessagesStream("claude-local")
    first = stream.feed(_delta({"role": "assistant", "content": ""}))
    names = [name for name, _ in _events(first)]
    assert names == ["message_start", "ping"]  # with the first chunk, not before
    rest = _run(stream, _delta({"content": "Hel"}), _delta({"content": "lo"}), _delta({}, "stop"),
                _usage_chunk(), b"data: [DONE]\n\n")
    events = _events(rest)
    assert [name for name, _ in events] == ["content_block_start", "content_block_delta", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]
    assert events[0][1]["content_block"] == {"type": "text", "text": ""}
    assert events[1][1]["delta"] == {"type": "text_delta", "text": "Hel"}
    assert events[4][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[4][1]["usage"] == {"input_tokens": 9, "output_tokens": 4}
    assert stream.usage == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
    final = _through_sdk(first + rest)
    assert final.content[0].text == "Hello" and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == 9 and final.usage.output_tokens == 4


def test_thinking_display_omitted_keeps_the_blocks_without_their_text() -> None:
    """Claude Code sends ``thinking.display: "omitted"``: Anthropic then returns thinking blocks with empty text
    (the model still reasons); it was refused, and Claude Code resent every request without it."""
    chat = messages_to_chat(_body(thinking={"type": "adaptive", "display": "omitted"}))
    assert chat["chat_template_kwargs"] == {"enable_thinking": True, "thinking": True}
    message = chat_to_message(_chat({"content": "42", "reasoning_content": "secret steps"}), "m", omit_thinking=True)
    Message.model_validate(message)
    assert message["content"] == [{"type": "thinking", "thinking": "", "signature": ""}, {"type": "text", "text": "42"}]
    stream = MessagesStream("m", omit_thinking=True)
    data = _run(stream, _delta({"role": "assistant", "reasoning_content": "secret "}), _delta({"reasoning": "steps"}),
                _delta({"content": "42"}), _delta({}, "stop"), _usage_chunk())
    assert b"secret" not in data and b"thinking_delta" not in data
    final = _through_sdk(data)
    assert final.content[0].type == "thinking" and final.content[0].thinking == ""
    assert final.content[1].text == "42"


def test_deferred_tools_reach_the_model_once_a_tool_search_loads_them() -> None:
    """Tool search (Claude Code's advanced-tool-use beta): a tool with ``defer_loading`` is not offered until a
    ``tool_reference`` in a tool result names it, as Anthropic does; it was refused, and Claude Code resent every
    request with all its tools loaded."""
    search = {"name": "ToolSearch", "input_schema": {"type": "object"}}
    later = {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}
    first = messages_to_chat(_body(tools=[search, later]))
    assert [t["function"]["name"] for t in first["tools"]] == ["ToolSearch"]
    history = [{"role": "user", "content": "find a tool"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "tu1", "name": "ToolSearch", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1", "content": [
                   {"type": "tool_reference", "tool_name": "Later"}]}]}]
    loaded = messages_to_chat(_body(tools=[search, later], messages=history))
    assert [t["function"]["name"] for t in loaded["tools"]] == ["ToolSearch", "Later"]
    assert loaded["messages"][-1] == {"role": "tool", "tool_call_id": "tu1", "content": "Tool loaded: Later"}
    only_deferred = messages_to_chat(_body(tools=[later], tool_choice={"type": "auto"}))
    assert "tools" not in only_deferred and "tool_choice" not in only_deferred


def test_nothing_before_the_first_chunk() -> None:
    stream = MessagesStream("m")
    assert stream.feed(b": keep-alive\n\n") == b""


def test_reasoning_then_text_stream() -> None:
    stream = MessagesStream("claude-local")
    data = _run(stream, _delta({"role": "assistant", "reasoning_content": "let me "}),
                _delta({"reasoning": "think"}), _delta({"content": "42"}), _delta({}, "stop"), _usage_chunk())
    events = _events(data)
    starts = [doc for name, doc in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]) for s in starts] == [
        (0, {"type": "thinking", "thinking": "", "signature": ""}), (1, {"type": "text", "text": ""})]
    stops = [doc["index"] for name, doc in events if name == "content_block_stop"]
    assert stops == [0, 1]
    final = _through_sdk(data)
    assert final.content[0].type == "thinking" and final.content[0].thinking == "let me think"
    assert final.content[1].text == "42"


def test_tool_calls_in_fragments_across_feeds_with_several_events_per_feed() -> None:
    stream = MessagesStream("claude-local")
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": ""}}
    out = [
        stream.feed(_delta({"role": "assistant", "content": None}) + _delta({"tool_calls": [call]})),
        stream.feed(_delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]})
                    + _delta({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]})),
        stream.feed(_delta({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                            "function": {"name": "clock", "arguments": "{}"}}]})),
        stream.feed(_delta({}, "tool_calls") + _usage_chunk() + b"data: [DONE]\n\n"),
        stream.close(),
    ]
    events = _events(b"".join(out))
    starts = [(doc["index"], doc["content_block"]) for name, doc in events if name == "content_block_start"]
    assert starts == [(0, {"type": "tool_use", "id": "call_a", "name": "weather", "input": {}}),
                      (1, {"type": "tool_use", "id": "call_b", "name": "clock", "input": {}})]
    fragments = [doc["delta"]["partial_json"] for name, doc in events if name == "content_block_delta"]
    assert fragments == ['{"ci', 'ty": "Oslo"}', "{}"]  # streamed through, not accumulated
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    final = _through_sdk(b"".join(out))
    assert [(b.name, b.input) for b in final.content] == [("weather", {"city": "Oslo"}), ("clock", {})]
    assert final.stop_reason == "tool_use"


def test_text_then_tool_call_and_arguments_before_the_name() -> None:
    stream = MessagesStream("m")
    data = _run(stream, _delta({"content": "Let me check."}),
                _delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
                _delta({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "weather",
                                                                             "arguments": '"Rome"}'}}]}),
                _delta({}, "tool_calls"))
    final = _through_sdk(data)
    assert final.content[0].text == "Let me check."
    assert (final.content[1].id, final.content[1].name, final.content[1].input) == ("c1", "weather",
                                                                                    {"city": "Rome"})


def test_spaced_json_and_crlf() -> None:
    stream = MessagesStream("m")
    chunk = _sse({"choices": [{"index": 0, "delta": {"content": "a, b"}, "finish_reason": None}]}, spaced=True)
    assert b'"content": ' in chunk
    data = _run(stream, chunk.replace(b"\n", b"\r\n"), _sse({"choices": [{"index": 0, "delta": {},
                                                                             "finish_reason": "length"}]}, True))
    final = _through_sdk(data)
    assert final.content[0].text.replace(" ", "") == "a,b" and final.stop_reason == "max_tokens"


def test_usage_on_a_chunk_with_a_choice_and_cached_tokens() -> None:
    stream = MessagesStream("m")  # TabbyAPI: usage on the last chunk, which also has a choice
    last = _sse({"choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 50, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 32}}})
    events = _events(_run(stream, _delta({"content": "hi"}), last))
    delta = next(doc for name, doc in events if name == "message_delta")
    assert delta["usage"] == {"input_tokens": 18, "output_tokens": 2, "cache_read_input_tokens": 32}
    assert stream.usage is not None and stream.usage["prompt_tokens"] == 50


def test_stop_sequence_reported_by_the_engine() -> None:
    stream = MessagesStream("m", stop_sequences=["###"])
    events = _events(_run(stream, _delta({"content": "done"}), _delta({}, "stop", stop_reason="###")))
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}


def test_no_usage_in_the_stream() -> None:
    events = _events(_run(MessagesStream("m"), _delta({"content": "x"}), _delta({}, "stop")))
    assert events[-2][1]["usage"] == {"output_tokens": 0}


def test_error_event_mid_stream_ends_the_stream() -> None:
    stream = MessagesStream("m")
    error = _sse({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
    data = stream.feed(_delta({"content": "partial"}) + error + _delta({"content": "ignored"}))
    events = _events(data)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "engine died"}})
    assert "message_stop" not in [name for name, _ in events]
    assert stream.feed(_delta({"content": "more"})) == b""
    assert stream.close() == b""
    with pytest.raises(anthropic.APIStatusError, match="engine died") as raised:  # after a 200, as on Anthropic
        _through_sdk(data)
    assert raised.value.body == {"type": "error", "error": {"type": "api_error", "message": "engine died"}}


def test_error_event_type_by_code() -> None:
    stream = MessagesStream("m")
    data = stream.feed(_delta({"content": "x"}) + _sse({"error": {"message": "too long", "code": 400}}))
    assert _events(data)[-1][1]["error"]["type"] == "invalid_request_error"
    old_vllm = MessagesStream("m").feed(_sse({"object": "error", "message": "overloaded", "code": 503}))
    assert _events(old_vllm)[-1][1]["error"] == {"type": "overloaded_error", "message": "overloaded"}


def test_close_is_idempotent() -> None:
    stream = MessagesStream("m")
    stream.feed(_delta({"content": "x"}))
    closing = _events(stream.close())
    assert [name for name, _ in closing] == ["content_block_stop", "message_delta", "message_stop"]
    assert stream.close() == b""
    assert stream.close("late failure") == b""
    assert stream.feed(_delta({"content": "y"})) == b""


def test_close_with_error_before_any_chunk() -> None:
    stream = MessagesStream("m")
    events = _events(stream.close("connection refused"))
    assert events == [("error", {"type": "error", "error": {"type": "api_error", "message": "connection refused"}})]
    assert stream.close() == b""


def test_close_with_error_after_chunks_has_no_message_stop() -> None:
    stream = MessagesStream("m")
    stream.feed(_delta({"content": "x"}))
    events = _events(stream.close("upstream reset"))
    assert [name for name, _ in events] == ["error"]


def test_upstream_that_ends_with_nothing_gives_an_empty_message() -> None:
    data = MessagesStream("m").close()
    assert [name for name, _ in _events(data)] == ["message_start", "ping", "message_delta", "message_stop"]
    final = _through_sdk(data)
    assert final.content == [] and final.stop_reason == "end_turn"


def test_a_last_event_without_its_blank_line_is_flushed_by_close() -> None:
    stream = MessagesStream("m")
    data = stream.feed(_delta({"content": "a"}) + b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}')
    data += stream.close()
    assert _through_sdk(data).content[0].text == "ab"


def test_interleaved_tool_call_fragments_fail_the_stream() -> None:
    stream = MessagesStream("m")
    data = _run(stream, _delta({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f"}}]}),
                _delta({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g"}}]}),
                _delta({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}))
    assert _events(data)[-1][0] == "error"


def test_non_streamed_answer_through_the_sdk() -> None:
    chat = _chat({"content": "fine", "reasoning_content": "hmm", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}, "tool_calls")
    message = _through_sdk(orjson.dumps(chat_to_message(chat, "claude-local")), stream=False)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"a": 1} and message.stop_reason == "tool_use"


def test_arguments_before_a_name_are_kept_only_up_to_the_bound() -> None:
    """Sweep 13: an engine's endless arguments without the call's name were kept whole (5.5 GB RSS) and sent in
    one event at the end (the event loop held 15 s). Past MAX_EARLY_ARGUMENTS the stream ends with an error."""
    from gateway.api.translate.messages import MAX_EARLY_ARGUMENTS

    piece = _delta({"tool_calls": [{"index": 0, "function": {"arguments": "x" * 65536}}]})
    stream = MessagesStream("m")
    out = b"".join(stream.feed(piece) for _ in range(MAX_EARLY_ARGUMENTS // 65536))
    assert b"event: error" not in out  # (at the bound: still kept)
    out += stream.feed(piece) + stream.feed(piece) + stream.close()
    events = _events(out)
    assert [name for name, _ in events][-1] == "error" and "before its name" in events[-1][1]["error"]["message"]
    assert not any(name == "content_block_start" and doc["content_block"]["type"] == "tool_use"
                   for name, doc in events)  # (nothing of the call went out)


def test_tool_calls_are_bounded_in_number_and_their_indexes_are_integers() -> None:
    """Sweep 15: each finished call's index was kept, whatever JSON value it was: an engine's endless calls with
    a 1 MB string for an index grew the gateway ~100 MB/s; a list for an index raised inside the translation."""
    from gateway.api.translate.messages import MAX_CALLS

    def call(index: object) -> bytes:
        return _delta({"tool_calls": [{"index": index, "id": f"c{index}", "function": {"name": "f"}}]})

    stream = MessagesStream("m")
    out = b"".join(stream.feed(call(i)) for i in range(MAX_CALLS + 1))
    assert b"event: error" not in out  # (the last is open: MAX_CALLS finished)
    out += stream.feed(call(MAX_CALLS + 1))
    events = _events(out)
    assert events[-1][0] == "error" and "more than" in events[-1][1]["error"]["message"]
    for index in ([0], "0" * 100, 1.5):
        events = _events(MessagesStream("m").feed(call(index)))
        assert events[-1][0] == "error" and "not an integer" in events[-1][1]["error"]["message"], index
