"""Agent API streams relayed as the engine sent them: generated output counted, the end found, usage read."""

from __future__ import annotations

import anthropic
import openai
import orjson
import pytest
from pydantic import TypeAdapter

from gateway.api.native_apis import MESSAGES, RESPONSES, StreamTap, chat_usage
from gateway.proxy.sse import SSERelay

pytestmark = pytest.mark.unit

# llama-server's own /v1/messages stream (spaced JSON as a Python server would write it, in the middle)
MESSAGES_STREAM = [
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
    b'"role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":11,"output_tokens":0}}}\n\n',
    b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    b'"content_block":{"type":"thinking","thinking":"","signature":""}}\n\n',
    b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
    b'"delta": {"type": "thinking_delta", "thinking": "hmm"}}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
    b'"content_block":{"type":"text","text":""}}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
    b'"delta":{"type":"text_delta","text":"Hi"}}\n\n',
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn",'
    b'"stop_sequence":null},"usage":{"output_tokens":2}}\n\n',
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
]

RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m",
            "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f",
                        "arguments": "{}", "status": "completed"}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12,
                      "input_tokens_details": {"cached_tokens": 8, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def _relay(api: object, stream: list[bytes]) -> tuple[SSERelay, int, bytes]:
    assert api is MESSAGES or api is RESPONSES
    relay = SSERelay(True, end=api.end)
    generated = 0
    out = b""
    for piece in stream:
        block = relay.feed(piece)
        generated += api.generated(block)
        out += block
    return relay, generated, out


def test_a_messages_stream_passes_unchanged_its_deltas_count_and_message_stop_ends_it() -> None:
    relay, generated, out = _relay(MESSAGES, MESSAGES_STREAM)
    assert out == b"".join(MESSAGES_STREAM)
    assert generated == 2  # the thinking delta (spaced JSON) and the text delta: not the empty block starts
    assert relay.done and relay.error is None
    relay, _, _ = _relay(MESSAGES, MESSAGES_STREAM[:-1])
    assert not relay.done  # cut before message_stop: the proxy reports it cut
    tap = StreamTap("messages")
    for piece in MESSAGES_STREAM:
        tap.feed(piece)
    assert chat_usage("messages", tap.usage) == {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13,
                                                 "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_messages_stream_keeps_only_the_usage_figures_it_reads_whatever_its_events_carry() -> None:
    """Sweep 16: the usage of every message_delta was merged whole, so a stream whose events each carried a
    thousand new usage keys grew the gateway by ~70 MB a second for as long as it lasted."""
    tap = StreamTap("messages")
    for i in range(200):
        usage = {f"k{i}_{j}": 1 for j in range(100)} | {"output_tokens": i + 1, "input_tokens": None}
        tap.feed(b"event: message_delta\ndata: " + orjson.dumps({"type": "message_delta", "delta": {},
                                                                  "usage": usage}) + b"\n\n")
    assert tap.usage == {"output_tokens": 200}


def test_a_responses_stream_counts_argument_deltas_and_ends_on_completed_with_its_usage_and_response() -> None:
    events = [
        {"type": "response.created", "sequence_number": 0, "response": {**RESPONSE, "status": "in_progress",
                                                                      "output": [], "usage": None}},
        {"type": "response.function_call_arguments.delta", "sequence_number": 1, "item_id": "fc_1",
         "output_index": 0, "delta": "{}"},
        {"type": "response.function_call_arguments.done", "sequence_number": 2, "item_id": "fc_1",
         "output_index": 0, "arguments": "{}", "name": "f"},
        {"type": "response.completed", "sequence_number": 3, "response": RESPONSE},
    ]
    adapter: TypeAdapter[object] = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    stream = []
    for event in events:
        adapter.validate_python(event)  # the shapes are the SDK's own
        stream.append(b"event: " + str(event["type"]).encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n")
    relay, generated, _ = _relay(RESPONSES, stream)
    assert generated == 1 and relay.done  # the .done event and the final response's arguments do not count
    tap = StreamTap("responses")
    for piece in stream:
        tap.feed(piece)
    assert tap.response == RESPONSE
    assert chat_usage("responses", tap.usage) == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                                                  "prompt_tokens_details": {"cached_tokens": 8}}


def test_anthropic_input_tokens_exclude_the_cache_and_chat_prompt_tokens_include_it() -> None:
    usage = {"input_tokens": 5, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 20,
             "output_tokens": 7}
    assert chat_usage("messages", usage) == {"prompt_tokens": 125, "completion_tokens": 7, "total_tokens": 132,
                                             "prompt_tokens_details": {"cached_tokens": 100}}
    assert chat_usage("messages", None) is None


def test_an_agent_apis_usage_figure_that_is_no_count_leaves_its_chat_figure_unread() -> None:
    """Held to zero, ``input_tokens: "12"`` became a reading of 0 prompt tokens, charged as such; unread, the key
    is charged the gateway's estimate (tests/proxy/test_garbage_usage.py). A cache figure left out or null is 0."""
    assert chat_usage("messages", {"input_tokens": "12", "output_tokens": 7})["prompt_tokens"] is None
    assert chat_usage("messages", {"input_tokens": 5, "cache_read_input_tokens": -3, "output_tokens": 7})[
        "prompt_tokens"] is None
    usage = {"input_tokens": 5, "cache_creation_input_tokens": None, "output_tokens": 1.5}
    assert chat_usage("messages", usage) == {"prompt_tokens": 5, "completion_tokens": None, "total_tokens": None,
                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert chat_usage("responses", {"input_tokens": True, "output_tokens": 1 << 40})["total_tokens"] is None


def test_the_gateways_own_error_events_are_in_each_apis_shape() -> None:
    event = MESSAGES.error_event("backend a: read timed out", "timeout_error", "timeout")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    doc = TypeAdapter(anthropic.types.RawMessageStreamEvent | anthropic.types.ErrorResponse).validate_json(
        event.split(b"data: ", 1)[1])
    assert doc.type == "error" and doc.error.type == "timeout_error"  # type: ignore[union-attr]
    event = RESPONSES.error_event("backend a: cut", "api_error", "upstream_failed")
    parsed = TypeAdapter(openai.types.responses.ResponseStreamEvent).validate_json(event.split(b"data: ", 1)[1])
    assert parsed.type == "error" and parsed.code == "upstream_failed"  # type: ignore[union-attr]
