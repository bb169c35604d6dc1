"""The Responses API <-> chat completions translation: requests, answers, and stream events.

Every Response is validated with the SDK's ``Response`` model and every stream event with its
``ResponseStreamEvent`` type; one stream is also read by the real SDK client (``responses.stream``) through an
``httpx.MockTransport``, so its accumulator checks the event order and item identities."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.api.translate.responses import (
    ResponsesStream,
    chat_to_response,
    input_messages,
    new_response_id,
    output_messages,
    responses_to_chat,
)
from gateway.api.translate.responses_tools import omitted
from gateway.errors import GatewayError

pytestmark = pytest.mark.unit

_EVENT = TypeAdapter(ResponseStreamEvent)
_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# ---- requests ----------------------------------------------------------------------------------------------

def test_string_input_becomes_one_user_message_and_settings_map() -> None:
    chat = responses_to_chat({"model": "m", "input": "hi", "instructions": "be brief", "max_output_tokens": 50,
                              "temperature": 0.2, "top_p": 0.9, "store": True, "metadata": {"k": "v"},
                              "reasoning": {"effort": "low", "summary": "auto"}, "safety_identifier": "u1",
                              "truncation": "disabled", "prompt_cache_key": "conv-1"})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}],
                    "max_tokens": 50, "temperature": 0.2, "top_p": 0.9, "reasoning_effort": "low", "user": "u1"}


def test_stream_asks_for_usage() -> None:
    chat = responses_to_chat({"model": "m", "input": "hi", "stream": True})
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "stream" not in responses_to_chat({"model": "m", "input": "hi", "stream": False})


def test_function_call_round_trip_items() -> None:
    body = {"model": "m", "input": [
        {"role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "cold"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "warm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Oslo cold",
                                                               "annotations": []}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"},
        {"role": "user", "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "x"},
                                     {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]},
    ], "tools": [{"type": "function", "name": "weather", "parameters": _WEATHER, "strict": True}],
        "tool_choice": {"type": "function", "name": "weather"}, "parallel_tool_calls": True}
    chat = responses_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "use tools"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
        {"role": "assistant", "content": "Oslo cold"},
        {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "x"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png",
                                                                         "detail": "low"}}]},
    ]
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": _WEATHER,
                                                               "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert chat["parallel_tool_calls"] is True
    assert input_messages(body) == chat["messages"]


def test_history_goes_between_instructions_and_input_and_instructions_are_not_kept() -> None:
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"}]
    body = {"model": "m", "input": "second", "instructions": "sys", "previous_response_id": "resp_x"}
    chat = responses_to_chat(body, history)
    assert chat["messages"] == [{"role": "system", "content": "sys"}, *history,
                                {"role": "user", "content": "second"}]
    assert "previous_response_id" not in chat and "store" not in chat
    assert input_messages(body) == [{"role": "user", "content": "second"}]
    assert history == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"}]


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "json_schema", "name": "w", "schema": _WEATHER, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "w", "schema": _WEATHER, "strict": True}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, None),
])
def test_text_format(fmt: dict[str, Any], expected: dict[str, Any] | None) -> None:
    chat = responses_to_chat({"model": "m", "input": "x", "text": {"format": fmt}})
    assert chat.get("response_format") == expected


def test_logprobs_map() -> None:
    chat = responses_to_chat({"model": "m", "input": "x", "top_logprobs": 3,
                              "include": ["message.output_text.logprobs", "reasoning.encrypted_content"]})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0]", "unsupported_field"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}, "output_schema": {}}]}, "tools[0].output_schema",
     "unsupported_field"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "unsupported_field"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content", "unsupported_field"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content", "unsupported_field"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "unsupported_field"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"input": 3}, "input", "invalid_value"),
    ({"truncation": "auto"}, "truncation", "unsupported_field"),
    ({"background": True}, "background", "unsupported_field"),
    ({"conversation": "conv_1"}, "conversation", "unsupported_field"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_field"),
    ({"service_tier": "flex"}, "service_tier", "unsupported_field"),
    ({"include": ["nonsense"]}, "include", "invalid_value"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary", "unsupported_field"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unsupported_field"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format", "unsupported_field"),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options", "unsupported_field"),
    ({"frobnicate": 1}, "frobnicate", "unsupported_field"),
])
def test_what_cannot_be_honoured_is_refused_naming_its_param(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(GatewayError) as caught:
        responses_to_chat({"model": "m", "input": "x", **body})
    assert (caught.value.status, caught.value.type) == (400, "invalid_request_error")
    assert (caught.value.param, caught.value.code) == (param, code)


def test_sampling_extensions_pass_through() -> None:
    chat = responses_to_chat({"model": "m", "input": "x", "top_k": 20, "seed": 7, "stop": ["\n"]})
    assert (chat["top_k"], chat["seed"], chat["stop"]) == (20, 7, ["\n"])


# ---- non-streamed answers ----------------------------------------------------------------------------------

_USAGE = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
          "prompt_tokens_details": {"cached_tokens": 4}, "completion_tokens_details": {"reasoning_tokens": 2}}


def _chat(message: dict[str, Any], finish: str = "stop", usage: dict[str, Any] | None = _USAGE) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
            "usage": usage}


_REQUEST = {"model": "m", "input": "hi", "instructions": "sys", "max_output_tokens": 64, "metadata": {"a": "b"},
            "tools": [{"type": "function", "name": "weather", "parameters": _WEATHER}],
            "text": {"format": {"type": "json_schema", "name": "w", "schema": _WEATHER}},
            "previous_response_id": "resp_prev", "store": False}


def test_text_answer() -> None:
    response = chat_to_response(_chat({"content": "Hello"}), _REQUEST, "resp_1")
    parsed = Response.model_validate(response)
    assert parsed.id == "resp_1" and parsed.status == "completed" and parsed.output_text == "Hello"
    assert parsed.instructions == "sys" and parsed.max_output_tokens == 64 and parsed.metadata == {"a": "b"}
    assert parsed.previous_response_id == "resp_prev" and response["store"] is False
    assert parsed.tools[0].type == "function" and parsed.tools[0].name == "weather"
    assert parsed.usage is not None
    assert parsed.usage.input_tokens == 10 and parsed.usage.input_tokens_details.cached_tokens == 4
    assert parsed.usage.output_tokens == 5 and parsed.usage.output_tokens_details.reasoning_tokens == 2
    assert parsed.usage.total_tokens == 15
    assert output_messages(response) == [{"role": "assistant", "content": "Hello"}]


def test_reasoning_then_text() -> None:
    response = chat_to_response(_chat({"reasoning_content": "think", "content": "42"}), _REQUEST, "resp_1")
    parsed = Response.model_validate(response)
    assert [item.type for item in parsed.output] == ["reasoning", "message"]
    reasoning = parsed.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == "think"
    assert output_messages(response) == [{"role": "assistant", "content": "42", "reasoning_content": "think"}]
    # vLLM's newer field name
    vllm = chat_to_response(_chat({"reasoning": "think", "content": "42"}), _REQUEST, "resp_1")
    assert vllm["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def test_tool_calls() -> None:
    calls = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
             {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]
    response = chat_to_response(_chat({"content": None, "tool_calls": calls}, "tool_calls"), _REQUEST, "resp_1")
    parsed = Response.model_validate(response)
    assert parsed.status == "completed"
    assert [(i.type, i.call_id, i.name, i.arguments, i.status) for i in parsed.output if i.type == "function_call"] \
        == [("function_call", "call_a", "weather", '{"city":"Oslo"}', "completed"),
            ("function_call", "call_b", "weather", '{"city":"Rome"}', "completed")]
    assert all(item["id"].startswith("fc_") for item in response["output"])
    assert output_messages(response) == [{"role": "assistant", "content": None, "tool_calls": calls}]


def test_length_is_incomplete() -> None:
    response = chat_to_response(_chat({"content": "Hel"}, "length"), _REQUEST, "resp_1")
    parsed = Response.model_validate(response)
    assert parsed.status == "incomplete" and parsed.incomplete_details is not None
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output[0].status == "incomplete"


def test_answer_without_usage_or_content_is_still_a_valid_response() -> None:
    request = {"model": "m", "input": "x", "tool_choice": None, "parallel_tool_calls": None, "text": None}
    response = chat_to_response(_chat({"content": None}, usage=None), request, "resp_1")
    parsed = Response.model_validate(response)
    assert parsed.usage is None and parsed.output_text == "" and parsed.tool_choice == "auto"


def test_output_messages_of_a_native_response() -> None:
    native = {"output": [
        {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "id": "m", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "a", "annotations": []}, {"type": "refusal", "refusal": "b"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "web_search_call", "id": "ws", "status": "completed"},
    ]}
    assert output_messages(native) == [{"role": "assistant", "content": "ab", "reasoning_content": "r",
                                        "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]}]
    assert output_messages({"output": []}) == []


# ---- streams -----------------------------------------------------------------------------------------------

def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, spaced: bool = False,
           **extra: Any) -> bytes:
    doc: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                           "choices": [] if delta is None else [{"index": 0, "delta": delta,
                                                                  "finish_reason": finish}], **extra}
    if spaced:  # how Python servers (vLLM, SGLang, TabbyAPI) write JSON
        return b"data: " + json.dumps(doc).encode() + b"\n\n"
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _call(index: int, id_: str | None = None, name: str | None = None, arguments: str | None = None) -> bytes:
    function = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}
    call: dict[str, Any] = {"index": index, "function": function}
    if id_:
        call.update(id=id_, type="function")
    return _chunk({"tool_calls": [call]}, spaced=True)


class _Reader:
    """Parses and validates what a stream sends; checks sequence numbers run from 0 without a gap."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.raw = b""

    def read(self, out: bytes) -> list[dict[str, Any]]:
        self.raw += out
        new = []
        for block in out.split(b"\n\n")[:-1]:
            name, data = block.split(b"\n")
            assert name.startswith(b"event: ") and data.startswith(b"data: ")
            event = orjson.loads(data[6:])
            assert event["type"] == name[7:].decode()
            assert event["sequence_number"] == len(self.events)
            _EVENT.validate_python(event)
            self.events.append(event)
            new.append(event)
        return new

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]


