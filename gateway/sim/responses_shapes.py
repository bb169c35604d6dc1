"""``/v1/responses`` bodies and typed stream events, in two engines' shapes.

``"llamacpp"`` follows llama.cpp ``tools/server/server-task.cpp`` (``to_json_oaicompat_resp*``): terse items and
events (no ``sequence_number`` / ``output_index``), ``response.created`` and ``response.in_progress`` with the
first token, a function call's ``call_id`` is ``"fc_" + <tool call id>`` and it has no ``id``, the closing
``*.done`` events all come at the end, no ``function_call_arguments.done``, usage without details.
``"openai"`` is the full OpenAI Responses shape vLLM (``vllm/entrypoints/openai/responses``) and SGLang send:
every event numbered, items opened and closed in turn, reasoning as ``response.reasoning_text.*``, usage with
``input_tokens_details.cached_tokens`` and ``output_tokens_details.reasoning_tokens``, a length cut reported as
status ``incomplete``. Neither sends ``[DONE]``; every event is ``event: <type>\\ndata: <json>\\n\\n``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from gateway.sim.engines.base import Gen, new_id


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class ResponseShape:
    """One response: its item ids, the stream writer (``head`` / ``token`` / ``tail``) and the final body."""

    def __init__(self, flavor: str, gen: Gen, body: dict[str, Any], cache_report: bool) -> None:
        self.flavor = flavor
        self.gen = gen
        self.body = body
        self.cache_report = cache_report
        self.terse = flavor == "llamacpp"
        rand = secrets.token_hex(12)
        self.rs_id, self.msg_id = "rs_" + rand, "msg_" + rand
        self.fc_id = "fc_" + gen.tool_id if self.terse else new_id("fc_")
        self.call_id = "fc_" + gen.tool_id if self.terse else new_id("call_")
        self.created = int(time.time())
        self.seq_no = 0

    # -- items -------------------------------------------------------------------------------------------------
    def usage(self) -> dict[str, Any]:
        g = self.gen
        u: dict[str, Any] = {"input_tokens": g.prompt_len, "output_tokens": g.completion_tokens,
                             "total_tokens": g.prompt_len + g.completion_tokens}
        if not self.terse:
            u["input_tokens_details"] = {"cached_tokens": g.cached if self.cache_report else 0}
            u["output_tokens_details"] = {"reasoning_tokens": g.reasoning_tokens}
        return u

    def reasoning_item(self, text: str, done: bool) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if done else []
        item = {"id": self.rs_id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": "" if self.terse else None}
        if not (self.terse and done):  # llama.cpp's streamed done item has no status
            item["status"] = "completed" if done else "in_progress"
        return item

    def text_part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def message_item(self, text: str | None) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "role": "assistant",
                "status": "in_progress" if text is None else "completed",
                "content": [] if text is None else [self.text_part(text)]}

    def call_item(self, arguments: str, done: bool) -> dict[str, Any]:
        assert self.gen.tool is not None
        item: dict[str, Any] = {"type": "function_call", "call_id": self.call_id, "name": self.gen.tool.name,
                                "arguments": arguments, "status": "completed" if done else "in_progress"}
        if not self.terse:
            item["id"] = self.fc_id
        return item

    def output(self) -> list[dict[str, Any]]:
        g, out = self.gen, []
        if g.reasoning_text:
            out.append(self.reasoning_item(g.reasoning_text, True))
        if g.tool is not None:
            if g.completion_tokens > g.plan.reasoning:
                out.append(self.call_item(g.text, True))
        elif g.text:
            out.append(self.message_item(g.text))
        return out

    def response(self, status: str) -> dict[str, Any]:
        """The response object: ``"in_progress"`` (stream start) or ``"completed"`` (its end, or the body)."""
        g = self.gen
        done = status == "completed"
        if done and not self.terse and g.finish_reason == "length":
            status = "incomplete"
        if self.terse:
            body: dict[str, Any] = {"id": g.id, "object": "response", "created_at": self.created, "status": status,
                                    "model": g.model, "output": self.output() if done else []}
            if done:
                body["usage"] = self.usage()
                if not g.stream:
                    body["completed_at"] = int(time.time())
            return body
        b = self.body
        return {"id": g.id, "object": "response", "created_at": self.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "max_tool_calls": None, "metadata": b.get("metadata"), "model": g.model,
                "output": self.output() if done else [], "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "prompt": None, "reasoning": None,
                "service_tier": "auto", "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
                "text": b.get("text"), "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_logprobs": None, "top_p": b.get("top_p", 1.0), "truncation": "disabled",
                "usage": self.usage() if done else None, "user": None}

    # -- events ------------------------------------------------------------------------------------------------
    def ev(self, kind: str, output_index: int | None = None, **fields: Any) -> bytes:
        event: dict[str, Any] = {"type": kind, **fields}
        if not self.terse:
            event["sequence_number"] = self.seq_no
            self.seq_no += 1
            if output_index is not None:
                event["output_index"] = output_index
        return sse(event)

    def _start(self) -> bytes:
        head = {"id": self.gen.id, "object": "response", "status": "in_progress"}
        body = head if self.terse else self.response("in_progress")
        return self.ev("response.created", response=body) + self.ev("response.in_progress", response=body)

    def head(self) -> bytes:
        return b"" if self.terse else self._start()

    def token(self, index: int, piece: str) -> bytes:
        g = self.gen
        n_reason = g.plan.reasoning
        out = self._start() if self.terse and index == 0 else b""
        if index < n_reason:
            if index == 0:
                out += self.ev("response.output_item.added", 0, item=self.reasoning_item("", False))
            extra: dict[str, Any] = {} if self.terse else {"content_index": 0}
            return out + self.ev("response.reasoning_text.delta", 0, item_id=self.rs_id, delta=piece, **extra)
        pos = 1 if n_reason else 0
        if index == n_reason and not self.terse and n_reason:
            out += self._close_reasoning()
        if g.tool is not None:
            if index == n_reason:
                out += self.ev("response.output_item.added", pos, item=self.call_item("", False))
            return out + self.ev("response.function_call_arguments.delta", pos, item_id=self.fc_id, delta=piece)
        if index == n_reason:
            out += self.ev("response.output_item.added", pos, item=self.message_item(None))
            part = {"type": "output_text", "text": ""} if self.terse else self.text_part("")
            extra = {} if self.terse else {"content_index": 0}
            out += self.ev("response.content_part.added", pos, item_id=self.msg_id, part=part, **extra)
        extra = {} if self.terse else {"content_index": 0, "logprobs": []}
        return out + self.ev("response.output_text.delta", pos, item_id=self.msg_id, delta=piece, **extra)

    def _close_reasoning(self) -> bytes:
        text = self.gen.reasoning_text
        out = b"" if self.terse else self.ev("response.reasoning_text.done", 0, item_id=self.rs_id,
                                             content_index=0, text=text)
        return out + self.ev("response.output_item.done", 0, item=self.reasoning_item(text, True))

    def tail(self) -> bytes:
        g = self.gen
        n_reason = g.plan.reasoning
        answered = g.completion_tokens > n_reason
        out = b""
        if n_reason and (self.terse or not answered):
            out += self._close_reasoning()
        pos = 1 if n_reason else 0
        if answered and g.tool is not None:
            if not self.terse:
                out += self.ev("response.function_call_arguments.done", pos, item_id=self.fc_id, name=g.tool.name,
                               arguments=g.text)
            out += self.ev("response.output_item.done", pos, item=self.call_item(g.text, True))
        elif answered and g.text:
            extra = {} if self.terse else {"content_index": 0, "logprobs": []}
            out += self.ev("response.output_text.done", pos, item_id=self.msg_id, text=g.text, **extra)
            extra = {} if self.terse else {"content_index": 0}
            out += self.ev("response.content_part.done", pos, item_id=self.msg_id, part=self.text_part(g.text),
                           **extra)
            out += self.ev("response.output_item.done", pos, item=self.message_item(g.text))
        return out + self.ev("response.completed", response=self.response("completed"))
