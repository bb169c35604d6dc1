"""vLLM's OpenAI server.

Health: ``/health`` (the port is not served until the engine is ready). Load: ``/metrics`` gauges.
Capacity: ``max_model_len`` from ``/v1/models``; KV cache size and block size from ``vllm:cache_config_info``;
vLLM does not publish its ``max_num_seqs``, so the slot count is the configured ``max_concurrency`` or 1024:
vLLM's default on GPUs of 70 GiB and more other than the A100 (H100, H200, B200), where 256 (its default on
smaller GPUs and the A100) would hold such a server to a quarter of what it schedules. Too many slots only
leaves requests waiting in vLLM's own queue, which its ``num_requests_waiting`` shows the router; too few
leave its batch slots idle with nothing telling.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx
import orjson

from gateway.engines import exposition, readings
from gateway.engines.base import BackendError, EngineAdapter, get, get_json, json_of, native_grammar
from gateway.engines.kv_sources import connectable, topic_of
from gateway.engines.spec import RERANK_ROUTES, EngineSpec
from gateway.pool.state import Capacity, KvEventSource, ShapeSeed
from gateway.structured import Constraint
from gateway.structured.constraint import OPTIONS

SPEC = EngineSpec(
    name="vllm",
    metric_names={
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "queue_histogram": "vllm:request_queue_time_seconds",
    },
    default_slots=1024,  # vLLM's default max_num_seqs on large GPUs, which it does not publish (see above)
    cache_page_tokens=64,  # --block-size's default from 0.34 (16 before); read from cache_config_info where shown
    routes=RERANK_ROUTES,
    kv_events=True,  # --kv-events-config
    # "priority" (lower first) with --scheduling-policy priority; ignored without it (0.34; it was a 400 before)
    priority_order="lower-first",
    # structured_outputs (xgrammar): JSON, regex, choice, EBNF and Lark grammars. Never the removed guided_*
    # fields, which vLLM ignores with a 200.
    # /v1/responses and /v1/messages, served by the engine itself (0.33: vllm/entrypoints/openai/responses/
    # api_router.py, vllm/entrypoints/anthropic/api_router.py)
    native_apis=frozenset({"responses", "messages", "count_tokens"}),
    # current vLLM folds a system message inside messages into the conversation (issue 42)
    native_messages=frozenset({"inline_system", "thinking:adaptive"}),
    # cache_salt (0.34: chat, completions, responses, anthropic messages; entrypoints/generate/base/protocol.py
    # validate_cache_salt: a non-empty string of at most 128 characters, none of '@', '/', '\\', NUL), mixed into
    # the first block's hash (v1/core/kv_cache_utils.py generate_block_hash_extra_keys) and published with it in
    # BlockStored.extra_keys
    cache_isolation="cache_salt",
    isolated_native_apis=frozenset({"responses", "messages"}),
    # structural_tag: structured_outputs.structural_tag (a JSON string; response_format structural_tag becomes
    # the same). The options of StructuredOutputsParams (sampling_params.py, 0.23-0.34) are its alone.
    # strict_tools: the tool parser's structural tag constrains a strict tool's arguments under auto
    structured=frozenset({"json_object", "json_schema", "regex", "choice", "grammar:ebnf", "grammar:lark",
                          "structural_tag", "tool_call", "strict_tools", "beside_tools", *OPTIONS}),
    # continuous batching: barely slower per token at 64 sequences than alone
    shape=ShapeSeed(tok_s=175.0, growth=0.012, prefill_tok_s=10_000.0),
)


class VLLMAdapter(EngineAdapter):
    spec: ClassVar[EngineSpec] = SPEC

    def constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        # the client's options (disable_any_whitespace, ...) travel with the constraint: the gateway rewrote
        # structured_outputs, and vLLM reads them nowhere else
        return {"structured_outputs": {**_constraint(constraint), **dict(constraint.options)}}

    async def read_capacity(self, client: httpx.AsyncClient) -> Capacity:
        cache_tokens, page_tokens = await _kv_cache(client)
        return Capacity(slots=self.spec.default_slots, context_length=await max_model_len(client),
                        cache_tokens=cache_tokens, page_tokens=page_tokens)

    async def read_kv_events(self, client: httpx.AsyncClient) -> KvEventSource:
        """``GET /kv_event_sources`` (0.34: ``vllm/entrypoints/serve/instrumentator/basic.py``): each data-parallel
        rank's ``KVEventsConfig`` as its publisher resolved it (``{"0": {"publisher": "zmq", "endpoint":
        "tcp://*:5557", "replay_endpoint", "topic", ...}}``), ``{}`` without ``--kv-events-config``; older
        releases answer 404."""
        path = "/kv_event_sources"
        response = await get(client, path)
        if response.status_code == 404:
            raise BackendError(f"GET {path} answered 404: this vLLM does not say where it publishes (a release "
                               "before the route): type its kv_events endpoint in the configuration")
        if response.status_code != 200:
            raise BackendError(f"GET {path} answered HTTP {response.status_code}")
        doc: Any = json_of(response, path)
        if not isinstance(doc, dict):
            raise BackendError(f"{path} is not an object")
        if not doc:
            raise BackendError(f"{path} lists no publisher: the server runs without --kv-events-config")
        if len(doc) > 1:
            raise BackendError(f"{path} lists {len(doc)} data-parallel ranks, each its own cache and socket: "
                               "not followed yet")
        config = next(iter(doc.values()))
        if not isinstance(config, dict) or config.get("publisher") != "zmq":
            raise BackendError(f"{path}: no zmq publisher")
        replay = config.get("replay_endpoint")
        return KvEventSource(connectable(config.get("endpoint"), client, path),
                             connectable(replay, client, path) if replay else None,
                             topic_of(config.get("topic"), path))


def _constraint(constraint: Constraint) -> dict[str, Any]:
    """The constraint as a field of vLLM's StructuredOutputsParams."""
    kind = constraint.kind
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": constraint.schema}
    if kind == "regex":
        return {"regex": constraint.pattern}
    if kind == "choice":
        return {"choice": list(constraint.choices)}
    if kind == "grammar":
        return {"grammar": native_grammar(constraint, ("ebnf", "lark"))}
    if kind == "structural_tag":  # (a string: what vLLM makes of response_format's structural_tag too)
        return {"structural_tag": orjson.dumps(constraint.tag).decode()}
    raise ValueError(f"vllm cannot express {constraint.describe()}")


