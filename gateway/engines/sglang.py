"""SGLang's server.

Health: not ``/health``, which by default runs a one-token generation; the gateway probes ``/ready`` (0.5.20
and later: 503 while warming up, while generation is paused, and while draining after SIGTERM; ``/v1/models``
answers 200 through all of it), and ``/v1/models`` on an older SGLang (no ``/ready``; 503 while warming up).
Load: ``/v1/loads`` (works without ``--enable-metrics``): running and waiting requests and ``token_usage`` per
data-parallel rank, summed. Capacity: ``max_running_requests`` from the
same document, ``max_model_len`` from ``/v1/models``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import httpx
import orjson

from gateway.engines import readings
from gateway.engines.base import BackendError, EngineAdapter, get, get_json, native_grammar, parse_histogram
from gateway.engines.kv_sources import tcp_address, topic_of
from gateway.engines.spec import RERANK_ROUTES, EngineSpec
from gateway.engines.vllm import max_model_len
from gateway.pool.state import Capacity, KvEventSource, LoadRecord, Probe, ShapeSeed
from gateway.structured import Constraint
from gateway.structured.syntax import regex_from_choices

SPEC = EngineSpec(
    name="sglang",
    health_path="/ready",  # /health runs a one-token generation by default (see probe for SGLang before 0.5.20)
    loading_status=503,  # warming up, paused or draining
    cache_page_tokens=1,  # the radix tree reuses any prefix, token by token (--page-size 1, its default)
    kv_events=True,  # --kv-events-config
    # "priority" with --enable-priority-scheduling: higher first unless --schedule-low-priority-values-first;
    # ignored without it (server_args.py: abort_on_priority_when_disabled defaults to False)
    priority_order="higher-first",
    # /metrics only with --enable-metrics; running and waiting come from /v1/loads (see read_load)
    routes=RERANK_ROUTES,
    metric_names={"queue_histogram": "sglang:queue_time_seconds"},
    # chat: response_format json_schema (strict); completions: json_schema as a JSON string; regex, ebnf (xgrammar);
    # choices as a regex alternation
    # /v1/responses and /v1/messages, served by the engine itself: python/sglang/srt/entrypoints/http_server.py (0.5.23)
    native_apis=frozenset({"responses", "messages", "count_tokens"}),
    # native_messages: none. Its Anthropic protocol declares only user and assistant roles and thinking.type
    # enabled / disabled: Claude Code's inline system messages and adaptive thinking are translated
    # cache_salt (0.5.23: chat, completions and responses requests; not its Anthropic messages, which build a chat
    # request without it): the radix tree keys a salted prompt's nodes by (extra_key, salt)
    # (srt/mem_cache/radix_cache.py), and BlockStored carries the salt (srt/disaggregation/kv_events.py)
    cache_isolation="cache_salt",
    isolated_native_apis=frozenset({"responses"}),
    # structural_tag: response_format only (the legacy form's at_least_one too; no top-level field)
    # strict_tools: under auto, FunctionCallParser.get_structure_constraint compiles the tools into a structural
    # tag where the model's tool parser supports one (serving_chat.py)
    structured=frozenset({"json_object", "json_schema", "regex", "choice", "grammar:ebnf", "structural_tag",
                          "at_least_one", "tool_call", "strict_tools", "beside_tools"}),
    # continuous batching, like vLLM
    shape=ShapeSeed(tok_s=178.0, growth=0.011, prefill_tok_s=10_000.0),
)


class SGLangAdapter(EngineAdapter):
    spec: ClassVar[EngineSpec] = SPEC

    def prepare_body(self, route: str, body: dict[str, Any], constraint: Constraint | None = None) -> dict[str, Any]:
        body = super().prepare_body(route, body, constraint)
        if constraint is not None and constraint.kind == "json_schema" and route != "completions":
            # SGLang's ChatCompletionRequest has no json_schema field (only CompletionRequest has): pydantic drops
            # it, and the answer comes back unconstrained. A chat schema is read from response_format alone, and
            # only with strict not false (protocol.py 0.5.23, ChatCompletionRequest.to_sampling_params)
            del body["json_schema"]
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": constraint.name, "schema": constraint.schema, "strict": True}}
        if route == "rerank":
            body.pop("top_n", None)  # (every result, and its count, comes back: see rerank_answer)
        return body

    def constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        kind = constraint.kind
        if kind == "json_schema":  # (CompletionRequest's field; see prepare_body for chat)
            return {"json_schema": orjson.dumps(constraint.schema).decode()}
        if kind == "regex":
            return {"regex": constraint.pattern}
        if kind == "choice":
            return {"regex": regex_from_choices(list(constraint.choices))}
        if kind == "grammar":
            return {"ebnf": native_grammar(constraint, ("ebnf",))}
        if kind == "structural_tag":  # (ChatCompletionRequest and CompletionRequest read it only here)
            return {"response_format": constraint.tag}
        return super().constraint_fields(constraint)

    def rewrite_answer(self, route: str, model: str, body: dict[str, Any] | None = None,
                       ) -> Callable[[bytes], bytes] | None:
        if route != "rerank":
            return None
        top_n = (body or {}).get("top_n")
        return lambda raw: rerank_answer(raw, model, top_n if isinstance(top_n, int) and top_n > 0 else None)

    def __init__(self) -> None:
        self._metrics_enabled = True  # learned: without --enable-metrics /metrics is not served
        self._has_ready = True  # learned: SGLang before 0.5.20 has no /ready

    async def probe(self, client: httpx.AsyncClient) -> Probe:
        if self._has_ready:
            response = await get(client, "/ready")
            if response.status_code != 404:
                return self.read_probe("/ready", response, "is warming up, paused or draining")
            self._has_ready = False  # (before 0.5.20: its models list is 503 while warming up)
        return self.read_probe("/v1/models", await get(client, "/v1/models"))

    async def read_load(self, client: httpx.AsyncClient) -> LoadRecord | None:
        loads = await _loads(client)
        figures = readings.Figures()
        usages = [figures.fraction("kv_usage", x["token_usage"]) for x in loads if x.get("token_usage") is not None]
        queue = None
        if self._metrics_enabled:
            response = await get(client, "/metrics")
            if response.status_code == 200:
                queue = figures.histogram("queue_histogram",
                                          parse_histogram(response.text, self.spec.metric_names["queue_histogram"]))
            else:
                self._metrics_enabled = False
        running = figures.total("running", _reported(loads, "num_running_reqs"))
        waiting = figures.total("waiting", _reported(loads, "num_waiting_reqs"))
        known = [u for u in usages if u is not None]
        kv_usage = max(known) if known and len(known) == len(usages) else None  # (a rank's garbage: no reading)
        return LoadRecord(running, waiting, kv_usage, time.monotonic(), queue, tuple(dict.fromkeys(figures.rejected)))

    async def read_capacity(self, client: httpx.AsyncClient) -> Capacity:
        loads = await _loads(client)
        return Capacity(
            slots=_sum(loads, "max_running_requests") or None,
            context_length=await max_model_len(client),
            cache_tokens=_sum(loads, "max_total_num_tokens", readings.MAX_TOKENS) or None,
        )

    async def read_kv_events(self, client: httpx.AsyncClient) -> KvEventSource:
        """``/server_info`` ``kv_events`` (0.5.19+: ``srt/runtime_context.py`` ``describe_kv_events_publisher``):
        ``{"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base", "topic", "block_size", "dp_size",
        "replay_endpoint_port_base"?}`` (rank r on base + r), null without ``--kv-events-config``."""
        info: Any = await get_json(client, "/server_info")
        kv = info.get("kv_events") if isinstance(info, dict) else None
        if not isinstance(kv, dict):
            raise BackendError("/server_info shows no KV-event publisher (kv_events): the server runs without "
                               "--kv-events-config, or is a release that does not say")
        if kv.get("publisher") != "zmq":
            raise BackendError("/server_info kv_events: no zmq publisher")
        ranks = kv.get("dp_size", 1)
        if ranks != 1:
            raise BackendError(f"/server_info kv_events: {ranks!r} data-parallel ranks, each its own cache and "
                               "socket: not followed yet")
        host = kv.get("endpoint_host")
        host = host if isinstance(host, str) else ""
        replay = kv.get("replay_endpoint_port_base")
        what = "/server_info kv_events"
        return KvEventSource(tcp_address(host, kv.get("endpoint_port_base"), client, what),
                             tcp_address(host, replay, client, what) if replay else None,
                             topic_of(kv.get("topic"), what), readings.positive(kv.get("block_size"), 1 << 20))


async def _loads(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    doc: Any = await get_json(client, "/v1/loads")
    loads = doc.get("loads") if isinstance(doc, dict) else None
    if not isinstance(loads, list):
        raise BackendError("/v1/loads has no 'loads' list")
    return [item for item in loads if isinstance(item, dict)]


def _reported(loads: list[dict[str, Any]], key: str) -> list[Any]:
    """``key`` of each rank that reports it."""
    return [item[key] for item in loads if item.get(key) is not None]


def _sum(loads: list[dict[str, Any]], key: str, limit: int = readings.MAX_COUNT) -> int | None:
    """``key`` summed over the ranks that report it; None when none does or one reports garbage."""
    return readings.total(_reported(loads, key), limit)


MAX_RERANK_RESULTS = 16_384  # results one rerank answer may hold (requests: limits.max_documents, 1,024 by default)


def rerank_answer(raw: bytes, model: str, top_n: int | None = None) -> bytes:
    """SGLang's rerank answer, a bare list of ``{score, document, index, meta_info}`` best first
    (``serving_rerank.py``), in the shape vLLM and llama.cpp answer and rerank clients read (Jina's and
    Cohere's): ``{id, model, object, usage, results: [{index, relevance_score, document: {text}}]}``, the
    best ``top_n`` of them. SGLang is asked for them all (prepare_body): it scores every document and answers
    only ``top_n``, each with its own count, so a request of 200 documents and ``top_n: 1`` was charged 1/200
    of the engine's work (sweep 17); the usage is every result's."""
    items = orjson.loads(raw)
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ValueError("SGLang's rerank answer is not a list of results")
    if len(items) > MAX_RERANK_RESULTS:  # (one per document asked for: rewritten item by item on the event loop,
        # 500,000 of them held it 1 s, sweep 10)
        raise ValueError(f"SGLang's rerank answer has {len(items)} results, more than any request asks for")
    results: list[dict[str, Any]] = []
    tokens = 0
    rid = ""
    for item in items:
        result: dict[str, Any] = {"index": item.get("index"), "relevance_score": item.get("score")}
        if isinstance(item.get("document"), str):
            result["document"] = {"text": item["document"]}
        results.append(result)
        meta = item.get("meta_info")
        if isinstance(meta, dict):
            tokens += readings.usage_tokens(meta.get("prompt_tokens"))  # (a whole number in range, else 0)
            rid = rid or str(meta.get("id") or "")
    return orjson.dumps({"id": rid or "rerank", "model": model, "object": "list",
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "results": results[:top_n] if top_n else results})
