"""SGLang's HTTP server as a gateway sees it: routes, auth, error bodies, chunks, ``/v1/loads``, metrics.

Quirks kept: one of ``json_schema`` (a JSON string; read on completions and /generate, ignored on chat, whose
schema comes from ``response_format`` alone) / ``regex`` / ``ebnf`` / a structural tag (``response_format``;
``structural_tag`` on /generate) per request; ``/health`` runs a
one-token generation (it is not free); ``/metrics`` only with ``--enable-metrics`` (else 404); ``cached_tokens``
only with ``--enable-cache-report``; not listening for the first half of the load, then warming up: from
0.5.20 ``/v1/models`` answers 200 at once and ``/ready`` 503 (also while generation is paused with
``/pause_generation``, whose requests wait until ``/continue_generation``), before it every path 503;
``[DONE]`` always ends a stream. Not emulated: the ~2 s delay before a streamed request's abort.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway.sim.agent_routes import AgentSpec
from gateway.sim.engines.base import EngineError, Event, Gen, Handler, drive, new_id
from gateway.sim.engines.openai import OpenAIEngine, model_tokens
from gateway.sim.engines.vllm import openai_constraint
from gateway.sim.generation import Constraint, plan_output, request_rng
from gateway.sim.http import Request, Responder
from gateway.sim.metrics_text import Exposition
from gateway.sim.prefix_cache import PrefixCache, RadixCache
from gateway.sim.profiles import Profile
from gateway.sim.scheduler import Sequence
from gateway.sim.template import render_chat

if TYPE_CHECKING:
    from gateway.sim.server import SimServer

ERROR_TYPES = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 500: "InternalServerError",
               503: "ServiceUnavailable"}


class SglangEngine(OpenAIEngine):
    name = "sglang"
    owned_by = "sglang"
    listen_after_load_fraction = 0.5
    generation_paths = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses",
                                  "/v1/messages"})
    # http_server.py: /v1/responses (+ GET /v1/responses/{id}), /v1/messages, /v1/messages/count_tokens
    # its Anthropic protocol (0.5.23) declares roles user and assistant only, thinking.type enabled or disabled
    agent_spec = AgentSpec(responses="openai", messages="vllm", count_tokens=True, store=256,
                           salted=frozenset({"responses"}), inline_system=False,
                           thinking_types=frozenset({"enabled", "disabled"}))
    unauthorized_body = b'{"error":"Unauthorized"}'
    reasoning_key = "reasoning_content"
    tool_id_prefix = "call_"
    rerank_shape = "sglang"  # http_server.py: /v1/rerank (POST and PUT), a bare list of results

    def __init__(self, server: SimServer) -> None:
        super().__init__(server)
        self.paused = False  # /pause_generation: /ready answers 503, and new requests wait for /continue_generation
        self.resumed = asyncio.Event()

    def has_ready(self) -> bool:
        return self.spec.version != "0.5.19"

    def loading(self, req: Request, resp: Responder) -> None:
        """Warming up: from 0.5.20 the server answers (``/v1/models`` 200, ``/ready`` and ``/health`` 503)."""
        if self.has_ready() and (req.method, req.path) == ("GET", "/v1/models"):
            self.models_now(resp)
        elif self.has_ready() and req.path in ("/ready", "/health", "/health_generate"):
            resp.send(503, b"")
        else:
            super().loading(req, resp)

    def make_cache(self, profile: Profile) -> PrefixCache:
        kv = self.spec.kv_events or {}
        self.radix = RadixCache(profile.kv_capacity_tokens, kv.get("page_size", 1), self.server.kv_events)
        return self.radix

    def routes(self) -> dict[tuple[str, str], Handler]:
        r: dict[tuple[str, str], Handler] = {
            ("POST", "/v1/chat/completions"): self.chat, ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/embeddings"): self.embeddings, ("GET", "/v1/models"): self.models,
            ("POST", "/generate"): self.native_generate, ("GET", "/health"): self.health,
            ("GET", "/health_generate"): self.health_generate, ("GET", "/v1/loads"): self.loads,
            ("GET", "/get_load"): self.get_load, ("GET", "/server_info"): self.server_info,
            ("GET", "/get_server_info"): self.server_info, ("POST", "/flush_cache"): self.flush_cache,
            ("GET", "/flush_cache"): self.flush_cache, ("POST", "/abort_request"): self.abort_request,
            ("POST", "/v1/tokenize"): self.tokenize, ("POST", "/v1/detokenize"): self.detokenize,
        }
        if self.spec.metrics:
            r[("GET", "/metrics")] = self.metrics
        if self.has_ready():
            r[("GET", "/ready")] = self.ready
            r[("POST", "/pause_generation")] = self.pause_generation
            r[("POST", "/continue_generation")] = self.continue_generation
        r.update(self.agent_routes())
        r.update(self.rerank_routes())
        return r

    def authorized(self, req: Request) -> bool:
        key = self.spec.api_key
        if not key or req.path.startswith("/health") or req.path.startswith("/metrics") or req.path == "/ready":
            return True
        return req.headers.get("authorization", "") == f"Bearer {key}"

    def error_body(self, err: EngineError) -> bytes:
        if err.status in (404, 405) and err.kind == "not_found":
            return orjson.dumps({"detail": err.message})
        return orjson.dumps({"object": "error", "message": err.message,
                             "type": ERROR_TYPES.get(err.status, "BadRequestError"), "param": err.param,
                             "code": err.status})

    def stream_error(self, err: EngineError) -> dict[str, Any]:
        return {"error": orjson.loads(self.error_body(err))}

    def cache_salt(self, body: dict[str, Any]) -> str | None:
        """``cache_salt`` (0.5.23 protocol: ``Optional[Union[List[str], str]]``; io_struct normalises an empty
        string to None and wants one list entry per prompt): the radix tree keys the prompt's nodes by it."""
        salt = body.get("cache_salt")
        if isinstance(salt, list) and len(salt) == 1 and isinstance(salt[0], str):
            salt = salt[0]
        if salt is not None and not isinstance(salt, str):
            raise EngineError(400, "cache_salt: Input should be a valid string", param="cache_salt")
        return salt or None

    def queue_rank(self, body: dict[str, Any]) -> int:
        """``priority`` with --enable-priority-scheduling: higher first (the default order); ignored without it
        (abort_on_priority_when_disabled is off by default)."""
        priority = body.get("priority")
        if priority is None:
            return 0
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise EngineError(400, "priority: Input should be a valid integer", param="priority")
        return -priority if self.spec.priority_scheduling else 0

    def constraint(self, body: dict[str, Any], kind: str) -> Constraint | None:
        """A top-level ``json_schema`` (a JSON string) is a field of CompletionRequest and of /generate's sampling
        params only: ChatCompletionRequest has none, and pydantic ignores it (0.5.23 protocol.py). A chat schema
        comes from ``response_format`` alone."""
        found: list[Constraint] = []
        if body.get("json_schema") is not None and kind != "chat":
            schema = body["json_schema"]
            found.append(Constraint("json", orjson.loads(schema) if isinstance(schema, str) else schema))
        if body.get("regex") is not None:
            found.append(Constraint("regex", body["regex"]))
        if body.get("ebnf") is not None:
            found.append(Constraint("ebnf", body["ebnf"]))
        if body.get("structural_tag") is not None and kind == "native":  # (/generate's sampling params only)
            found.append(Constraint("structural_tag", body["structural_tag"]))
        rf = openai_constraint(body)  # (a structural tag: response_format alone on chat and completions)
        named = body["response_format"].get("json_schema") if rf is not None and rf.kind == "json" else None
        if isinstance(named, dict) and not isinstance(named.get("name"), str):  # (JsonSchemaResponseFormat.name: str)
            raise EngineError(400, "response_format.json_schema.name: Field required", param="response_format")
        if rf is not None:
            found.append(rf)
        if len(found) > 1:
            raise EngineError(400, "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        return found[0] if found else None

    # -- shapes: SGLang's chunks carry explicit nulls and ``matched_stop`` -------------------------------------
    def usage(self, gen: Gen) -> dict[str, Any]:
        n = gen.reasoning_tokens
        return {"prompt_tokens": gen.prompt_len, "total_tokens": gen.prompt_len + gen.completion_tokens,
                "completion_tokens": gen.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": gen.cached} if self.spec.cache_report else None,
                "reasoning_tokens": n, "completion_tokens_details": {"reasoning_tokens": n} if n else None}

    # every DeltaMessage field is sent, null when unset; tool call fragments carry null id and name
    def delta_chunk(self, gen: Gen, delta: dict[str, Any]) -> dict[str, Any]:
        full = {"role": None, "content": None, "reasoning_content": None, "tool_calls": None, **delta}
        return {**self.chunk_base(gen), "choices": [{"index": 0, "delta": full, "logprobs": None,
                                                     "finish_reason": None, "matched_stop": None}], "usage": None}

    def tool_start_delta(self, gen: Gen) -> dict[str, Any]:
        assert gen.tool is not None
        return {"tool_calls": [{"id": gen.tool_id, "index": 0, "type": "function",
                                "function": {"name": gen.tool.name, "arguments": ""}}]}

    def tool_args_delta(self, text: str) -> dict[str, Any]:
        return {"tool_calls": [{"id": None, "index": 0, "type": "function",
                                "function": {"name": None, "arguments": text}}]}

    def tool_calls(self, gen: Gen) -> list[dict[str, Any]]:
        return [{**call, "index": 0} for call in super().tool_calls(gen)]

    def chat_message(self, gen: Gen) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": gen.text,
                               "reasoning_content": gen.reasoning_text or None}
        if gen.tool is not None:
            msg["content"] = None
            msg["tool_calls"] = self.tool_calls(gen)
        return msg

    def token_choice(self, gen: Gen, text: str, finish: str | None) -> dict[str, Any]:
        matched = 2 if finish == "stop" else None
        if gen.kind == "chat":
            delta = {"role": None, "content": text, "reasoning_content": None, "tool_calls": None}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "matched_stop": matched}

    def token_chunk(self, gen: Gen) -> dict[str, Any] | None:
        chunk = super().token_chunk(gen)
        return chunk if chunk is None or gen.tool is not None else {**chunk, "usage": None}

    def head_events(self, gen: Gen) -> list[Event]:
        if gen.kind != "chat":
            return []
        delta = {"role": "assistant", "content": "", "reasoning_content": None, "tool_calls": None}
        return [{**self.chunk_base(gen), "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                      "finish_reason": None, "matched_stop": None}], "usage": None}]

    def tail_events(self, gen: Gen) -> list[Event]:
        if gen.kind == "native":
            return [self.native_event(gen), b"[DONE]"]
        out: list[Event] = [{**self.chunk_base(gen), "choices": [self.token_choice(gen, "", gen.finish_reason)],
                             "usage": None}]
        if gen.include_usage:
            out.append({**self.chunk_base(gen), "choices": [], "usage": self.usage(gen)})
        return [*out, b"[DONE]"]

    def full_response(self, gen: Gen) -> dict[str, Any]:
        if gen.kind == "native":
            return self.native_event(gen)
        out = super().full_response(gen)
        out["choices"][0]["matched_stop"] = 2 if gen.finish_reason == "stop" else None
        out["choices"][0].pop("stop_reason", None)
        return out

    # -- native ----------------------------------------------------------------------------------------------
    def native_event(self, gen: Gen, seq: Sequence | None = None) -> dict[str, Any]:
        s = seq or gen.seq
        n = s.generated if s else 0
        done = s is not None and n >= len(s.output)
        finish: dict[str, Any] | None = None
        if done:
            finish = ({"type": "length", "length": n} if gen.finish_reason == "length"
                      else {"type": "stop", "matched": 2})
        return {"text": "".join(gen.plan.pieces[:n]), "output_ids": gen.plan.ids[:n],
                "meta_info": {"id": gen.id, "finish_reason": finish, "prompt_tokens": gen.prompt_len,
                              "weight_version": "default", "completion_tokens": n,
                              "cached_tokens": gen.cached, "e2e_latency": gen.queue_seconds()
                              + gen.prompt_seconds() + gen.decode_seconds()}}

    def dynamic_token(self, gen: Gen, seq: Sequence) -> bytes | None:
        if seq.generated >= len(seq.output):
            return None  # the final state is sent by tail_events
        return orjson.dumps(self.native_event(gen, seq))

    async def native_generate(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        sp = body.get("sampling_params") or {}
        hf = self.server.hf
        if "input_ids" in body:
            ids = [int(i) for i in body["input_ids"]]
        elif isinstance(body.get("text"), str):
            ids = hf.encode(body["text"]) if hf is not None else self.server.tokenizer.encode(body["text"])
        else:
            raise EngineError(400, "Either text or input_ids should be provided.")
        mt = sp.get("max_new_tokens", 128)
        try:
            plan = self.plan(ids, mt, self.constraint(sp, "native"), bool(sp.get("ignore_eos")))
        except ValueError as exc:
            raise self.constraint_error(exc) from exc
        gen = Gen(id=new_id(""), model=self.model, kind="native", stream=bool(body.get("stream")),
                  include_usage=False, plan=plan, prompt_len=len(ids), scale=self.spec.time_scale, body=body)
        await drive(self, gen, ids, resp)

    async def generate(self, resp: Responder, body: dict[str, Any], kind: str, prompt: str,
                       max_tokens: int | None = None, constraint: Constraint | None = None,
                       stream: bool | None = None, ids: list[int] | None = None) -> None:
        while self.paused:  # (tokenizer_manager: a request waits on is_pause_cond)
            self.resumed.clear()
            await self.resumed.wait()
        await super().generate(resp, body, kind, prompt, max_tokens, constraint, stream, ids)

    async def ready(self, req: Request, resp: Responder) -> None:
        resp.send(503 if self.paused else 200, b"")

    async def pause_generation(self, req: Request, resp: Responder) -> None:
        self.paused = True
        self.send_json(resp, {"message": "Generation paused successfully."})

    async def continue_generation(self, req: Request, resp: Responder) -> None:
        self.paused = False
        self.resumed.set()
        self.send_json(resp, {"message": "Generation continued successfully."})

    async def models(self, req: Request, resp: Responder) -> None:
        self.models_now(resp)

    def models_now(self, resp: Responder) -> None:
        self.send_json(resp, {"object": "list", "data": [{
            "id": self.model, "object": "model", "created": int(time.time()), "owned_by": "sglang",
            "root": self.model, "max_model_len": self.server.profile.context_length}]})

    async def health(self, req: Request, resp: Responder) -> None:
        await self.health_generate(req, resp)

    async def health_generate(self, req: Request, resp: Responder) -> None:
        """Runs one real (emulated) one-token generation through the scheduler, as SGLang does by default (its
        prompt, with a real tokenizer, is SGLang's ``input_ids=[0]``)."""
        hf = self.server.hf
        ids = [0] if hf is not None else self.server.tokenizer.encode("health")
        plan = plan_output(self.server.tokenizer, request_rng(0, ids), 1, (1, 1))
        if hf is not None:
            plan = model_tokens(hf, plan, 1)
        gen = Gen(id=new_id("HEALTH_CHECK_"), model=self.model, kind="native", stream=False, include_usage=False,
                  plan=plan, prompt_len=len(ids), scale=self.spec.time_scale, body={})
        await drive(self, gen, ids, resp, full=lambda g: None)

    def load_entry(self) -> dict[str, Any]:
        sched, p, st = self.server.scheduler, self.server.profile, self.server.stats
        return {"dp_rank": 0, "num_running_reqs": len(sched.running), "num_waiting_reqs": len(sched.waiting),
                "num_used_tokens": sched.kv_used, "max_total_num_tokens": p.kv_capacity_tokens,
                "token_usage": sched.kv_used / p.kv_capacity_tokens,
                "cache_hit_rate": st.cached_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
                "gen_throughput": 0.0, "max_running_requests": p.max_seqs}

    async def loads(self, req: Request, resp: Responder) -> None:
        entry = self.load_entry()
        agg = {k: entry[k] for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                                     "max_total_num_tokens", "token_usage")}
        self.send_json(resp, {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(), "dp_rank_count": 1,
                              "loads": [entry], "aggregate": agg})

    async def get_load(self, req: Request, resp: Responder) -> None:
        e = self.load_entry()
        self.send_json(resp, [{"num_reqs": e["num_running_reqs"] + e["num_waiting_reqs"],
                               "num_waiting_reqs": e["num_waiting_reqs"], "num_tokens": e["num_used_tokens"]}])

    async def server_info(self, req: Request, resp: Responder) -> None:
        p = self.server.profile
        self.send_json(resp, {
            "model_path": self.model, "served_model_name": self.model, "context_length": p.context_length,
            "max_running_requests": p.max_seqs, "max_total_tokens": p.kv_capacity_tokens,
            "chunked_prefill_size": p.prefill_chunk_tokens, "enable_metrics": self.spec.metrics,
            "enable_cache_report": self.spec.cache_report, "api_key": None, "port": self.server.port,
            "version": self.spec.version, "status": "ready", **self._kv_events_info(),
            "internal_states": [{"max_total_num_tokens": p.kv_capacity_tokens, "last_gen_throughput": 0.0,
                                 "load": len(self.server.scheduler.running)}]})

    def _kv_events_info(self) -> dict[str, Any]:
        """SGLang advertises its publisher in ``/server_info`` (0.5.19+, ``srt/runtime_context.py``
        ``describe_kv_events_publisher``): the host it binds as given (``*`` stays ``*``), port bases (rank r on
        base + r), topic, block (page) size, ranks; ``null`` without ``--kv-events-config``."""
        advertised = self.server.kv_advertised()
        if advertised is None:
            return {"kv_events": None}
        kv = self.spec.kv_events or {}
        host, port = _host_port(advertised[0])
        info = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": port,
                "topic": kv.get("topic", ""), "block_size": kv.get("page_size", 1), "dp_size": 1}
        if advertised[1]:  # (present only for a tcp replay endpoint)
            info["replay_endpoint_port_base"] = _host_port(advertised[1])[1]
        return {"kv_events": info}

    async def flush_cache(self, req: Request, resp: Responder) -> None:
        sched = self.server.scheduler
        if sched.running or sched.waiting:
            resp.send(400, b"Cache not flushed. Please check backend logs for more details. (When there are "
                      b"running or waiting requests, the operation will not be performed.)", "text/plain")
            return
        self.radix.flush()
        resp.send(200, b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                  b"waiting requests, the operation will not be performed.)", "text/plain")

    async def abort_request(self, req: Request, resp: Responder) -> None:
        resp.send(200, b"")

    async def tokenize(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        prompt = body.get("prompt", "")
        hf = self.server.hf
        if hf is not None:  # SGLang: add_special_tokens defaults to True; a list of prompts is a batch
            special = bool(body.get("add_special_tokens", True))
            if isinstance(prompt, list):
                batch = [hf.encode(str(p), special) for p in prompt]
                self.send_json(resp, {"tokens": batch, "count": [len(t) for t in batch],
                                      "max_model_len": self.server.profile.context_length})
                return
            ids = hf.encode(str(prompt), special)
        else:
            ids = self.server.tokenizer.encode(render_chat(prompt) if isinstance(prompt, list) else str(prompt))
        self.send_json(resp, {"tokens": ids, "count": len(ids), "max_model_len": self.server.profile.context_length})

    async def detokenize(self, req: Request, resp: Responder) -> None:
        body = self.parse_json(req)
        tokens = [int(t) for t in body.get("tokens") or []]
        hf = self.server.hf
        self.send_json(resp, {"text": hf.decode(tokens) if hf is not None else self.server.tokenizer.decode(tokens)})

    async def metrics(self, req: Request, resp: Responder) -> None:
        st, lat, e = self.server.stats, self.server.lat, Exposition({"model_name": self.model})
        entry = self.load_entry()
        e.gauge("sglang:num_running_reqs", entry["num_running_reqs"], "The number of running requests.")
        e.gauge("sglang:num_used_tokens", entry["num_used_tokens"], "The number of used tokens.")
        e.gauge("sglang:token_usage", entry["token_usage"], "The token usage.")
        e.gauge("sglang:num_queue_reqs", entry["num_waiting_reqs"], "The number of requests in the waiting queue.")
        e.gauge("sglang:cache_hit_rate", entry["cache_hit_rate"], "The prefix cache hit rate.")
        e.gauge("sglang:gen_throughput", 0.0, "The generation throughput (token/s).")
        e.counter("sglang:prompt_tokens_total", st.prompt_tokens, "Number of prefill tokens processed.")
        e.counter("sglang:generation_tokens_total", st.tokens_generated, "Number of generation tokens processed.")
        e.counter("sglang:cached_tokens_total", st.cached_tokens, "Number of cached prompt tokens.")
        e.counter("sglang:num_requests_total", st.completed, "Number of requests processed.")
        e.histogram("sglang:time_to_first_token_seconds", lat.ttft, "Histogram of time to first token in seconds.")
        e.histogram("sglang:inter_token_latency_seconds", lat.itl, "Histogram of inter-token latency in seconds.")
        e.histogram("sglang:e2e_request_latency_seconds", lat.e2e, "Histogram of End-to-end request latency.")
        e.histogram("sglang:queue_time_seconds", lat.queue, "Histogram of queueing time in seconds.")
        resp.send(200, e.render(), "text/plain; version=0.0.4; charset=utf-8")




def _host_port(endpoint: str) -> tuple[str, int | None]:
    """``tcp://127.0.0.1:5557`` -> (``127.0.0.1``, 5557); an endpoint without a TCP port -> (endpoint, None)."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    return (host, int(port)) if sep and port.isdigit() else (endpoint, None)
