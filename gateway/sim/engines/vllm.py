"""vLLM's OpenAI server as a gateway sees it: routes, auth, error bodies, chunks, metrics, structured outputs.

Quirks kept: the removed ``guided_*`` fields are ignored (200, unconstrained output); ``structured_outputs``
takes exactly one of json/regex/choice/grammar/json_object/structural_tag (and ``response_format`` may be a
structural tag); ``Authorization: Bearer`` only on ``/v1*``;
``/health`` and ``/metrics`` are open; the port is not served until the model has loaded; ``[DONE]`` always ends
a stream, even after an in-stream error; ``cached_tokens`` only with ``--enable-prompt-tokens-details``
(``cache_report``); an unknown model name is a 404.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.sim.agent import ToolPick
from gateway.sim.agent_routes import AgentSpec
from gateway.sim.engines.base import EngineError, Handler
from gateway.sim.engines.openai import OpenAIEngine
from gateway.sim.generation import Constraint
from gateway.sim.http import Request, Responder
from gateway.sim.metrics_text import Exposition
from gateway.sim.prefix_cache import BlockCache, PrefixCache
from gateway.sim.profiles import Profile
from gateway.sim.template import render_chat


def block_size(version: str | None) -> int:
    """``--block-size``'s default: 64 from 0.34, 16 before."""
    return 64 if version == "0.34.0" else 16

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def openai_constraint(body: dict[str, Any]) -> Constraint | None:
    """``response_format`` as vLLM and SGLang read it."""
    rf = body.get("response_format")
    if not isinstance(rf, dict):
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return Constraint("json_object", None)
    if kind == "json_schema":
        js = rf.get("json_schema") or {}
        schema = js.get("schema", js.get("schema_")) if isinstance(js, dict) else None
        return Constraint("json", schema if schema is not None else {"type": "object"})
    if kind == "structural_tag":  # (either form; vLLM's legacy model drops at_least_one, which is never needed here)
        return Constraint("structural_tag", rf)
    if kind not in (None, "text"):
        raise EngineError(400, f"Unknown response_format type: {kind}", param="response_format")
    return None


