"""What routing knows about a request, and what it learns when one finishes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.pool.backend import Backend
from gateway.routing.cache_domain import SHARED, CacheDomain
from gateway.routing.prompt import BLOCK_BYTES, BlockKey, block_hashes, render
from gateway.structured import Constraint

# tokens to plan for when a request sets no max_tokens
DEFAULT_MAX_TOKENS = 256
# routes that run the model over their inputs and generate nothing: no prompt cached, no context to plan
POOLING_ROUTES = frozenset({"embeddings", "rerank"})


@dataclass(slots=True)
class RouteRequest:
    route: str  # "chat" | "completions" | "embeddings" | "rerank"
    model: str
    stream: bool
    max_tokens: int | None
    body: dict[str, Any]  # the parsed request, for plugins that need the prompt
    session_key: str | None = None  # from the session header or the body's "user"
    constraint: Constraint | None = None  # structured-output constraint, in whatever field it came
    generations: int = 1  # sequences the engine generates for it: choices (n, best_of, n_cmpl) times prompts
    # the field by which llama.cpp's sampling would sort the whole vocabulary at every token (top_k, samplers,
    # mirostat: gateway.api.validation.whole_vocabulary), if any
    whole_vocabulary: str | None = None
    # why llama.cpp should not take it: its constraint's or tools' grammar would go too many ways at once there
    # (Constraint.fanout: gateway.structured.syntax.parses, checks.schema_fanout), if so
    fanout: str | None = None
    # why engines that run every request on one loop (llama.cpp) may not take it now, and for how many seconds more:
    # it, or its key's request, has a grammar that stalled such a loop (gateway.proxy.stall_guard), if so
    stalled: tuple[str, float] | None = None
    # the tools' parameter schemas were too much to check on the event loop: a worker checks them (validate_heavy)
    tools_pending: bool = False
    # whose cached prompts it may profit from (its key's; set by the front door before anything is routed)
    cache_domain: CacheDomain = SHARED
    _prompt: bytes | None = field(default=None, repr=False)
    _blocks: list[BlockKey] | None = field(default=None, repr=False)
    # left by plugins for later stages (typed; add a field here for new data passed between plugins):
    estimated_tokens: int | None = None  # fits-context: prompt estimate + max_tokens (its error message)
    predicted_cached_blocks: int | None = None  # prefix learner: blocks predicted cached where it went
    predicted_cached_tokens: int | None = None  # the same in tokens (bytes per token as learned), for metrics
    cached_on: Backend | None = None  # prefix learner: the backend whose cache index holds its placement
    engine_slot: int | None = None  # prefix learner: the slot of ``cached_on`` to name in the request, if any
    token_ids: list[int] | None = None  # precise-prefix: the prompt as the model's token ids (if tokenized)
    tokenized: bool = False  # precise-prefix: tokenizing was tried (token_ids None: no tokenizer, or refused)
    # precise-prefix: own keys of token_ids, per chunk size and cache salt
    chunk_keys: dict[tuple[int, str | None], list[bytes]] | None = None
    events_cached_tokens: int | None = None  # precise-prefix: tokens the engine's events say it holds there
    # an agent API request (Responses, Messages) translated to this chat request: it decides, per backend,
    # whether to pass the client's own request through instead (gateway.api.agent_apis.Translation.native)
    agent: Any = None
    requested: str | None = None  # the name the client asked for, when an alias or a fallback changed ``model``

    def retarget(self, model: str) -> None:
        """Send the request to another served model (an alias's target, a fallback): its body names it, and
        what was derived from the model name is derived again."""
        if self.requested is None:
            self.requested = self.model
        self.model = model
        self.body["model"] = model
        self._blocks = None
        self.token_ids = None
        self.tokenized = False
        self.chunk_keys = None
        self.estimated_tokens = None
        self.events_cached_tokens = None

    @property
    def prompt(self) -> bytes:
        if self._prompt is None:
            self._prompt = render(self.route, self.body)
        return self._prompt

    @property
    def blocks(self) -> list[BlockKey]:
        """Chained block keys of the canonical prompt, seeded with the model and the cache domain (computed once,
        on first use): one domain's prompts never match another's in the gateway's prefix indexes."""
        if self._blocks is None:
            self._blocks = block_hashes(self.cache_domain.seed(self.model), self.prompt, BLOCK_BYTES)
        return self._blocks

    @property
    def engine_salt(self) -> str | None:
        """The ``cache_salt`` an engine that isolates by one gets for this request (see
        :meth:`CacheDomain.engine_salt`)."""
        return self.cache_domain.engine_salt(self.body.get("cache_salt"))

    @property
    def planned_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


@dataclass(slots=True)
class Outcome:
    """A finished request as routing plugins learn from it. Times in seconds; None when not known."""

    request: RouteRequest
    backend: str
    concurrency: int  # sequences on the backend when it was sent, itself included
    ok: bool
    ttft: float | None = None
    decode_seconds: float | None = None  # first token to last
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # as the engine reported it