def _run(chunks: list[bytes], request: dict[str, Any] | None = None) -> tuple[ResponsesStream, _Reader]:
    stream = ResponsesStream(request or {"model": "m", "input": "x", "stream": True}, "resp_1")
    reader = _Reader()
    for chunk in chunks:
        reader.read(stream.feed(chunk))
    reader.read(stream.close())
    return stream, reader


def test_stream_text() -> None:
    stream, reader = _run([_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}),
                           _chunk({"content": "lo"}, spaced=True), _chunk({}, "stop"),
                           _chunk(usage=_USAGE), b"data: [DONE]\n\n"])
    assert reader.types() == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in reader.events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = Response.model_validate(reader.events[-1]["response"])
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage is not None and final.usage.input_tokens == 10 and final.usage.output_tokens == 5
    assert stream.usage == _USAGE and stream.response == reader.events[-1]["response"]
    assert reader.events[0]["response"]["status"] == "in_progress"


def test_nothing_is_sent_before_the_first_chunk() -> None:
    stream = ResponsesStream({"model": "m", "input": "x"}, "resp_1")
    assert stream.feed(b": ping\n\n") == b""
    assert stream.response is None
    assert b"response.created" in stream.feed(_chunk({"role": "assistant"}))


def test_stream_reasoning_then_text_with_several_events_per_feed() -> None:
    stream, reader = _run([
        _chunk({"role": "assistant"}) + _chunk({"reasoning_content": "hm"}) + _chunk({"reasoning": "m"}),
        _chunk({"content": "4"}) + _chunk({"content": "2"}, "stop") + _chunk(usage=_USAGE) + b"data: [DONE]\n\n",
    ])
    assert reader.types() == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    done = [e for e in reader.events if e["type"] == "response.reasoning_text.done"]
    assert done[0]["text"] == "hmm" and done[0]["output_index"] == 0
    assert stream.response is not None
    assert output_messages(stream.response) == [{"role": "assistant", "content": "42", "reasoning_content": "hmm"}]