class VllmEngine(OpenAIEngine):
    name = "vllm"
    owned_by = "vllm"
    generation_paths = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
    # openai/responses/api_router.py (GET /v1/responses/{id} needs VLLM_ENABLE_RESPONSES_API_STORE=1 there),
    # anthropic/api_router.py (/v1/messages, /v1/messages/count_tokens)
    agent_spec = AgentSpec(responses="openai", messages="vllm", count_tokens=True, store=256,
                           salted=frozenset({"responses", "messages"}))
    unauthorized_body = b'{"error":"Unauthorized"}'
    rerank_shape = "vllm"  # pooling/scoring/api_router.py: /rerank, /v1/rerank, /v2/rerank

    def make_cache(self, profile: Profile) -> PrefixCache:
        return BlockCache(block_size(self.spec.version), profile.kv_capacity_tokens, self.server.kv_events)

    def routes(self) -> dict[tuple[str, str], Handler]:
        return {
            ("POST", "/v1/chat/completions"): self.chat, ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/embeddings"): self.embeddings, ("GET", "/v1/models"): self.models,
            ("GET", "/health"): self.empty, ("GET", "/ping"): self.empty, ("POST", "/ping"): self.empty,
            ("GET", "/version"): self.version, ("GET", "/load"): self.load, ("GET", "/metrics"): self.metrics,
            ("POST", "/tokenize"): self.tokenize, ("POST", "/detokenize"): self.detokenize,
            ("POST", "/reset_prefix_cache"): self.reset_prefix_cache, ("GET", "/kv_event_sources"): self.kv_sources,
            **self.agent_routes(),
            **self.rerank_routes(),
        }

    async def kv_sources(self, req: Request, resp: Responder) -> None:
        """Each data-parallel rank's publisher config as it resolved it (0.34:
        ``vllm/entrypoints/serve/instrumentator/basic.py``); ``{}`` without ``--kv-events-config``. No key
        needed (not under ``/v1``)."""
        advertised = self.server.kv_advertised()
        if advertised is None:
            self.send_json(resp, {})
            return
        kv = self.spec.kv_events or {}
        endpoint, replay = advertised
        self.send_json(resp, {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                                    "replay_endpoint": replay, "buffer_steps": kv.get("buffer_steps", 10_000),
                                    "hwm": 100_000, "max_queue_size": 100_000, "topic": kv.get("topic", "")}})

    def tool_finish(self, tool: ToolPick) -> str:
        return "stop" if tool.named else "tool_calls"  # resolve_finish_reason: a forced named tool reports "stop"

    def authorized(self, req: Request) -> bool:
        key = self.spec.api_key
        if not key or not req.path.startswith("/v1"):
            return True
        return req.headers.get("authorization", "") == f"Bearer {key}"

    def error_body(self, err: EngineError) -> bytes:
        if err.status in (404, 405) and err.kind == "not_found" and err.param is None:
            return orjson.dumps({"detail": err.message})  # FastAPI's own 404/405
        return orjson.dumps({"error": {"message": err.message, "type": ERROR_TYPES.get(err.status, "BadRequestError"),
                                       "param": err.param, "code": err.status}})

    async def generate(self, resp: Responder, body: dict[str, Any], kind: str, prompt: str,
                       max_tokens: int | None = None, constraint: Constraint | None = None,
                       stream: bool | None = None, ids: list[int] | None = None) -> None:
        if kind in ("chat", "completion") and body.get("stream_options") and not body.get("stream"):
            # (ChatCompletionRequest / CompletionRequest.validate_stream_options, 0.34)
            raise EngineError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        await super().generate(resp, body, kind, prompt, max_tokens, constraint, stream, ids)

    def queue_rank(self, body: dict[str, Any]) -> int:
        """``priority``: lower first with --scheduling-policy priority; ignored without it (0.34: no longer
        refused)."""
        priority = body.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise EngineError(400, "priority: Input should be a valid integer", param="priority")
        return priority if self.spec.priority_scheduling else 0

    def cache_salt(self, body: dict[str, Any]) -> str | None:
        """``cache_salt`` as vLLM 0.34 validates it (entrypoints/generate/base/protocol.py validate_cache_salt,
        before the field's own bounds): a non-empty string of at most 128 characters without '@', '/', '\\' or
        NUL; the prefix cache mixes it into the first block's hash."""
        salt = body.get("cache_salt")
        if salt is None:
            return None
        if not isinstance(salt, str) or not salt:
            raise EngineError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                              param="cache_salt")
        if len(salt) > 128 or any(c in "@/\\\0" for c in salt):
            raise EngineError(400, "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                              "'@', '/', '\\\\', or NUL.", param="cache_salt")
        return salt

    def check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise EngineError(404, f"The model `{model}` does not exist.", "not_found", param="model")

    def constraint(self, body: dict[str, Any], kind: str) -> Constraint | None:
        # guided_json / guided_regex / guided_choice / guided_grammar were removed: vLLM ignores them silently.
        so = body.get("structured_outputs")
        found: list[Constraint] = []
        if isinstance(so, dict):
            for key in STRUCTURED_KEYS:
                value = so.get(key)
                if value is None or value is False:
                    continue
                if key == "json":
                    found.append(Constraint("json", orjson.loads(value) if isinstance(value, str) else value))
                elif key == "json_object":
                    found.append(Constraint("json_object", None))
                elif key == "grammar":
                    found.append(Constraint("ebnf" if "::=" in str(value) else "lark", value))
                elif key == "regex":
                    found.append(Constraint("regex", value))
                elif key == "choice":
                    found.append(Constraint("choice", value))
                elif key == "structural_tag":  # (a JSON string, as StructuredOutputsParams types it)
                    found.append(Constraint("structural_tag", value))
            if len(found) > 1:
                raise EngineError(400, "You can only use one kind of structured outputs constraint but multiple "
                                  f"are specified: {so}")
        rf = openai_constraint(body)
        if rf is not None:
            if found:
                raise EngineError(400, "You can only use one kind of structured outputs constraint but multiple "
                                  "are specified: response_format and structured_outputs")
            return rf
        return found[0] if found else None

    # -- native routes ----------------------------------------------------------------------------------------
    async def empty(self, req: Request, resp: Responder) -> None:
        resp.send(200, b"")

    async def version(self, req: Request, resp: Responder) -> None:
        self.send_json(resp, {"version": self.spec.version})

    async def load(self, req: Request, resp: Responder) -> None:
        sched = self.server.scheduler
        self.send_json(resp, {"server_load": len(sched.running) + len(sched.waiting)})

    async def models(self, req: Request, resp: Responder) -> None:
        now = int(time.time())
        self.send_json(resp, {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": now, "owned_by": "vllm", "root": self.model,
            "parent": None, "max_model_len": self.server.profile.context_length,
            "permission": [{"id": "modelperm-sim", "object": "model_permission", "created": now,
                            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                            "organization": "*", "group": None, "is_blocking": False}]}]})

    async def tokenize(self, req: Request, resp: Responder) -> None:
        """vLLM's ``/tokenize``: ``messages`` rendered with the chat template (``add_special_tokens`` default
        False: the template writes BOS), or ``prompt`` (default True)."""
        body = self.parse_json(req)
        self.check_model(body)
        tok, hf = self.server.tokenizer, self.server.hf
        if "messages" in body:
            if hf is not None:
                ids = hf.encode(self.render_hf(body), bool(body.get("add_special_tokens", False)))
            else:
                ids = tok.encode(render_chat(body["messages"], body.get("tools")))
        elif hf is not None:
            ids = hf.encode(str(body.get("prompt", "")), bool(body.get("add_special_tokens", True)))
        else:
            ids = tok.encode(str(body.get("prompt", "")), add_bos=bool(body.get("add_special_tokens", True)))
        self.send_json(resp, {"count": len(ids), "max_model_len": self.server.profile.context_length,
                              "tokens": ids, "token_strs": None})

    async def detokenize(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        self.check_model(body)
        tokens = [int(t) for t in body.get("tokens") or []]
        hf = self.server.hf
        text = hf.decode(tokens) if hf is not None else self.server.tokenizer.decode(tokens)
        self.send_json(resp, {"prompt": text})

    async def reset_prefix_cache(self, req: Request, resp: Responder) -> None:
        """``POST /reset_prefix_cache`` (vLLM serves it with ``VLLM_SERVER_DEV_MODE=1``): empties the prefix
        cache (AllBlocksCleared) unless requests are running, as vLLM refuses while blocks are in use."""
        sched = self.server.scheduler
        if not sched.running and not sched.waiting:
            sched.cache.flush()
        resp.send(200, b"")

    async def metrics(self, req: Request, resp: Responder) -> None:
        s, lat, sched, p = self.server.stats, self.server.lat, self.server.scheduler, self.server.profile
        e = Exposition({"model_name": self.model, "engine": "0"})
        e.gauge("vllm:num_requests_running", len(sched.running), "Number of requests in model execution batches.")
        e.gauge("vllm:num_requests_waiting", len(sched.waiting), "Number of requests waiting to be processed.")
        e.gauge("vllm:kv_cache_usage_perc", sched.kv_used / p.kv_capacity_tokens,
                "KV-cache usage. 1 means 100 percent usage.")
        e.counter("vllm:prefix_cache_queries_total", s.prompt_tokens,
                  "Prefix cache queries, in terms of number of queried tokens.")
        e.counter("vllm:prefix_cache_hits_total", s.cached_tokens,
                  "Prefix cache hits, in terms of number of cached tokens.")
        e.counter("vllm:num_preemptions_total", 0, "Cumulative number of preemption from the engine.")
        e.counter("vllm:prompt_tokens_total", s.prompt_tokens, "Number of prefill tokens processed.")
        e.counter("vllm:generation_tokens_total", s.tokens_generated, "Number of generation tokens processed.")
        e.counter("vllm:request_success_total", s.completed, "Count of successfully processed requests.")
        e.histogram("vllm:time_to_first_token_seconds", lat.ttft, "Histogram of time to first token in seconds.")
        e.histogram("vllm:inter_token_latency_seconds", lat.itl, "Histogram of inter-token latency in seconds.")
        e.histogram("vllm:request_queue_time_seconds", lat.queue,
                    "Histogram of time spent in WAITING phase for request.")
        e.histogram("vllm:e2e_request_latency_seconds", lat.e2e, "Histogram of e2e request latency in seconds.")
        e.histogram("vllm:request_prompt_tokens", lat.prompt_len, "Number of prefill tokens processed.")
        e.histogram("vllm:request_generation_tokens", lat.gen_len, "Number of generation tokens processed.")
        e.gauge("vllm:cache_config_info", 1.0, "Information of the LLMEngine CacheConfig", {
            "block_size": str(block_size(self.spec.version)),
            "num_gpu_blocks": str(p.kv_capacity_tokens // block_size(self.spec.version)),
            "enable_prefix_caching": "True", "cache_dtype": "auto", "gpu_memory_utilization": "0.9"})
        resp.send(200, e.render(), "text/plain; version=0.0.4; charset=utf-8")
