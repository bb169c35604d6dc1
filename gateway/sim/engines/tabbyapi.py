"""TabbyAPI (ExLlamaV3 at e632af4; ExLlamaV2 before) as a gateway sees it: routes, auth, error bodies, chunks,
structured output.

Quirks kept: SSE lines end ``\\r\\n`` and a ``: ping`` comment opens a stream (sse-starlette); no ``[DONE]``
after an in-stream error; the ``include_usage`` chunk has a non-empty ``choices`` entry; ``response_format``
``json_object`` is ignored (only ``json_schema`` is honoured); an unparseable schema/regex/grammar is logged and
skipped (unconstrained output); no ``/metrics`` and no load endpoint; ``x-api-key`` or ``Authorization:
Bearer``; the model field is ignored; the port is not served until the model has loaded. Since its chat and
completion rework (2026-03-30) a non-streamed answer carries ``usage`` only when ``stream_options.include_usage``
asks for it (accepted without ``stream``); ``/health`` answers 503 for good once any generation raised, even a
context overflow (its issue list is never cleared), while the server goes on serving.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim.engines.base import EngineError, Event, Gen, Handler
from gateway.sim.engines.openai import OpenAIEngine
from gateway.sim.generation import Constraint, constrained_text, request_rng
from gateway.sim.http import Request, Responder
from gateway.sim.prefix_cache import BlockCache, PrefixCache
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import ContextTooLong
from gateway.sim.template import render_chat

if TYPE_CHECKING:
    from gateway.sim.server import SimServer

PAGE_SIZE = 256
log = logging.getLogger("gateway.sim")


class TabbyEngine(OpenAIEngine):
    name = "tabbyapi"
    line_end = b"\r\n"
    ping_at_start = True
    done_after_error = False
    owned_by = "tabbyAPI"
    generation_paths = frozenset({"/v1/chat/completions", "/v1/completions"})
    unauthorized_body = b'{"detail":"Invalid API key"}'
    reasoning_key = "reasoning_content"  # with the model's ``reasoning: true`` (config.yml)
    tool_id_prefix = "call_"

    def __init__(self, server: SimServer) -> None:
        super().__init__(server)
        self.issues: list[dict[str, Any]] = []  # what generations raised: /health is 503 from the first on

    async def generate(self, resp: Responder, body: dict[str, Any], kind: str, prompt: str,
                       max_tokens: int | None = None, constraint: Constraint | None = None,
                       stream: bool | None = None, ids: list[int] | None = None) -> None:
        try:
            await super().generate(resp, body, kind, prompt, max_tokens, constraint, stream, ids)
        except EngineError as err:
            self.issues.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "description": err.message})
            raise

    def make_cache(self, profile: Profile) -> PrefixCache:
        return BlockCache(PAGE_SIZE, profile.kv_capacity_tokens)

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/chat/completions"): self.chat, ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/embeddings"): self.embeddings, ("GET", "/v1/models"): self.model_list,
            ("GET", "/v1/model/list"): self.model_list, ("GET", "/v1/model"): self.model_card,
            ("GET", "/health"): self.health, ("GET", "/props"): self.props,
            ("POST", "/v1/token/encode"): self.encode, ("POST", "/v1/token/decode"): self.decode,
        }

    def ping(self) -> bytes:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S.000000")
        return f": ping - {stamp}".encode() + self.line_end + self.line_end

    def authorized(self, req: Request) -> bool:
        key = self.spec.api_key
        if not key or req.path == "/health":
            return True
        return req.headers.get("x-api-key") == key or req.headers.get("authorization", "") == f"Bearer {key}"

    def error_body(self, err: EngineError) -> bytes:
        return orjson.dumps({"detail": err.message})

    def stream_error(self, err: EngineError) -> dict[str, Any]:
        return {"error": {"message": "Chat completion aborted. Please check the server console.", "trace": None}}

    def context_error(self, exc: ContextTooLong, prompt_len: int, max_tokens: int | None) -> EngineError:
        limit = self.server.profile.context_length
        return EngineError(400, f"Prompt length {prompt_len} is greater than max_seq_len {limit}")

    def max_tokens(self, body: dict[str, Any]) -> int | None:
        value = body.get("max_tokens", body.get("max_completion_tokens"))
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def constraint(self, body: dict[str, Any], kind: str) -> Constraint | None:
        candidates: list[Constraint] = []
        rf = body.get("response_format")
        if isinstance(rf, dict) and rf.get("type") == "json_schema":  # "json_object" is ignored, as in TabbyAPI
            js = rf.get("json_schema") or {}
            if isinstance(js, dict) and js.get("schema") is not None:
                candidates.append(Constraint("json", js["schema"]))
        if body.get("json_schema") is not None:
            candidates.append(Constraint("json", body["json_schema"]))
        if body.get("regex_pattern"):
            candidates.append(Constraint("regex", body["regex_pattern"]))
        if body.get("grammar_string"):
            g = body["grammar_string"]
            candidates.append(Constraint("gbnf" if "::=" in g else "lark", g))
        rng = request_rng(self.spec.seed, [len(candidates)])
        for c in candidates:
            try:
                constrained_text(c, rng)  # validate: an unusable constraint is skipped, not refused
            except (ValueError, TypeError) as exc:
                log.warning("TabbyAPI emulator: skipping unparseable %s constraint: %s", c.kind, exc)
                continue
            return c
        return None

    # -- shapes ----------------------------------------------------------------------------------------------
    def usage(self, gen: Gen) -> dict[str, Any]:
        n = gen.completion_tokens
        pt, ct = gen.prompt_seconds(), gen.decode_seconds() * n / max(1, n - 1)
        n_prompt = max(1, gen.prompt_len - gen.cached)
        return {"prompt_tokens": gen.prompt_len, "prompt_time": pt,
                "prompt_tokens_per_sec": n_prompt / pt if pt > 0 else 0.0,
                "completion_tokens": gen.completion_tokens, "completion_time": ct,
                "completion_tokens_per_sec": gen.completion_tokens / ct if ct > 0 else 0.0,
                "total_tokens": gen.prompt_len + gen.completion_tokens, "total_time": pt + ct}

    def chunk_base(self, gen: Gen) -> dict[str, Any]:
        obj = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
        return {"id": gen.id, "object": obj, "created": gen.created}

    def token_choice(self, gen: Gen, text: str, finish: str | None) -> dict[str, Any]:
        if gen.kind == "chat":
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
        return {"index": 0, "finish_reason": finish, "logprobs": None, "text": text}

    def token_chunk(self, gen: Gen) -> dict[str, Any] | None:
        if gen.tool is not None:
            return None  # tool call text is collected and parsed at the end of the stream
        return {**self.chunk_base(gen), "choices": [self.token_choice(gen, "\x00PIECE\x00", None)],
                "model": gen.model}

    def new_tool_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def delta_chunk(self, gen: Gen, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**self.chunk_base(gen), "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
                "model": gen.model}

    def answer_start_events(self, gen: Gen) -> list[Event]:
        return []

    def head_events(self, gen: Gen) -> list[Event]:
        return []

    def tail_events(self, gen: Gen) -> list[Event]:
        last = {**self.chunk_base(gen), "choices": [self.token_choice(gen, "", gen.finish_reason)], "model": gen.model}
        if gen.include_usage:  # the finish chunk is folded into the usage chunk, which keeps a choice
            last["usage"] = self.usage(gen)
        if gen.tool is None or not gen.text:
            return [last, b"[DONE]"]
        calls = [{**c, "index": 0} for c in self.tool_calls(gen)]
        tool = self.delta_chunk(gen, {"tool_calls": calls}, None if gen.include_usage else gen.finish_reason)
        return [tool, last, b"[DONE]"] if gen.include_usage else [tool, b"[DONE]"]

    def tool_calls(self, gen: Gen) -> list[dict[str, Any]]:
        assert gen.tool is not None
        return [{"id": gen.tool_id, "function": {"name": gen.tool.name, "arguments": gen.text},
                 "type": "function", "index": 0}]

    def full_response(self, gen: Gen) -> dict[str, Any]:
        if gen.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "finish_reason": gen.finish_reason, "stop_str": None,
                                      "message": {"role": "assistant",
                                                  "content": gen.text if gen.text.strip() and not gen.tool else None,
                                                  "reasoning_content": gen.reasoning_text or None,
                                                  "tool_calls": self.tool_calls(gen) if gen.tool else None,
                                                  "tool_call_id": None},
                                      "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None, "text": gen.text}
            obj = "text_completion"
        out = {"id": gen.id, "choices": [choice], "created": gen.created, "model": gen.model, "object": obj}
        if gen.include_usage or self.spec.version == "2026-03-29":
            out["usage"] = self.usage(gen)
        return out

    # -- native ----------------------------------------------------------------------------------------------
    def card(self) -> dict[str, Any]:
        p = self.server.profile
        return {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tabbyAPI",
                "logging": None, "draft": None,
                "parameters": {"max_seq_len": p.context_length, "cache_size": p.kv_capacity_tokens,
                               "cache_mode": "FP16", "rope_scale": 1.0, "rope_alpha": 1.0,
                               "max_batch_size": p.max_seqs, "chunk_size": p.prefill_chunk_tokens,
                               "prompt_template": "llama2", "use_vision": False}}

    async def model_card(self, req: Request, resp: Responder) -> None:
        self.send_json(resp, self.card())

    async def model_list(self, req: Request, resp: Responder) -> None:
        self.send_json(resp, {"object": "list", "data": [self.card()]})

    async def health(self, req: Request, resp: Responder) -> None:
        if self.issues:
            resp.send(503, orjson.dumps({"status": "unhealthy", "issues": self.issues}), "application/json")
        else:
            self.send_json(resp, {"status": "healthy", "issues": []})

    async def props(self, req: Request, resp: Responder) -> None:
        p = self.server.profile
        self.send_json(resp, {"total_slots": p.max_seqs, "chat_template": "llama2",
                              "default_generation_settings": {"n_ctx": p.context_length}})

    async def encode(self, req: Request, resp: Responder) -> None:
        """``text``: a string, or chat messages rendered through the template as TabbyAPI's encode route renders
        them (``endpoints/core/router.py``): the template's ``messages`` only (never its ``tools``), no
        generation prompt."""
        body = self.parse_json(req)
        text = body.get("text", "")
        bos = bool(body.get("add_bos_token", True))
        hf = self.server.hf
        if hf is not None:
            try:
                prompt = hf.render(text, None, False) if isinstance(text, list) else str(text)
            except Exception as exc:  # (a template that refuses the messages)
                raise EngineError(400, f"Template error: {exc}") from exc
            ids = hf.encode(prompt, add_special_tokens=bos)
        else:
            prompt = render_chat(text) if isinstance(text, list) else str(text)
            ids = self.server.tokenizer.encode(prompt, add_bos=bos)
        self.send_json(resp, {"tokens": ids, "length": len(ids)})

    async def decode(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.send_json(resp, {"text": self.server.tokenizer.decode(list(body.get("tokens") or []))})
