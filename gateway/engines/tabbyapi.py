"""TabbyAPI: ExLlamaV3 at e632af4, the commit read for this adapter (its releases before also ran ExLlamaV2).

Health: ``/v1/model`` answering 200, not ``/health``: that answers 503 for good once any generation raised, even
a context overflow (its issue list is never cleared), while the server goes on serving; read as down, one bad
request would eject the backend until TabbyAPI restarts. Load: none at all, so the gateway's own in-flight
count against ``/props.total_slots`` (= the generator's ``max_batch_size``) is the load signal.
Models: ``/v1/models`` lists every model in the model directory, not what is loaded; the loaded model is
``/v1/model``. Capacity: ``/props.total_slots``, ``/v1/model`` ``parameters.max_seq_len``.
Auth: ``x-api-key``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx

from gateway.engines import readings
from gateway.engines.base import BackendError, EngineAdapter, get_json, native_grammar
from gateway.engines.spec import TABBYAPI_CACHE_FIGURES, EngineSpec, StreamQuirks
from gateway.pool.state import Capacity, LoadRecord, ShapeSeed
from gateway.structured import Constraint
from gateway.structured.syntax import regex_from_choices

SPEC = EngineSpec(
    name="tabbyapi",
    auth="x-api-key",
    health_path="/v1/model",  # (see the module's docstring)
    chat_tokenize_path="/v1/token/encode",  # count_tokens, counted through the model's template (no tools)
    cache_page_tokens=256,  # ExLlamaV2/V3 cache pages: a prefix is reused 256 tokens at a time
    # json_schema, regex_pattern, grammar_string (GBNF with ::=, else Lark). It IGNORES response_format
    # json_object, so that becomes json_schema {"type": "object"}. No tool-call enforcement.
    structured=frozenset({"json_object", "json_schema", "regex", "choice", "grammar:gbnf", "grammar:lark",
                          "beside_tools"}),
    # sse-starlette writes "\r\n"; the usage chunk also carries the last choices entry
    stream=StreamQuirks(crlf=True, usage_with_choices=True),
    timings="usage_seconds",  # usage.prompt_time / completion_time
    # no cache isolation (no such request field); ExLlama reuses cached pages across requests, which shortens
    # usage.prompt_time (and total_time)
    cache_figures=TABBYAPI_CACHE_FIGURES,
    # ExLlamaV2/V3: fastest alone; per-token time grows almost linearly with the batch
    shape=ShapeSeed(tok_s=211.0, growth=0.9, prefill_tok_s=8_000.0),
)


class TabbyAPIAdapter(EngineAdapter):
    spec: ClassVar[EngineSpec] = SPEC

    def prepare_body(self, route: str, body: dict[str, Any], constraint: Constraint | None = None) -> dict[str, Any]:
        body = super().prepare_body(route, body, constraint)
        if route in ("chat", "completions") and body.get("stream") is not True:
            # since its rework of 2026-03-30 a non-streamed answer carries usage only when asked for it
            # (stream_options is accepted without stream there; vLLM refuses it, so this is TabbyAPI's alone)
            options = body.get("stream_options")
            body["stream_options"] = {**options, "include_usage": True} if isinstance(options, dict) else {
                "include_usage": True}
        return body

    def constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        kind = constraint.kind
        if kind == "json_object":
            return {"json_schema": {"type": "object"}}
        if kind == "json_schema":
            return {"json_schema": constraint.schema}
        if kind == "regex":
            return {"regex_pattern": constraint.pattern}
        if kind == "choice":
            return {"regex_pattern": regex_from_choices(list(constraint.choices))}
        if kind == "grammar":
            return {"grammar_string": native_grammar(constraint, ("gbnf", "lark"))}
        return super().constraint_fields(constraint)

    async def read_load(self, client: httpx.AsyncClient) -> LoadRecord | None:
        return None

    async def list_models(self, client: httpx.AsyncClient) -> list[str]:
        card: Any = await get_json(client, "/v1/model")
        name = readings.model_name(card.get("id")) if isinstance(card, dict) else None
        if name is None:
            raise BackendError("/v1/model names no loaded model")
        return [name]

    async def read_capacity(self, client: httpx.AsyncClient) -> Capacity:
        props: Any = await get_json(client, "/props")
        card: Any = await get_json(client, "/v1/model")
        slots = props.get("total_slots") if isinstance(props, dict) else None
        params = card.get("parameters") if isinstance(card, dict) else None
        max_seq_len = params.get("max_seq_len") if isinstance(params, dict) else None
        cache_size = params.get("cache_size") if isinstance(params, dict) else None
        return Capacity(
            slots=readings.positive(slots, readings.MAX_COUNT),
            context_length=readings.positive(max_seq_len),
            cache_tokens=readings.positive(cache_size),
        )
