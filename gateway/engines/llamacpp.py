"""llama.cpp ``llama-server``.

Health: ``/health`` (HTTP up but every path answers 503 "Loading model" while the model loads).
Load: ``/slots`` (``is_processing`` per slot) for running sequences and slot count; ``/metrics`` (only with
``--metrics``) for ``llamacpp:requests_deferred``. Trap: llama.cpp averages and resets its throughput gauges on
every ``/metrics`` scrape, so the gateway reads only the instantaneous gauges it needs, and an operator's
Prometheus scraping the same server sees throughput averaged since the gateway's last read.
Capacity: ``/props`` ``total_slots`` and ``default_generation_settings.n_ctx``; whether it can call tools,
``chat_template_caps.supports_tools``.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import httpx

from gateway.engines import readings
from gateway.engines.base import (
    BackendError,
    EngineAdapter,
    fetch,
    get,
    get_json,
    json_of,
    native_grammar,
    parse_metrics,
)
from gateway.engines.spec import LLAMACPP_CACHE_FIGURES, LLAMACPP_CACHE_REPORTS, RERANK_ROUTES, EngineSpec
from gateway.pool.state import Capacity, LoadRecord, ShapeSeed
from gateway.structured import Constraint
from gateway.structured.syntax import gbnf_from_choices

SPEC = EngineSpec(
    name="llamacpp",
    loading_status=503,  # "Loading model"
    # only with --metrics; read beside /slots (see read_load)
    metric_names={"running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred"},
    # GBNF natively (json_schema is compiled to GBNF by the server); no regex; choices as a GBNF alternation
    # no "beside_tools": a grammar (a choice is one) beside tools the model may call is a 400 there ("Cannot use
    # custom grammar constraints with tools.", tools/server/server-common.cpp); a schema is not
    # strict_tools: with tools it builds a lazy grammar of every tool's arguments, triggered by the call's start
    # (common/chat.cpp), so an optional call's arguments match their schema, strict or not
    structured=frozenset({"json_object", "json_schema", "choice", "grammar:gbnf", "tool_call", "strict_tools"}),
    # cpp-httplib closes the connection after a chunked (streamed) response while answering "Keep-Alive:
    # timeout=5, max=100"; a pooled connection then fails the next request ("Can not write request body")
    routes=RERANK_ROUTES,
    keeps_alive_after_stream=False,
    # it refuses only a prompt that fills a slot's context; generation stops when the context is full, whatever
    # n_predict asked (tools/server/server-context.cpp): a 12k-token prompt with max_tokens 32,000 (Claude
    # Code's every request) is served by 32k slots
    output_in_context=False,
    # /v1/messages (llama-cpp-python 0.3.36's vendored server, tools/server/server.cpp). It serves /v1/responses
    # too, but its stream events have no sequence_number, output_index or content_index, and an answer cut by
    # max_output_tokens says "completed": the OpenAI SDK's stream helper fails on it, so Responses requests are
    # translated to chat completions (as for TabbyAPI), whose answer the gateway writes in the API's shape
    native_apis=frozenset({"messages", "count_tokens"}),
    # the real llama-server takes a system message inside messages, and any thinking type (issue 42)
    native_messages=frozenset({"inline_system", "thinking:adaptive"}),
    # each slot keeps its last prompt; evicted ones go to a host-RAM prompt cache unless --cache-ram 0
    cache="slots",
    slot_field="id_slot",  # a named slot that is busy defers the request until that slot is free
    timings="timings_ms",  # timings.prompt_ms / predicted_ms in every answer and the last streamed chunk
    # no cache isolation (tools/server: no such field; cache_prompt only turns reuse off for the request itself):
    # a slot's (or the host-RAM cache's) prompt is reused by any request sharing its prefix. Its answers report
    # cache_n and the prompt's processing in timings, and return_progress streams prompt_progress.cache
    cache_figures=LLAMACPP_CACHE_FIGURES,
    cache_report_params=LLAMACPP_CACHE_REPORTS,
    # n choices (n, n_cmpl) or a list of prompts: the usage of one in the answer, a slot each (see EngineSpec)
    several_generations=False,
    # samples on the main loop: no top_k 0, no chain without top_k first, no mirostat (see EngineSpec)
    whole_vocabulary=False,
    many_parses=False,
    load_waits_for_loop=True,
    # a few slots, each decoding at full speed alone; anchored to published figures for a 7B model at ~4 bits
    # on one RTX 4090 (the curve is the engine's scheduling: slots share the GPU)
    shape=ShapeSeed(tok_s=186.0, growth=0.3, prefill_tok_s=5_000.0),
)


class LlamaCppAdapter(EngineAdapter):
    spec: ClassVar[EngineSpec] = SPEC

    def constraint_fields(self, constraint: Constraint) -> dict[str, Any]:
        if constraint.kind == "json_schema":
            return {"json_schema": constraint.schema}
        if constraint.kind == "choice":
            return {"grammar": gbnf_from_choices(list(constraint.choices))}
        if constraint.kind == "grammar":
            return {"grammar": native_grammar(constraint, ("gbnf",))}
        return super().constraint_fields(constraint)

    def __init__(self) -> None:
        # learned on first contact: a server started without --metrics / with --no-slots answers 501
        self._metrics_enabled = True
        self._slots_enabled = True

    async def read_load(self, client: httpx.AsyncClient) -> LoadRecord | None:
        running: int | None = None
        waiting: int | None = None
        prefilling = False
        tasks: frozenset[int] | None = None
        figures = readings.Figures()
        if self._slots_enabled:
            response = await get(client, "/slots")
            if response.status_code == 501:
                self._slots_enabled = False
            elif response.status_code != 200:
                raise BackendError(f"/slots answered HTTP {response.status_code}")
            else:
                slots = json_of(response, "/slots")
                if not isinstance(slots, list):
                    raise BackendError("/slots is not a list")
                running = figures.count("running", sum(1 for slot in slots if isinstance(slot, dict)
                                                       and slot.get("is_processing") is True))
                prefilling = any(_prefilling(slot) for slot in slots)
                tasks = _tasks(slots)
        if self._metrics_enabled:
            response = await get(client, "/metrics")
            if response.status_code == 501:
                self._metrics_enabled = False
            elif response.status_code != 200:
                raise BackendError(f"/metrics answered HTTP {response.status_code}")
            else:
                names = self.spec.metric_names
                values = parse_metrics(response.text, names.values())
                waiting = figures.count("waiting", values.get(names["waiting"]))
                if running is None:
                    running = figures.count("running", values.get(names["running"]))
        if running is None and waiting is None and not figures.rejected:
            return None
        return LoadRecord(running=running, waiting=waiting, kv_usage=None, read_at=time.monotonic(),
                          rejected=tuple(figures.rejected), prefilling=prefilling, tasks=tasks)

    async def measure_step(self, client: httpx.AsyncClient) -> float | None:
        # a few tokens of a one-word prompt, its end ignored, nothing cached: llama-server's own timing of them
        # (server-context.cpp: t_token_generation over n_decoded) is its loop's step with one sequence at work
        body = {"prompt": "The", "n_predict": STEP_TOKENS, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0, "stream": False}
        response = await fetch(client, "POST", "/completion", body)
        if response.status_code != 200:
            raise BackendError(f"/completion answered HTTP {response.status_code}")
        answer = json_of(response, "/completion")
        timings = answer.get("timings") if isinstance(answer, dict) else None
        if not isinstance(timings, dict):
            return None
        per_token, count = timings.get("predicted_per_token_ms"), timings.get("predicted_n")
        if (not isinstance(per_token, int | float) or isinstance(per_token, bool) or not isinstance(count, int)
                or count < 2 or not 0 < per_token < 600_000):
            return None
        return float(per_token) / 1000.0

    async def read_capacity(self, client: httpx.AsyncClient) -> Capacity:
        props: Any = await get_json(client, "/props")
        if not isinstance(props, dict):
            raise BackendError("/props is not an object")
        settings = props.get("default_generation_settings")
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        slots = readings.positive(props.get("total_slots"), readings.MAX_COUNT)
        n_ctx = readings.positive(n_ctx)
        # a model whose chat template renders no tools (chat_template_caps.supports_tools false): llama-server then
        # ignores tools and tool_choice, and a forced call comes back as text (issue 42)
        caps = props.get("chat_template_caps")
        tools = caps.get("supports_tools") if isinstance(caps, dict) else None
        # each slot caches its own last prompt: the server's prefix cache is the slots' contexts together
        return Capacity(slots=slots, context_length=n_ctx,
                        cache_tokens=readings.positive(slots * n_ctx) if slots and n_ctx else None,
                        tool_calls=tools if isinstance(tools, bool) else None)


STEP_TOKENS = 8  # tokens the loop's step alone is measured over


def _tasks(slots: list[Any]) -> frozenset[int] | None:
    """The ids of the tasks the slots are processing (``id_task``), or None where a processing slot names none."""
    found = set()
    for slot in slots:
        if isinstance(slot, dict) and slot.get("is_processing") is True:
            task = slot.get("id_task")
            if not isinstance(task, int) or isinstance(task, bool):
                return None
            found.add(task)
    return frozenset(found)


def _prefilling(slot: Any) -> bool:
    """Whether a /slots entry is a sequence reading its prompt: processing, with nothing generated yet."""
    if not isinstance(slot, dict) or slot.get("is_processing") is not True:
        return False
    nexts = slot.get("next_token")
    first = nexts[0] if isinstance(nexts, list) and nexts else None
    return isinstance(first, dict) and first.get("n_decoded") == 0
