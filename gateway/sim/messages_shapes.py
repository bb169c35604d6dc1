"""``/v1/messages`` (Anthropic Messages) bodies and stream events, in llama.cpp's and vLLM's shapes.

``"llamacpp"`` follows ``tools/server/server-task.cpp`` (``to_json_anthropic*``): ``message_start`` with the
first token; blocks thinking (index 0), text, tool_use (no ``input`` in its start); every ``content_block_stop``
at the end, a thinking block closed by an empty ``signature_delta``; ``message_delta`` usage has only
``output_tokens``; a stop word is ``stop_reason: "end_turn"`` with ``stop_sequence`` set. Its usage (the body's,
``message_start``'s) says ``cache_read_input_tokens`` and counts only the uncached rest as ``input_tokens``.
``"vllm"`` follows ``vllm/entrypoints/anthropic/serving.py`` (SGLang's handler is a port of it):
``message_start`` first, dumped with ``exclude_unset`` (no ``type`` / ``role`` in its message); one block open
at a time, closed before the next starts; a thinking block's ``signature_delta`` carries a uuid; tool_use starts
with ``input: {}``; ``message_delta`` usage has input and output tokens; the finish reason maps stop ->
end_turn (so a forced named tool, which vLLM finishes with ``stop``, is ``end_turn``), length -> max_tokens,
tool_calls -> tool_use; ``stop_sequence`` is never filled. The full body always has a text block (``""`` when
there is no text). With ``--enable-prompt-tokens-details`` (``cache_report``) the body's and the final
``message_delta``'s usage say ``cache_read_input_tokens`` and count only the uncached rest as ``input_tokens``
(0.34 ``_build_anthropic_usage``). Neither sends ``[DONE]``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from gateway.sim.engines.base import Gen
from gateway.sim.responses_shapes import sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessageShape:
    """One message: the stream writer (``head`` / ``token`` / ``tail``) and the final body."""

    def __init__(self, flavor: str, gen: Gen, stop_word: str | None, cache_report: bool = True) -> None:
        self.gen = gen
        self.llama = flavor == "llamacpp"
        self.stop_word = stop_word if self.llama else None
        self.signature = "" if self.llama else uuid.uuid4().hex
        self.cache_report = self.llama or cache_report

    def usage(self, output_tokens: int) -> dict[str, Any]:
        """Input and output tokens, the cached part of the input as ``cache_read_input_tokens`` where reported."""
        g = self.gen
        if not self.cache_report:
            return {"input_tokens": g.prompt_len, "output_tokens": output_tokens}
        if self.llama:
            return {"cache_read_input_tokens": g.cached, "input_tokens": g.prompt_len - g.cached,
                    "output_tokens": output_tokens}
        return {"input_tokens": g.prompt_len - g.cached, "output_tokens": output_tokens,
                "cache_read_input_tokens": g.cached}

    def stop_reason(self) -> str:
        g = self.gen
        if self.llama:
            if g.finish_reason == "length":
                return "max_tokens"
            return "tool_use" if g.tool is not None else "end_turn"
        return STOP_REASONS.get(g.finish_reason, "end_turn")

    def tool_input(self) -> Any:
        try:
            return json.loads(self.gen.text)
        except ValueError:
            return {}

    def message(self) -> dict[str, Any]:
        """The non-streamed body."""
        g = self.gen
        content: list[dict[str, Any]] = []
        if g.reasoning_text:
            content.append({"type": "thinking", "thinking": g.reasoning_text, "signature": self.signature})
        if g.tool is None and (g.text or not self.llama):
            content.append({"type": "text", "text": g.text})
        elif g.tool is not None:
            if not self.llama:
                content.append({"type": "text", "text": ""})
            content.append({"type": "tool_use", "id": g.tool_id, "name": g.tool.name, "input": self.tool_input()})
        body: dict[str, Any] = {"id": g.id, "type": "message", "role": "assistant", "content": content,
                                "model": g.model, "stop_reason": self.stop_reason()}
        if self.llama:
            body["stop_sequence"] = self.stop_word
        body["usage"] = self.usage(g.completion_tokens)
        return body

    # -- stream ------------------------------------------------------------------------------------------------
    def _message_start(self) -> bytes:
        g = self.gen
        msg: dict[str, Any] = {"id": g.id, "content": [], "model": g.model, "stop_reason": None,
                               "stop_sequence": None,  # (vLLM's is sent before the prompt was scheduled)
                               "usage": self.usage(0) if self.llama else {"input_tokens": g.prompt_len,
                                                                          "output_tokens": 0}}
        if self.llama:
            msg = {"id": g.id, "type": "message", "role": "assistant", **msg}
        return sse({"type": "message_start", "message": msg})

    def head(self) -> bytes:
        return b"" if self.llama else self._message_start()

    def _block(self) -> tuple[int, str]:
        """The answer's block: its index and type."""
        return (1 if self.gen.plan.reasoning else 0), "text" if self.gen.tool is None else "tool_use"

    def _start_block(self, index: int, kind: str) -> bytes:
        g = self.gen
        block: dict[str, Any]
        if kind == "thinking":
            block = {"type": "thinking", "thinking": ""}
        elif kind == "text":
            block = {"type": "text", "text": ""}
        else:
            assert g.tool is not None
            block = {"type": "tool_use", "id": g.tool_id, "name": g.tool.name, **({} if self.llama else {"input": {}})}
        return sse({"type": "content_block_start", "index": index, "content_block": block})

    def _stop_block(self, index: int, kind: str) -> bytes:
        out = b""
        if kind == "thinking":
            out = sse({"type": "content_block_delta", "index": index,
                       "delta": {"type": "signature_delta", "signature": self.signature}})
        return out + sse({"type": "content_block_stop", "index": index})

    def token(self, index: int, piece: str) -> bytes:
        g = self.gen
        out = self._message_start() if self.llama and index == 0 else b""
        if index < g.plan.reasoning:
            if index == 0:
                out += self._start_block(0, "thinking")
            return out + sse({"type": "content_block_delta", "index": 0,
                              "delta": {"type": "thinking_delta", "thinking": piece}})
        pos, kind = self._block()
        if index == g.plan.reasoning:
            if g.plan.reasoning and not self.llama:
                out += self._stop_block(0, "thinking")
            out += self._start_block(pos, kind)
        if not piece:
            return out
        delta = ({"type": "text_delta", "text": piece} if kind == "text"
                 else {"type": "input_json_delta", "partial_json": piece})
        return out + sse({"type": "content_block_delta", "index": pos, "delta": delta})

    def tail(self) -> bytes:
        g = self.gen
        answered = g.completion_tokens > g.plan.reasoning
        pos, kind = self._block()
        out = b""
        if g.plan.reasoning and (self.llama or not answered):
            out += self._stop_block(0, "thinking")
        if answered:
            out += self._stop_block(pos, kind)
        usage: dict[str, Any] = {"output_tokens": g.completion_tokens}
        delta: dict[str, Any] = {"stop_reason": self.stop_reason()}
        if self.llama:
            delta["stop_sequence"] = self.stop_word
        else:
            usage = self.usage(g.completion_tokens)
        out += sse({"type": "message_delta", "delta": delta, "usage": usage})
        return out + sse({"type": "message_stop"})