def test_stream_tool_calls_in_fragments_over_several_feeds() -> None:
    raw = b"".join([
        _chunk({"role": "assistant", "content": None}, spaced=True),
        _call(0, "call_a", "weather", ""), _call(0, arguments='{"ci'), _call(0, arguments='ty": "Oslo"}'),
        _call(1, "call_b", "weather", '{"city"'), _call(1, arguments=': "Rome"}'),
        _chunk({}, "tool_calls", spaced=True), _chunk(usage=_USAGE, spaced=True), b"data: [DONE]\n\n",
    ])
    pieces = [raw[:70], raw[70:200], raw[200:201], raw[201:450], raw[450:]]  # cut anywhere, even mid-event
    stream, reader = _run(pieces)
    assert reader.types() == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = [e for e in reader.events if e["type"] == "response.function_call_arguments.done"]
    assert [e["arguments"] for e in done] == ['{"city": "Oslo"}', '{"city": "Rome"}']
    final = Response.model_validate(reader.events[-1]["response"])
    assert [(i.type, i.call_id, i.status) for i in final.output] == [("function_call", "call_a", "completed"),
                                                                    ("function_call", "call_b", "completed")]
    assert stream.usage == _USAGE


def test_stream_cut_by_length_is_incomplete() -> None:
    _, reader = _run([_chunk({"content": "Hel"}), _chunk({}, "length"), b"data: [DONE]\n\n"])
    assert reader.types()[-1] == "response.incomplete"
    final = reader.events[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_tabbyapi_usage_on_a_chunk_with_a_choice_is_consumed() -> None:
    _, reader = _run([b"data: {\"choices\": [{\"index\": 0, \"delta\": {\"content\": \"ok\"}, "
                           b"\"finish_reason\": \"stop\"}], \"usage\": {\"prompt_tokens\": 3, "
                           b"\"completion_tokens\": 1, \"total_tokens\": 4}}\r\n\r\ndata: [DONE]\r\n\r\n"])
    final = Response.model_validate(reader.events[-1]["response"])
    assert final.output_text == "ok" and final.usage is not None and final.usage.total_tokens == 4


def test_error_mid_stream_fails_the_response_and_close_is_idempotent() -> None:
    stream = ResponsesStream({"model": "m", "input": "x"}, "resp_1")
    reader = _Reader()
    reader.read(stream.feed(_chunk({"content": "Hel"})))
    error = b'data: {"error": {"message": "backend b1: boom", "type": "api_error", "code": "upstream_failed"}}\n\n'
    reader.read(stream.feed(error + b"data: [DONE]\n\n"))
    assert reader.types()[-1] == "response.failed"
    failed = reader.events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "backend b1: boom"}
    assert stream.response == failed
    assert stream.feed(_chunk({"content": "more"})) == b"" and stream.close() == b"" and stream.close("x") == b""


