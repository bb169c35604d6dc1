"""The agent APIs passed through to engines that serve them: how each API's own stream is measured and ended,
how a failure the gateway must report looks in it, and what its usage says in chat terms (for accounting).

An engine whose ``EngineSpec.native_apis`` names the API gets the client's request as it came (the gateway's
own fields taken out); the answer goes back byte for byte. Time to first token counts the first event that
carries generated output of any kind, as on chat streams.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.api.translate.count_tokens import input_tokens
from gateway.api.translate.messages import anthropic_error
from gateway.engines.readings import usage_figure, usage_tokens
from gateway.proxy.forward import NativeApi

# Anthropic: every content_block_delta carries one of these; message_stop is the last event
_MESSAGES_DELTA = re.compile(rb'"type"\s*:\s*"(?:text_delta|thinking_delta|input_json_delta)"')
_MESSAGES_END = re.compile(rb'"type"\s*:\s*"message_stop"')
# Responses: the delta events of text, reasoning and function-call arguments; the three terminal events
_RESPONSES_DELTA = re.compile(
    rb'"type"\s*:\s*"response\.(?:output_text|reasoning_text|reasoning_summary_text|function_call_arguments)'
    rb'\.delta"')
_RESPONSES_END = re.compile(rb'"type"\s*:\s*"response\.(?:completed|incomplete|failed)"')
_STATUS_BY_KIND = {"timeout_error": 504, "api_error": 502}


def _count(pattern: re.Pattern[bytes]) -> Any:
    def count(block: bytes) -> int:
        return len(pattern.findall(block))
    return count


def _messages_error(message: str, kind: str, code: str | None) -> bytes:
    return b"event: error\ndata: " + anthropic_error(_STATUS_BY_KIND.get(kind, 502), message) + b"\n\n"


def _responses_error(message: str, kind: str, code: str | None) -> bytes:
    event = {"type": "error", "code": code or kind, "message": message, "param": None, "sequence_number": 0}
    return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"


MESSAGES = NativeApi("/v1/messages", _count(_MESSAGES_DELTA), _MESSAGES_END, _messages_error)
COUNT_TOKENS = NativeApi("/v1/messages/count_tokens", _count(_MESSAGES_DELTA), _MESSAGES_END, _messages_error)
# count_tokens answered by an engine's tokenizing route (EngineSpec.chat_tokenize_path; the path is the engine's)
TOKENIZED_COUNT = NativeApi("", _count(_MESSAGES_DELTA), _MESSAGES_END, _messages_error, answer=input_tokens)
RESPONSES = NativeApi("/v1/responses", _count(_RESPONSES_DELTA), _RESPONSES_END, _responses_error)


def _int(value: Any) -> int:
    return usage_tokens(value)  # (never negative: accounting settles a key's budget with it)


def _optional(usage: dict[str, Any], key: str) -> int | None:
    """A figure the API may leave out or write null (Anthropic's cache figures): 0 then; garbage is None."""
    value = usage.get(key)
    return 0 if value is None else usage_figure(value)


def _sum(*figures: int | None) -> int | None:
    return None if None in figures else sum(f for f in figures if f is not None)


def chat_usage(api: str, usage: Any) -> dict[str, Any] | None:
    """An agent API's usage in chat completions' names (what accounting reads). Anthropic's input tokens
    exclude those read from (or written to) the cache; OpenAI's include them. A figure that is no reading
    (``readings.usage_figure``) leaves the prompt or completion count None, and the key is charged the gateway's
    own estimate (``gateway.api.proxy_endpoint``)."""
    if not isinstance(usage, dict):
        return None
    if api == "messages":
        cached = _optional(usage, "cache_read_input_tokens")
        prompt = _sum(usage_figure(usage.get("input_tokens")), cached,
                      _optional(usage, "cache_creation_input_tokens"))
    else:
        details = usage.get("input_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        prompt = usage_figure(usage.get("input_tokens"))
    completion = usage_figure(usage.get("output_tokens"))
    out: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": _sum(prompt, completion),
                           "prompt_tokens_details": {"cached_tokens": cached or 0}}
    details = usage.get("output_tokens_details")
    if isinstance(details, dict) and _int(details.get("reasoning_tokens")):
        out["completion_tokens_details"] = {"reasoning_tokens": _int(details["reasoning_tokens"])}
    return out


def _events(block: bytes) -> list[dict[str, Any]]:
    """The JSON data of each event in a block of whole events (the relay checked their framing)."""
    out = []
    for event in block.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    doc = orjson.loads(line[5:])
                except orjson.JSONDecodeError:
                    continue
                if isinstance(doc, dict):
                    out.append(doc)
    return out


# the usage figures of a Messages stream that chat_usage reads
MESSAGES_USAGE = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


class StreamTap:
    """Reads what an agent API's own stream says about usage (and, on Responses, the whole response at its
    end) on its way to the client; parses only the few events that can say it."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.usage: dict[str, Any] = {}
        self.response: dict[str, Any] | None = None
        self._started = False  # the stream's message_start was seen (only the first is completed)

    def feed(self, block: bytes) -> bytes:
        """Read ``block`` (whole events); returns what to relay: the block itself, but for a Messages
        ``message_start`` whose message lacks ``type`` or ``role`` (vLLM and SGLang dump it with
        ``exclude_unset``), which gets them: the Anthropic SDK builds its final message from that event, and
        without them its role is None, which the next request sending the conversation back is refused for."""
        if self.api == "messages":
            if block.find(b"message_start") < 0 and block.find(b"message_delta") < 0:
                return block
            # each event read once (a block of 2,000 message_start events, each completing the whole block
            # again, held the event loop 6 s: sweep 11); only the stream's first message_start is completed
            events = block.split(b"\n\n")
            changed = False
            for i, event in enumerate(events):
                if event.find(b"message_start") < 0 and event.find(b"message_delta") < 0:
                    continue
                doc = _event_doc(event)
                kind = doc.get("type") if doc is not None else None
                if doc is None:
                    continue
                if kind == "message_start" and isinstance(doc.get("message"), dict) and not self._started:
                    self._started = True
                    message = doc["message"]
                    usage = message.get("usage")
                    if "type" not in message or "role" not in message:
                        doc["message"] = {"id": message.get("id"), "type": "message", "role": "assistant", **message}
                        events[i] = b"event: message_start\ndata: " + orjson.dumps(doc)
                        changed = True
                elif kind == "message_delta":
                    usage = doc.get("usage")
                else:
                    continue
                if isinstance(usage, dict):  # (only what chat_usage reads: merging every key an engine's events
                    # carried grew without bound, 70 MB/s on a stream of new keys: sweep 16)
                    self.usage.update({k: usage[k] for k in MESSAGES_USAGE if usage.get(k) is not None})
            return b"\n\n".join(events) if changed else block
        if block.find(b"response.completed") < 0 and block.find(b"response.incomplete") < 0:
            return block
        for doc in _events(block):
            if doc.get("type") in ("response.completed", "response.incomplete") and isinstance(
                    doc.get("response"), dict):
                self.response = doc["response"]
                usage = self.response.get("usage")
                if isinstance(usage, dict):
                    self.usage = usage
        return block


def _event_doc(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one event's first ``data:`` line, or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                doc = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            return doc if isinstance(doc, dict) else None
    return None
