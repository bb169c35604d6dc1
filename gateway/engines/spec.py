"""What the gateway knows about one kind of engine, as data: :class:`EngineSpec`.

Each engine module (``gateway/engines/<engine>.py``) holds its spec next to the adapter class that reads the
engine's signals (the part that is code: parsing ``/slots``, ``/v1/loads``, ``/props``). Everything else
reads the spec's fields and flags, never an engine's name: the pool (paths, auth, slots, retries), routing
(routes served, structured-output support, shape seed), the stream relay (stream quirks) and accounting
(where engine-reported timings live).

This module is a leaf: it imports no HTTP client, so routing and the pool can hold specs without loading one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from gateway.pool.state import NEUTRAL_SHAPE, ShapeSeed

# the OpenAI routes the gateway serves; an engine lists those it serves (routing skips it for the others)
OPENAI_ROUTES: frozenset[str] = frozenset({"chat", "completions", "embeddings"})
# ... and those with a rerank endpoint (/v1/rerank: llama.cpp with a reranking model, vLLM, SGLang)
RERANK_ROUTES: frozenset[str] = OPENAI_ROUTES | {"rerank"}

# statuses worth sending to another backend (nothing was generated): back-pressure and server errors
RETRY_STATUSES: frozenset[int] = frozenset({429, 500, 502, 503, 504})

# Where an engine reports its own prompt-processing and generation times in an answer:
# "timings_ms": ``timings.prompt_ms`` / ``timings.predicted_ms`` (milliseconds);
# "usage_seconds": ``usage.prompt_time`` / ``usage.completion_time`` (seconds);
# None: nowhere (the gateway's clock is all there is).
TimingSource = Literal["timings_ms", "usage_seconds"]


@dataclass(frozen=True, slots=True)
class StreamQuirks:
    """How an engine's server-sent events depart from OpenAI's. The relay honours a quirk only where the
    flag says the engine has it; an engine of unknown make (``openai``) is given every flag."""

    crlf: bool = False  # lines end in "\r\n", normalised to "\n"
    usage_with_choices: bool = False  # the usage chunk also carries a choices entry, split into two chunks


ALL_QUIRKS = StreamQuirks(crlf=True, usage_with_choices=True)

# Where answers report what the engine's prefix cache spared this prompt: cached tokens, and the prompt's measured
# processing (which a cache hit shortens). Paths into the answer (and into a streamed chunk), outermost first.
CACHED_TOKENS: tuple[str, ...] = ("usage", "prompt_tokens_details", "cached_tokens")
LLAMACPP_CACHE_FIGURES: tuple[tuple[str, ...], ...] = (
    CACHED_TOKENS, ("timings", "cache_n"), ("timings", "prompt_n"), ("timings", "prompt_ms"),
    ("timings", "prompt_per_token_ms"), ("timings", "prompt_per_second"), ("__verbose",), ("prompt_progress",))
# request fields that make llama.cpp report its cache as it goes: ``verbose`` (``__verbose``: ``tokens_cached``
# and the prompt's timings, in the answer or the first chunk), ``return_progress`` (``prompt_progress.cache``),
# ``timings_per_token`` (timings in every chunk) and ``response_fields`` (which picks fields of ``__verbose``)
LLAMACPP_CACHE_REPORTS = frozenset({"verbose", "return_progress", "timings_per_token", "response_fields"})
TABBYAPI_CACHE_FIGURES: tuple[tuple[str, ...], ...] = (
    CACHED_TOKENS, ("usage", "prompt_time"), ("usage", "prompt_tokens_per_sec"), ("usage", "total_time"))
ALL_CACHE_FIGURES = tuple(dict.fromkeys(LLAMACPP_CACHE_FIGURES + TABBYAPI_CACHE_FIGURES))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine kind. Only ``name`` is required: the defaults describe a plain OpenAI-compatible server."""

    name: str
    # control plane
    health_path: str = "/health"
    loading_status: int | None = None  # what the health path answers while the model loads (LOADING)
    models_path: str = "/v1/models"
    # normalised field (running, waiting, kv_usage, queue_histogram) -> the engine's Prometheus metric name
    metric_names: Mapping[str, str] = field(default_factory=dict)
    default_slots: int | None = None  # concurrent sequences assumed when the engine does not say
    auth: Literal["bearer", "x-api-key"] = "bearer"  # how it takes its API key
    # data plane
    routes: frozenset[str] = OPENAI_ROUTES
    # agent APIs it serves itself ("responses": /v1/responses, "messages": /v1/messages, "count_tokens":
    # /v1/messages/count_tokens), passed through to it as the client sent them; for the other engines the
    # gateway translates them to chat completions (count_tokens: see chat_tokenize_path)
    native_apis: frozenset[str] = frozenset()
    # what its own /v1/messages accepts beyond plain user/assistant turns: "inline_system" (a {"role": "system"}
    # message inside messages, Claude Code's mid-conversation-system beta) and "thinking:adaptive"; a Messages
    # request using one it lacks takes the translated path (the gateway's own translation handles both; see
    # gateway.api.agent_apis._messages_features for the features no engine takes)
    native_messages: frozenset[str] = frozenset()
    # where it tokenizes chat messages through the model's own template, for an engine that does not serve
    # count_tokens itself (TabbyAPI's /v1/token/encode: {"text": [messages], "add_bos_token"} -> {"tokens",
    # "length"}); the gateway answers count_tokens from it (gateway.api.translate.count_tokens)
    chat_tokenize_path: str | None = None
    # False: the server closes its connection after a streamed answer although it announces keep-alive, so
    # the gateway asks for "Connection: close" on streamed requests instead of pooling a connection it closes
    keeps_alive_after_stream: bool = True
    retry_statuses: frozenset[int] = RETRY_STATUSES
    # its context must hold the prompt plus max_tokens, else it refuses the request (vLLM, SGLang: max_model_len);
    # False: only the prompt must fit, and generation stops when the context is full (llama.cpp)
    output_in_context: bool = True
    # structured-output constraints it honours natively (see gateway.structured.support); grammar:<dialect>
    structured: frozenset[str] = frozenset({"json_object", "json_schema", "tool_call", "strict_tools"})
    # how its prefix cache holds prompts: "blocks" (an LRU of token blocks: vLLM, SGLang's radix tree, ExLlama's
    # pages) or "slots" (one prompt per slot: llama.cpp without its host-RAM prompt cache, see
    # gateway/routing/slot_index.py)
    cache: Literal["blocks", "slots"] = "blocks"
    slot_field: str | None = None  # the request field that names the slot to run in (caches by slot only)
    cache_page_tokens: int = 1  # "blocks": a prefix is reused in whole pages of this many tokens
    kv_events: bool = False  # publishes its KV-cache events (ZMQ + msgpack; see gateway.kvcache.wire)
    # Keeping tenants apart in its prefix cache (gateway.proxy.cache_isolation): the request field whose value
    # partitions the cache (a salt mixed into the first block's hash, so a prefix cached under one salt is never
    # reused under another), on chat and completions and on the native agent APIs in ``isolated_native_apis``;
    # None: any request reuses whatever any other cached.
    cache_isolation: str | None = None
    isolated_native_apis: frozenset[str] = frozenset()
    # what its answers report of the prefix cache's work (removed from an engine's answers that could reveal
    # another cache domain's prompt), and request fields that ask for more such reports as it goes (not sent then)
    cache_figures: tuple[tuple[str, ...], ...] = (CACHED_TOKENS,)
    cache_report_params: frozenset[str] = frozenset()
    # whether it can take a request of several generations (n choices, a completions list of prompts) and both
    # report their usage in all and schedule each as the sequence it is: llama.cpp answers such a request with one
    # choice's (one prompt's) usage and runs each in a slot of its own, so the gateway could neither charge nor
    # count it (a key ran 8x to ~490x its token budget and took every slot as one request: sweep 19)
    several_generations: bool = True
    # whether it may take a request whose sampling sorts the whole vocabulary at every token (top_k 0, a sampler
    # chain without top_k first, mirostat): llama.cpp samples each slot's token on the main loop all slots share,
    # so one such request held every other's stream to an eighth of its pace with a 128k vocabulary (sweep 21)
    whole_vocabulary: bool = True
    # whether it may take a request whose grammar (a constraint's, or one compiled from its tools' parameters) would
    # have its parse go many ways at once (RouteRequest.fanout): llama.cpp checks every candidate token against each
    # way at every token, on the main loop, and `root ::= s+` with 60 alternatives of a's held 1,831 of them: 649 ms
    # a token with a 128k vocabulary, every other slot's stream stopped (sweep 22)
    many_parses: bool = True
    # whether its load reading (/metrics) is answered by the loop that generates, between two of its steps
    # (llama.cpp posts the read as a task to its one loop): how long the reading takes beyond its health check,
    # answered by the HTTP thread alone, is how long that loop's step takes (gateway.proxy.stall_guard)
    load_waits_for_loop: bool = False
    # with priority scheduling on, the request field "priority" orders its queue, this way by default (None:
    # the engine has no such field)
    priority_order: Literal["lower-first", "higher-first"] | None = None
    stream: StreamQuirks = StreamQuirks()
    timings: TimingSource | None = None
    # routing: its performance shape before anything is measured
    shape: ShapeSeed = NEUTRAL_SHAPE

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        if not api_key:
            return {}
        return {"x-api-key": api_key} if self.auth == "x-api-key" else {"Authorization": f"Bearer {api_key}"}