def test_close_with_an_error_before_anything_still_makes_a_well_formed_stream() -> None:
    stream = ResponsesStream({"model": "m", "input": "x"}, "resp_1")
    reader = _Reader()
    reader.read(stream.close("the backend went away"))
    assert reader.types() == ["response.created", "response.in_progress", "response.failed"]
    assert stream.close() == b""


def test_close_is_idempotent_after_completion() -> None:
    stream, reader = _run([_chunk({"content": "a"}, "stop")])
    assert reader.types()[-1] == "response.completed"
    assert stream.close() == b"" and stream.close("late") == b""


def test_stream_logprobs() -> None:
    logprobs = {"content": [{"token": "a", "logprob": -0.1, "bytes": [97],
                             "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}]}
    request = {"model": "m", "input": "x", "top_logprobs": 1}
    _, reader = _run([_chunk({"content": "a"}, "stop", logprobs=None)[:-2].replace(
        b'"finish_reason":"stop"}', b'"finish_reason":"stop","logprobs":' + orjson.dumps(logprobs) + b"}") + b"\n\n"],
        request)
    delta = next(e for e in reader.events if e["type"] == "response.output_text.delta")
    assert delta["logprobs"] == [{"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1}]}]
    final = Response.model_validate(reader.events[-1]["response"])
    part = final.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None and part.logprobs[0].bytes == [97]


def test_the_sdk_client_reads_the_translated_stream() -> None:
    request = {"model": "m", "input": "x", "stream": True,
               "tools": [{"type": "function", "name": "weather", "parameters": _WEATHER, "strict": False}]}
    stream = ResponsesStream(request, "resp_1")
    body = b"".join([
        stream.feed(_chunk({"reasoning_content": "hmm"}) + _chunk({"content": "Let me look."})),
        stream.feed(_call(0, "call_a", "weather", '{"city": ') + _call(0, arguments='"Oslo"}')),
        stream.feed(_chunk({}, "tool_calls") + _chunk(usage=_USAGE) + b"data: [DONE]\n\n"),
        stream.close(),
    ])

    def answer(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    client = openai.OpenAI(api_key="k", base_url="http://gateway/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(answer)))
    with client.responses.stream(model="m", input="x", tools=request["tools"]) as events:
        texts = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert texts == ["Let me look."]
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Let me look." and final.usage is not None and final.usage.total_tokens == 15


def test_new_response_ids_are_random_and_well_formed() -> None:
    ids = {new_response_id() for _ in range(3)}
    assert len(ids) == 3
    assert all(i.startswith("resp_") and len(i) == 53 and int(i[5:], 16) >= 0 for i in ids)


# ---- what Codex sends by default (issue 42) ----------------------------------------------------------------

_CODEX_TOOLS = [
    {"type": "function", "name": "shell", "parameters": _WEATHER, "strict": False},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents",
     "tools": [{"type": "function", "name": "spawn_agent", "parameters": _WEATHER, "strict": False},
               {"type": "function", "name": "shell", "parameters": _WEATHER, "defer_loading": True}]},
]


def test_bookkeeping_fields_are_accepted_and_not_sent_on() -> None:
    """Codex sends ``client_metadata`` (its session and turn ids) with every request: it was a 400."""
    body = {"model": "m", "input": "hi", "client_metadata": {"session_id": "s1", "turn_id": "t1"},
            "metadata": {"a": "b"}, "prompt_cache_key": "k", "prompt_cache_retention": "24h", "max_tool_calls": 3}
    chat = responses_to_chat(body)
    assert set(chat) == {"model", "messages"}
    assert chat_to_response(_chat({"content": "ok"}), body, "resp_1")["metadata"] == {"a": "b"}


def test_a_field_that_cannot_be_honoured_is_refused_naming_it_and_how_to_avoid_it() -> None:
    with pytest.raises(GatewayError) as refused:
        responses_to_chat({"model": "m", "input": "hi", "frobnicate": {"x": 1}})
    assert refused.value.param == "frobnicate" and "leave it out" in refused.value.message
    with pytest.raises(GatewayError) as refused:
        responses_to_chat({"model": "m", "input": "hi", "truncation": "auto"})
    assert refused.value.param == "truncation" and "'disabled'" in refused.value.message


def test_a_namespace_of_function_tools_is_offered_flat_under_qualified_names() -> None:
    chat = responses_to_chat({"model": "m", "input": "hi", "tools": _CODEX_TOOLS})
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "shell", "multi_agent_v1__spawn_agent", "multi_agent_v1__shell"]
    assert chat["tools"][1]["function"] == {"name": "multi_agent_v1__spawn_agent", "parameters": _WEATHER,
                                            "strict": False}


def test_a_qualified_name_colliding_with_another_tool_is_refused_naming_both() -> None:
    tools = [*_CODEX_TOOLS, {"type": "function", "name": "multi_agent_v1__spawn_agent", "parameters": _WEATHER}]
    with pytest.raises(GatewayError) as refused:
        responses_to_chat({"model": "m", "input": "hi", "tools": tools})
    assert refused.value.param == "tools[2].name" and "tools[1].tools[0]" in refused.value.message


def test_a_call_of_a_namespaced_tool_comes_back_in_the_namespace_form() -> None:
    request = {"model": "m", "input": "hi", "tools": _CODEX_TOOLS}
    calls = [{"id": "call_a", "type": "function",
              "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"city":"Oslo"}'}},
             {"id": "call_b", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]
    response = chat_to_response(_chat({"content": None, "tool_calls": calls}, "tool_calls"), request, "resp_1")
    parsed = Response.model_validate(response)
    assert [(i.name, i.namespace) for i in parsed.output if i.type == "function_call"] == [
        ("spawn_agent", "multi_agent_v1"), ("shell", None)]
    assert parsed.tools[1].type == "namespace"
    # kept (and sent back by a stateless client) as the name the model was offered
    assert output_messages(response)[0]["tool_calls"] == calls
    sent_back = [{"type": "function_call", "call_id": "call_a", "name": "spawn_agent", "namespace": "multi_agent_v1",
                  "arguments": "{}"}, {"type": "function_call_output", "call_id": "call_a", "output": "done"}]
    assert input_messages({"input": sent_back})[0]["tool_calls"][0]["function"]["name"] == \
        "multi_agent_v1__spawn_agent"


def test_a_streamed_call_of_a_namespaced_tool_comes_back_in_the_namespace_form() -> None:
    request = {"model": "m", "input": "x", "stream": True, "tools": _CODEX_TOOLS}
    _, reader = _run([_call(0, "call_a", "multi_agent_v1__spawn_agent", '{"city":'), _call(0, arguments='"Oslo"}'),
                      _chunk({}, "tool_calls"), b"data: [DONE]\n\n"], request)
    items = [e["item"] for e in reader.events if e["type"] in ("response.output_item.added",
                                                                "response.output_item.done")]
    assert [(i["name"], i["namespace"]) for i in items] == [("spawn_agent", "multi_agent_v1")] * 2
    final = Response.model_validate(reader.events[-1]["response"])
    assert (final.output[0].name, final.output[0].namespace) == ("spawn_agent", "multi_agent_v1")


def test_web_search_is_left_out_rather_than_refused_and_other_built_in_tools_are_refused() -> None:
    """Codex sends web_search by default, and every request of its was refused (issue 42): a search the model
    may leave unused is not offered (the client hears so: agent_apis, x-gateway-tools-omitted); a tool the
    client asked to run, or a tool_choice forcing a search, is still refused."""
    chat = responses_to_chat({"model": "m", "input": "hi", "tools": [*_CODEX_TOOLS, {"type": "web_search"},
                                                                    {"type": "web_search_preview_2025_03_11"}]})
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "multi_agent_v1__spawn_agent",
                                                              "multi_agent_v1__shell"]
    alone = responses_to_chat({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]})
    assert "tools" not in alone and "tool_choice" not in alone
    assert omitted([{"type": "web_search"}, {"type": "function", "name": "f"}, {"type": "web_search"}]) == [
        "web_search"]
    for tools, choice, param in (([{"type": "file_search", "vector_store_ids": ["v"]}], "auto", "tools[0]"),
                                 # (a type is matched whole: one with a line break is no web_search, sweep 9)
                                 ([{"type": "web_search_2\r\nx: y"}], "auto", "tools[0]"),
                                 ([{"type": "web_search"}], {"type": "web_search"}, "tool_choice"),
                                 ([{"type": "web_search"}], "required", "tool_choice")):
        with pytest.raises(GatewayError) as refused:
            responses_to_chat({"model": "m", "input": "hi", "tools": tools, "tool_choice": choice})
        assert refused.value.param == param


@pytest.mark.parametrize("field", ["content", "reasoning_content", "arguments"])
def test_a_stream_keeps_at_most_the_bound_for_its_closing_events(field: str) -> None:
    """Sweep 13: an engine's endless stream of ordinary chunks was kept whole and written out four times at its
    end (400 MB: the event loop held 13.6 s, 10.8 GB RSS). Past MAX_KEPT_CHARS the response fails, at once."""
    from gateway.api.translate.responses import KEPT_PER_ITEM, MAX_KEPT_CHARS

    text = "x" * 65536
    piece = _call(0, "c1", "f", text) if field == "arguments" else _chunk({field: text})
    stream = ResponsesStream({"model": "m", "input": "x", "stream": True}, "resp_1")
    reader = _Reader()
    for _ in range((MAX_KEPT_CHARS - KEPT_PER_ITEM) // len(text)):  # (its one item counts too)
        reader.read(stream.feed(piece))
    assert "response.failed" not in reader.types()  # (at the bound: still kept)
    reader.read(stream.feed(piece))
    assert reader.types()[-1] == "response.failed"
    assert "longer than the gateway translates" in reader.events[-1]["response"]["error"]["message"]
    assert stream.feed(piece) == b"" and stream.close() == b""  # (ended: nothing more is kept or sent)


def test_logprobs_count_toward_what_a_stream_keeps() -> None:
    """Each one-token chunk's logprob entries are kept for output_text.done too."""
    from gateway.api.translate.responses import KEPT_PER_LOGPROB, MAX_KEPT_CHARS

    entry = {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [{"token": "b", "logprob": -2.0}] * 19}
    doc = orjson.loads(_chunk({"content": "a"})[6:])
    doc["choices"][0]["logprobs"] = {"content": [entry] * 100}
    piece = b"data: " + orjson.dumps(doc) + b"\n\n"
    stream = ResponsesStream({"model": "m", "input": "x", "stream": True, "top_logprobs": 19}, "resp_1")
    reader = _Reader()
    per_piece = 1 + KEPT_PER_LOGPROB * 100 * 20
    for _ in range(MAX_KEPT_CHARS // per_piece + 1):
        reader.read(stream.feed(piece))
    assert reader.types()[-1] == "response.failed"


@pytest.mark.parametrize("shape", ["calls", "alternating"])
def test_a_stream_has_at_most_the_bound_of_output_items(shape: str) -> None:
    """Sweep 14: items were not counted: a hostile engine's parallel tool calls with a name and no arguments (100
    to a 7 KB chunk, 3M in all) grew the gateway 75 MB/s and held the loop 4 s when the response closed; chunks
    alternating reasoning and text did the same at one character an item."""
    from gateway.api.translate.responses import MAX_ITEMS

    def piece(i: int) -> bytes:
        if shape == "calls":
            return _call(i, f"c{i}", "f")
        return _chunk({"reasoning_content": "a"} if i % 2 else {"content": "b"})

    stream = ResponsesStream({"model": "m", "input": "x", "stream": True}, "resp_1")
    reader = _Reader()
    for i in range(MAX_ITEMS):
        reader.read(stream.feed(piece(i)))
    assert "response.failed" not in reader.types()  # (at the bound: still translated)
    reader.read(stream.feed(piece(MAX_ITEMS)))
    assert reader.types()[-1] == "response.failed"
    assert "output items" in reader.events[-1]["response"]["error"]["message"]



def test_tool_names_and_ids_count_toward_what_a_stream_keeps_and_indexes_are_integers() -> None:
    """Sweep 15: names and call ids were kept uncounted: 1,000 calls named with 1 MB each made a 1 GB closing
    event (the loop held 9.5 s); and a call whose index was a list raised inside the translation."""
    from gateway.api.translate.responses import MAX_KEPT_CHARS

    stream = ResponsesStream({"model": "m", "input": "x", "stream": True}, "resp_1")
    reader = _Reader()
    reader.read(stream.feed(_call(0, "c0", "n" * (MAX_KEPT_CHARS // 2))))
    assert "response.failed" not in reader.types()
    reader.read(stream.feed(_call(1, "c1", "n" * (MAX_KEPT_CHARS // 2))))
    assert reader.types()[-1] == "response.failed"
    for index in ([0], "0", 1.5):
        stream = ResponsesStream({"model": "m", "input": "x", "stream": True}, "resp_1")
        reader = _Reader()
        reader.read(stream.feed(_chunk({"tool_calls": [{"index": index, "function": {"name": "f"}}]})))
        assert reader.types()[-1] == "response.failed", index
        assert "not an integer" in reader.events[-1]["response"]["error"]["message"]