async def _kv_cache(client: httpx.AsyncClient) -> tuple[int | None, int | None]:
    """KV cache size in tokens (num_gpu_blocks x block_size) and its block size, from the labels of
    ``vllm:cache_config_info``."""
    response = await get(client, "/metrics")
    if response.status_code != 200:
        return None, None
    try:
        for _, labels, _ in exposition.samples(response.text, ("vllm:cache_config_info",)):
            blocks, size = exposition.label(labels, "num_gpu_blocks"), exposition.label(labels, "block_size")
            if blocks and size and blocks.isdecimal() and size.isdecimal() and len(blocks) + len(size) < 30:
                page = readings.positive(int(size), 1 << 20)
                return readings.positive(int(blocks) * int(size)), page
    except ValueError:
        return None, None
    return None, None


async def max_model_len(client: httpx.AsyncClient) -> int | None:
    """vLLM and SGLang list ``max_model_len`` with each model in ``/v1/models``."""
    doc: Any = await get_json(client, "/v1/models")
    data = doc.get("data") if isinstance(doc, dict) else None
    lengths = [readings.positive(item.get("max_model_len")) for item in (data if isinstance(data, list) else [])
               if isinstance(item, dict)]
    known = [length for length in lengths if length is not None]
    return min(known) if known else None
