"""llama.cpp ``llama-server`` as a gateway sees it (tools/server): routes, auth, error bodies, chunks, metrics.

Quirks kept: every path answers 503 ``Loading model`` while loading; only ``/health`` is public with
``--api-key`` (``Authorization: Bearer`` or ``X-Api-Key``); ``/metrics`` needs ``--metrics`` (else 501) and its
throughput gauges are averaged since the previous scrape and reset by it; the last streamed chunk carries
``timings``; a ``: ping`` comment opens a stream; no ``[DONE]`` after an in-stream error; the model field is
ignored; ``json_schema`` and ``grammar`` together are refused.
"""

from __future__ import annotations

import secrets
import string
import time
from typing import Any

import orjson

from gateway.sim.agent import ToolPick
from gateway.sim.agent_routes import AgentSpec
from gateway.sim.engines.base import _MARK, EngineError, Event, Gen, Handler, drive, new_id
from gateway.sim.engines.openai import OpenAIEngine
from gateway.sim.generation import Constraint, plan_output, request_rng
from gateway.sim.http import Request, Responder
from gateway.sim.metrics_text import Exposition
from gateway.sim.prefix_cache import PrefixCache, SlotCache
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import ContextTooLong
from gateway.sim.template import render_chat

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
BUILD = "b6500-sim"
METRICS_HELP = {
    "llamacpp:prompt_tokens_total": "Number of prompt tokens processed.",
    "llamacpp:prompt_seconds_total": "Prompt process time",
    "llamacpp:tokens_predicted_total": "Number of generation tokens processed.",
    "llamacpp:tokens_predicted_seconds_total": "Predict process time",
    "llamacpp:n_decode_total": "Total number of llama_decode() calls",
    "llamacpp:prompt_tokens_cached_total": "Number of prompt tokens served from the cache.",
}


class LlamaCppEngine(OpenAIEngine):
    name = "llamacpp"
    ping_at_start = True
    done_after_error = False
    owned_by = "llamacpp"
    listen_after_load_fraction = 0.0  # HTTP is up at once and answers 503 while loading
    generation_paths = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                                  "/completion", "/v1/responses", "/v1/messages"})
    # server-context.cpp: /v1/responses (+ /input_tokens), /v1/messages (+ /count_tokens); no stored responses
    agent_spec = AgentSpec(responses="llamacpp", messages="llamacpp", count_tokens=True, input_tokens=True)
    reasoning_key = "reasoning_content"  # --reasoning-format auto / deepseek (the default)
    rerank_shape = "llamacpp"  # server.cpp: /rerank, /reranking, /v1/rerank, /v1/reranking

    def make_cache(self, profile: Profile) -> PrefixCache:
        self.slots = SlotCache(profile.max_seqs)
        return self.slots

    def routes(self) -> dict[tuple[str, str], Handler]:
        r: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self.health, ("GET", "/v1/health"): self.health,
            ("GET", "/v1/models"): self.models, ("GET", "/models"): self.models,
            ("GET", "/slots"): self.slots_route, ("GET", "/props"): self.props, ("GET", "/metrics"): self.metrics,
            ("POST", "/completion"): self.native_completion, ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize, ("POST", "/apply-template"): self.apply_template,
            ("POST", "/v1/embeddings"): self.embeddings, ("POST", "/embeddings"): self.embeddings,
        }
        for path in ("/v1/chat/completions", "/chat/completions"):
            r[("POST", path)] = self.chat
        for path in ("/v1/completions", "/completions"):
            r[("POST", path)] = self.completions
        r.update(self.agent_routes())
        r.update(self.rerank_routes())
        return r

    # -- auth and errors -----------------------------------------------------------------------------------
    def authorized(self, req: Request) -> bool:
        key = self.spec.api_key
        if not key or req.path in PUBLIC_PATHS:
            return True
        auth = req.headers.get("authorization", "")
        return auth == f"Bearer {key}" or req.headers.get("x-api-key") == key

    def unauthorized(self, resp: Responder) -> None:
        self.send_error(resp, EngineError(401, "Invalid API Key", "auth"))

    def error_body(self, err: EngineError) -> bytes:
        message = "File Not Found" if err.status == 404 and err.kind == "not_found" else err.message
        err_type = "exceed_context_size_error" if err.kind == "context" else ERROR_TYPES.get(err.status, "server_error")
        return orjson.dumps({"error": {"code": err.status, "message": message, "type": err_type}})

    def loading(self, req: Request, resp: Responder) -> None:
        self.send_error(resp, EngineError(503, "Loading model", "unavailable"))

    def agent(self, body: dict[str, Any], ids: list[int]) -> tuple[ToolPick | None, bool]:
        if not self.spec.tool_template:  # (its template renders no tools: the model never sees them)
            body = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
        return super().agent(body, ids)

    def context_room(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """llama-server refuses only a prompt that fills its slot's context; generation stops when the context is
        full, whatever ``n_predict`` asked (server-context.cpp: ``slot.prompt.n_tokens() + 1 >= slot.n_ctx``)."""
        limit = self.server.profile.context_length
        if prompt_len >= limit:
            raise ContextTooLong(f"request ({prompt_len} tokens) exceeds the available context size ({limit} tokens)")
        room = limit - prompt_len - 1
        return room if max_tokens is None or max_tokens > room else max_tokens

    def context_error(self, exc: ContextTooLong, prompt_len: int, max_tokens: int | None) -> EngineError:
        return EngineError(400, f"request ({prompt_len} tokens) exceeds the available context size "
                                f"({self.server.profile.context_length} tokens), try increasing it", "context")

    # -- structured output ---------------------------------------------------------------------------------------
    def max_tokens(self, body: dict[str, Any]) -> int | None:
        for key in ("max_completion_tokens", "max_tokens", "n_predict"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return None if value < 0 else max(1, value)
        return None

    def constraint(self, body: dict[str, Any], kind: str) -> Constraint | None:
        schema, grammar = body.get("json_schema"), body.get("grammar")
        rf = body.get("response_format")
        if isinstance(rf, dict):
            if rf.get("type") == "json_object":
                schema = rf.get("schema", {"type": "object"})
            elif rf.get("type") == "json_schema":
                js = rf.get("json_schema") or {}
                schema = js.get("schema", {"type": "object"}) if isinstance(js, dict) else {"type": "object"}
            elif rf.get("type") not in (None, "text"):
                raise EngineError(400, "response_format type must be one of \"text\" or \"json_object\", but got: "
                                  + str(rf.get("type")))
        if schema is not None and grammar:
            raise EngineError(400, 'Either "json_schema" or "grammar" can be specified, but not both')
        tools = body.get("tools")
        if kind == "chat" and "grammar" in body and isinstance(tools, list) and tools and \
                body.get("tool_choice") != "none":  # (server-common.cpp, oaicompat_chat_params_parse)
            raise EngineError(400, "Cannot use custom grammar constraints with tools.")
        if schema is not None:
            return Constraint("json", schema)
        if grammar:
            return Constraint("gbnf", grammar)
        return None

    # -- shapes ----------------------------------------------------------------------------------------------
    def timings(self, gen: Gen) -> dict[str, Any]:
        prompt_n = gen.prompt_len - gen.cached
        prompt_ms = gen.prompt_seconds() * 1000
        predicted_n = gen.completion_tokens
        # n tokens span n - 1 decode intervals after the first (which prefill produced): scale to n
        predicted_ms = gen.decode_seconds() * 1000 * predicted_n / max(1, predicted_n - 1)
        return {
            "cache_n": gen.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(1, prompt_n),
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(1, predicted_n),
            "predicted_per_second": 1e3 * predicted_n / predicted_ms if predicted_ms > 0 else 0.0,
        }

    def usage(self, gen: Gen) -> dict[str, Any]:
        return {"completion_tokens": gen.completion_tokens, "prompt_tokens": gen.prompt_len,
                "total_tokens": gen.prompt_len + gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached}}

    def chunk_base(self, gen: Gen) -> dict[str, Any]:
        obj = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
        return {"created": gen.created, "id": gen.id, "model": gen.model, "system_fingerprint": BUILD, "object": obj}

    def token_choice(self, gen: Gen, text: str | None, finish: str | None) -> dict[str, Any]:
        if gen.kind == "chat":
            return {"finish_reason": finish, "index": 0, "delta": {} if finish else {"content": text}}
        return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}

    # -- agent shapes (common_chat_msg_diff_to_json_oaicompat: only the fields that changed) --------------------
    def delta_chunk(self, gen: Gen, delta: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"finish_reason": None, "index": 0, "delta": delta}], **self.chunk_base(gen)}

    def new_tool_id(self) -> str:  # gen_tool_call_id(): 32 random alphanumerics
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))

    def chat_message(self, gen: Gen) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": gen.text}
        if gen.reasoning_text:
            msg["reasoning_content"] = gen.reasoning_text
        if gen.tool is not None:
            msg["content"] = None
            msg["tool_calls"] = self.tool_calls(gen)
        return msg

    def token_chunk(self, gen: Gen) -> dict[str, Any] | None:
        if gen.tool is not None:
            return self.delta_chunk(gen, self.tool_args_delta(_MARK))
        if gen.kind == "native":
            return {"index": 0, "content": _MARK, "tokens": [], "stop": False, "id_slot": -1,
                    "tokens_predicted": 0, "tokens_evaluated": gen.prompt_len}
        return {"choices": [self.token_choice(gen, _MARK, None)], **self.chunk_base(gen)}

    def head_events(self, gen: Gen) -> list[Event]:
        if gen.kind != "chat":
            return []
        return [{"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
                 **self.chunk_base(gen)}]

    def tail_events(self, gen: Gen) -> list[Event]:
        if gen.kind == "native":
            return [self.native_final(gen, "")]
        out: list[dict[str, Any]] = [{"choices": [self.token_choice(gen, None, gen.finish_reason)],
                                      **self.chunk_base(gen)}]
        if gen.include_usage:
            out.append({"choices": [], **self.chunk_base(gen), "usage": self.usage(gen)})
        out[-1]["timings"] = self.timings(gen)
        return [*out, b"[DONE]"]

    def full_response(self, gen: Gen) -> dict[str, Any]:
        if gen.kind == "native":
            return self.native_final(gen, gen.text)
        if gen.kind == "chat":
            choice: dict[str, Any] = {"finish_reason": gen.finish_reason, "index": 0,
                                      "message": self.chat_message(gen)}
        else:
            choice = {"text": gen.text, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}
        base = self.chunk_base(gen)
        base["object"] = "chat.completion" if gen.kind == "chat" else "text_completion"
        return {"choices": [choice], **base, "usage": self.usage(gen), "timings": self.timings(gen)}

    def native_final(self, gen: Gen, content: str) -> dict[str, Any]:
        seq = gen.seq
        slot = self.slots.slot_of.get(seq.id, -1) if seq else -1
        return {"index": 0, "content": content, "tokens": [], "id_slot": slot, "stop": True, "model": gen.model,
                "tokens_predicted": gen.completion_tokens, "tokens_evaluated": gen.prompt_len,
                "generation_settings": self.params(), "prompt": gen.body.get("prompt", ""), "has_new_line": False,
                "truncated": False, "stop_type": "limit" if gen.finish_reason == "length" else "eos",
                "stopping_word": "", "tokens_cached": gen.prompt_len + gen.completion_tokens,
                "timings": self.timings(gen)}

    # -- native routes ------------------------------------------------------------------------------------------
    async def health(self, req: Request, resp: Responder) -> None:
        self.send_json(resp, {"status": "ok"})

    async def models(self, req: Request, resp: Responder) -> None:
        p = self.server.profile
        meta = {"vocab_type": 1, "n_vocab": 32000, "n_ctx_train": p.context_length, "n_embd": 4096,
                "n_params": 6738415616, "size": 3825065984}
        self.send_json(resp, {
            "models": [{"name": self.model, "model": self.model, "modified_at": "", "size": "", "digest": "",
                        "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                        "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "",
                                                      "families": [""], "parameter_size": "",
                                                      "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "llamacpp",
                      "meta": meta}]})

    def params(self) -> dict[str, Any]:
        return {"n_predict": -1, "seed": 4294967295, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                "cache_prompt": True, "stream": False, "n_keep": 0, "n_discard": 0, "ignore_eos": False}

    def requested_slot(self, gen: Gen) -> int | None:
        """``id_slot`` (-1: any): the request waits for that slot if it is busy (server-context.cpp defers it)."""
        slot = gen.body.get("id_slot")
        return slot if isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0 else None

    def slot_json(self, i: int) -> dict[str, Any]:
        sched = self.server.scheduler
        seq = next((s for s in sched.running if self.slots.slot_of.get(s.id) == i), None)
        n_decoded = seq.generated if seq else 0
        n_remain = len(seq.output) - seq.generated if seq else -1
        return {"id": i, "id_task": seq.id if seq else -1, "n_ctx": self.server.profile.context_length,
                "speculative": False, "is_processing": seq is not None,
                "n_prompt_tokens": len(seq.prompt) if seq else len(self.slots.prompts[i]),
                "n_prompt_tokens_cache": seq.cached if seq else 0,
                "params": self.params(), "prompt": "",
                "next_token": [{"has_next_token": seq is not None, "has_new_line": False, "n_remain": n_remain,
                                "n_decoded": n_decoded, "stopping_word": ""}]}

    async def slots_route(self, req: Request, resp: Responder) -> None:
        slots = [self.slot_json(i) for i in range(len(self.slots.prompts))]
        if "fail_on_no_slot=1" in req.query and all(s["is_processing"] for s in slots):
            raise EngineError(503, "no slot available", "unavailable")
        self.send_json(resp, slots)

    async def props(self, req: Request, resp: Responder) -> None:
        self.send_json(resp, {
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": self.server.profile.context_length,
                                            "speculative": False, "is_processing": False, "params": self.params(),
                                            "prompt": "", "next_token": {"has_next_token": True,
                                                                         "has_new_line": False, "n_remain": -1,
                                                                         "n_decoded": 0, "stopping_word": ""}},
            "total_slots": self.server.profile.max_seqs, "model_path": f"/models/{self.model}.gguf",
            "modalities": {"vision": False, "audio": False}, "chat_template": "llama2",
            "chat_template_caps": {"supports_tools": self.spec.tool_template,
                                   "supports_tool_calls": self.spec.tool_template,
                                   "supports_parallel_tool_calls": self.spec.tool_template,
                                   "supports_system_role": True}, "bos_token": "<s>",
            "eos_token": "</s>", "build_info": BUILD, "is_sleeping": False})

    async def metrics(self, req: Request, resp: Responder) -> None:
        if not self.spec.metrics:
            raise EngineError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                              "not_supported")
        lat, st, sched = self.server.lat, self.server.stats, self.server.scheduler
        e = Exposition()
        counters = {
            "llamacpp:prompt_tokens_total": st.prompt_tokens - st.cached_tokens,
            "llamacpp:prompt_seconds_total": lat.prompt_seconds,
            "llamacpp:tokens_predicted_total": st.tokens_generated,
            "llamacpp:tokens_predicted_seconds_total": lat.decode_seconds,
            "llamacpp:n_decode_total": lat.steps,
            "llamacpp:prompt_tokens_cached_total": st.cached_tokens,
        }
        for name, value in counters.items():
            e.counter(name, value, METRICS_HELP[name])
        e.counter("llamacpp:n_tokens_max", lat.max_tokens_seen, "Largest observed n_tokens.")
        e.gauge("llamacpp:n_busy_slots_per_decode", lat.win_busy_slot_steps / max(1, lat.win_steps),
                "Average number of busy slots per llama_decode() call")
        e.gauge("llamacpp:prompt_tokens_seconds",
                lat.win_prompt_tokens / lat.win_prompt_seconds if lat.win_prompt_seconds else 0.0,
                "Average prompt throughput in tokens/s.")
        e.gauge("llamacpp:predicted_tokens_seconds",
                lat.win_gen_tokens / lat.win_decode_seconds if lat.win_decode_seconds else 0.0,
                "Average generation throughput in tokens/s.")
        e.gauge("llamacpp:requests_processing", len(sched.running), "Number of requests processing.")
        e.gauge("llamacpp:requests_deferred", len(sched.waiting), "Number of requests deferred.")
        lat.win_prompt_tokens = lat.win_gen_tokens = lat.win_steps = lat.win_busy_slot_steps = 0
        lat.win_prompt_seconds = lat.win_decode_seconds = 0.0
        resp.send(200, e.render(), "text/plain; version=0.0.4")

    async def native_completion(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = "".join(map(str, prompt))
        if not isinstance(prompt, str):
            raise EngineError(400, '"prompt" must be a string, an array of token ids or a list of prompts')
        ids = self.server.tokenizer.encode(prompt)
        try:
            mt = self.context_room(len(ids), self.max_tokens(body))
        except ContextTooLong as exc:
            raise self.context_error(exc, len(ids), None) from exc
        p = self.server.profile
        plan = plan_output(self.server.tokenizer, request_rng(self.spec.seed, ids, self.server.stats.requests), mt,
                           (p.natural_min_tokens, p.natural_max_tokens), self.constraint(body, "native"),
                           bool(body.get("ignore_eos")))
        try:
            self.server.scheduler.check(len(ids), mt or len(plan.ids))
        except ContextTooLong as exc:
            raise self.context_error(exc, len(ids), mt) from exc
        gen = Gen(id=new_id(""), model=self.model, kind="native", stream=bool(body.get("stream")),
                  include_usage=False, plan=plan, prompt_len=len(ids), scale=self.spec.time_scale, body=body)
        await drive(self, gen, ids, resp)

    async def tokenize(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        tok = self.server.tokenizer
        text = str(body.get("content", ""))
        ids = tok.encode(text, add_bos=bool(body.get("add_special", False)))
        if body.get("with_pieces"):
            self.send_json(resp, {"tokens": [{"id": i, "piece": tok.decode([i])} for i in ids]})
        else:
            self.send_json(resp, {"tokens": ids})

    async def detokenize(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.send_json(resp, {"content": self.server.tokenizer.decode(list(body.get("tokens") or []))})

    async def apply_template(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.send_json(resp, {"prompt": render_chat(body.get("messages") or [], body.get("tools"))})
