"""The record of one proxied request, filled in as it goes and handed to telemetry at the end."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

from gateway.auth import Client
from gateway.engines.readings import usage_figure, usage_tokens
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.proxy.admission import Placement
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.state.shared import Budget
from gateway.telemetry.request_metrics import ITL_BUCKETS
from gateway.telemetry.tracing import RequestTrace

_ITL_SLOTS = len(ITL_BUCKETS) + 1  # the inter-token histogram's buckets, +Inf last


# tokens a chat template may add of its own to any prompt (a default system prompt, tool instructions)
TEMPLATE_TOKENS = 1024
BYTES_PER_TOKEN = 4  # the gateway's own estimate of a text's tokens, where no engine counted them: ASCII's
_ASCII = bytes(range(128))


def rerank_rereads(body: dict[str, Any]) -> int:
    """Bytes a rerank's engine reads beyond its body's: the query again with each document after the first."""
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list):
        return 0
    return len(query.encode("utf-8", "surrogatepass")) * max(0, len(documents) - 1)


def estimate_tokens(text: str | bytes) -> int:
    """The gateway's own count of ``text``'s tokens, where no engine counted them: ``BYTES_PER_TOKEN`` bytes of
    ASCII a token, and a token for every byte of any other character. An engine whose vocabulary falls back to
    bytes (Llama 2's, Mistral's) counts a rare character's every UTF-8 byte as a token: a prompt of 4-byte
    characters cost the engine four tokens for each one its key was charged (a stream cut before its usage is
    charged this count; sweep 16)."""
    if text.isascii():
        return len(text) // BYTES_PER_TOKEN
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    other = len(data.translate(None, _ASCII))
    return (len(data) - other) // BYTES_PER_TOKEN + other


# the most tokens one streamed text event carries: llama.cpp holds a character's bytes back and sends it whole, a
# 4-byte character's 4 byte tokens at once (SGLang's --stream-interval and speculative decoding may pack more: an
# engine that does not say its usage is counted by this)
MAX_TOKENS_PER_EVENT = 4


@dataclass(slots=True)
class Exchange:
    request_id: str
    route: str
    t_start: float  # time.perf_counter() when the request arrived
    model: str | None = None
    fallback: str | None = None  # "asked -> served (why)" when a fallback model served it
    stream: bool = False
    backend: Backend | None = None
    request: RouteRequest | None = None
    concurrency: int = 1  # sequences on the backend when sent, this one included
    status: int = 0
    responded: bool = False  # the response has started; errors can no longer change its status
    hops: int = 0  # gateways this request came through on its way here (HOPS_HEADER)
    outcome: str = "pending"  # success | client_error | shed | upstream_error | no_backend | disconnected | ...
    t_dispatch: float | None = None  # sent to the backend (the last attempt)
    t_first_text: float | None = None  # first event carrying generated text forwarded (streams)
    t_last_text: float | None = None
    text_events: int = 0
    # Gaps between forwarded blocks carrying text, already sorted into the inter-token latency histogram's
    # buckets (``ITL_BUCKETS``, +Inf last) and summed, for the metrics to add in one go at the end; a block
    # carrying several text events adds zero gaps for the others (no gap seen by the client). None until the
    # first text.
    gap_counts: list[int] | None = None
    gap_sum: float = 0.0
    t_end: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None  # llama.cpp per-request timings
    invalid_output: str | None = None  # why the answer failed its structured-output check
    output_unchecked: str | None = None  # why the answer was not checked against its constraint
    output_retried: bool = False  # an answer failed its check and was asked again (once: validate_outputs retry)
    discarded_tokens: int = 0  # tokens of answers generated and then discarded (retried): charged with the last
    trace: RequestTrace | None = None  # the request's spans, when tracing is on
    route_reason: str | None = None
    explain: bool = False  # the answer carries the routing internals (an admin asked: KeyStore.explains_routing)
    client: Client | None = None  # the gateway API key it came with, when keys are configured
    reserved_tokens: int = 0  # taken from the key's tokens per minute on admission, settled at the end
    reserve: int = 0  # the tokens its key's admission reserves (or would have), estimated on arrival
    body_tokens: int = 0  # of which its body's (and stored conversation's) estimate
    # its body's and stored conversation's bytes: the most tokens its prompt can be to any engine (a token is at
    # least a byte, or a byte's fallback; a template's few words per message fit in the JSON around them)
    body_bytes: int = 0
    failed_over: int = 0  # backends that read its prompt and were failed over from (each is charged that prompt)
    max_answer_tokens: int = 131_072  # the most tokens one answer may be (limits.max_tokens, set on arrival)
    engines_lost: int = 0  # backends that stopped answering after an attempt of it (see Dispatcher._attempt)
    rereads: int = 0  # bytes an engine reads beyond the body: a rerank's query again, with each later document
    # with shared state: the key's budget, admitted on arrival (gateway.state), and the backend whose shared slot
    # this request holds (taken after routing)
    budget: Budget | None = None
    shared_slot: str | None = None
    held_locally: bool = False  # it holds one of its key's max_in_flight places in this process
    key_place: str | None = None  # "shared": it holds one of its key's max_in_flight places in the shared state
    placement: Placement | None = None  # its priority, weight and longest wait in admission (default: anonymous)

    def saw_text(self, events: int, now: float) -> None:
        """A forwarded block carried ``events`` events with generated text, at ``now`` (perf_counter)."""
        last = self.t_last_text
        if last is None:
            self.t_first_text = now
            counts = self.gap_counts = [0] * _ITL_SLOTS
        else:
            gap = now - last
            counts = self.gap_counts  # type: ignore[assignment]  # set with the first text
            counts[bisect_left(ITL_BUCKETS, gap)] += 1  # the first bucket whose bound is >= the gap (``le``)
            self.gap_sum += gap
        if events > 1:
            counts[0] += events - 1
        self.t_last_text = now
        self.text_events += events

    def answer_tokens(self) -> int:
        """What the (last) answer cost: the engine's usage where its prompt and completion figures are both
        readings (``readings.usage_figure``: a whole number in [0, MAX_USAGE_TOKENS]; a pooling answer says no
        completion), else the gateway's own estimate (:meth:`estimated_tokens`). Garbage is no reading: held to
        zero, ``prompt_tokens: -1000000`` refilled the bucket and ``"12"`` or ``1e30`` cost nothing. Nothing
        when no backend was reached."""
        usage = self.usage
        if usage:
            prompt = usage_figure(usage.get("prompt_tokens"))
            completion = usage.get("completion_tokens")
            completion = 0 if completion is None and self.route in POOLING_ROUTES else usage_figure(completion)
            if prompt is not None and completion is not None and self._could_cost(prompt, completion):
                return prompt + completion
        if self.backend is None or self.request is None:
            return 0
        return self.estimated_tokens(self.request)

    def _could_cost(self, prompt: int, completion: int) -> bool:
        """Whether usage figures are ones the request could have cost: a prompt within twice its bound
        (:meth:`prompt_bound`) and a template's default prompt, a completion within ``max_tokens`` (else the
        backend's context) for each generation and at least half the text events relayed. An engine answering a
        5-token request with 134 million tokens of usage put its key 4.5 hours in debt (sweep 22): such figures
        are no reading."""
        request, backend = self.request, self.backend
        if request is None or backend is None:
            return True
        if prompt > self._prompt_cap():
            return False
        # (without max_tokens, the backend's context, and never past the most a request may ask for: a context is
        # what the engine lists, and an openai backend lists none, sweep 23)
        per_generation = min(request.max_tokens or backend.capacity.context_length or self.max_answer_tokens,
                             self.max_answer_tokens)
        # (and no fewer than half the text events it relayed, each a token or more: an engine reporting 1 for
        # streams of 2,000 let a key take 415x its tokens per minute, sweep 24; half, as a reasoning parser may
        # split one token's text in two events)
        return self.text_events <= 2 * completion + 2 and completion <= (per_generation + 1) * request.generations

    def _prompt_cap(self) -> int:
        return 2 * self.prompt_bound() + TEMPLATE_TOKENS

    def prompt_bound(self) -> int:
        """The most its prompt may have cost the engine, where the engine did not say: its body's bytes (documents
        and template arguments, which the rendering leaves out, included), else the estimates. An estimate is
        what text usually costs; a prompt made to cost more (digits, which Llama 2's and Mistral's tokenizers
        split one to a token; rare characters, a token per byte) cut before its usage cost the engine four
        times what its key was charged (sweeps 16, 17): a request the engine did not count pays the bound. A
        rerank's engine reads its query again with each document: a client gone before the answer of 200
        documents paid 1/215 of the engine's work (sweep 18)."""
        request = self.request
        rendered = estimate_tokens(request.prompt) if request is not None and request.route not in POOLING_ROUTES else 0
        return max(self.body_bytes + self.rereads, self.body_tokens, rendered)

    def estimated_tokens(self, request: RouteRequest) -> int:
        """The gateway's own count of a request whose engine said no usable usage (none, a stream cut before its
        usage chunk, the client gone before the answer, garbage): a pooling request's inputs as reserved on
        arrival (its prompt is not rendered); else its prompt's bound (:meth:`prompt_bound`) plus
        :data:`MAX_TOKENS_PER_EVENT` tokens per generated-text event relayed, and at least what its key reserved
        on arrival: a whole answer's output is
        not counted on the way, and an event may carry several tokens (llama.cpp holds a character's bytes back
        and sends it whole, 4 byte tokens in one event; SGLang's --stream-interval, speculative decoding), so a
        stream cut before its usage paid a quarter of its tokens (sweep 24). Never less than one token."""
        if request.route in POOLING_ROUTES:  # (inputs, documents and the query read with each: all bound)
            return max(self.reserve, self.prompt_bound())
        # (MAX_TOKENS_PER_EVENT a text event: without max_tokens the reservation is auth.reserve_tokens while
        # llama.cpp generates to the context's end, and a stream of 1,000 emoji events cut before its usage paid
        # ~1,139 tokens for 4,000, sweep 25)
        bound = max(1, self.prompt_bound() + MAX_TOKENS_PER_EVENT * self.text_events, self.reserve)
        if self.outcome != "success":
            # a whole answer without a bound that ended without the engine's count (an engine error after it wrote,
            # a timeout): nothing of it was counted on the way, and it may have written to its context's end. A
            # json_schema of long strings made llama-server write ~6,000 tokens and answer 500: charged ~1,100, a
            # key had 5.7x its tokens per minute generated, sustained (sweep 28)
            bound = max(bound, self._unbounded_context())
        return bound

    def _unbounded_context(self) -> int:
        """What a whole answer without max_tokens may have cost its engine, unseen: its backend's context for each
        generation (0 for any other request, or where the context is not known)."""
        request, backend = self.request, self.backend
        if (request is None or self.stream or request.max_tokens is not None or backend is None
                or not backend.capacity.context_length):
            return 0
        return backend.capacity.context_length * max(1, request.generations)

    def failed_over_tokens(self) -> int:
        """What the backends it was failed over from read: its prompt each, as the engine that answered counted
        it (its usage), else its bound."""
        if not self.failed_over:
            return 0
        prompt = usage_figure((self.usage or {}).get("prompt_tokens"))
        if prompt is not None and prompt > self._prompt_cap():
            prompt = None  # (a figure the prompt could not cost, times every backend failed over from: sweep 23)
        # (an unbounded whole answer: each engine failed over from may have written to its context's end before it
        # failed, 6.2x a key's tokens per minute through two llama-servers, sweep 28)
        each = max(1, prompt if prompt is not None else self.prompt_bound(), self._unbounded_context())
        return self.failed_over * each

    def usage_int(self, key: str) -> int:
        """A figure of the engine's usage as accounting takes it (never negative, never absurdly large: see
        ``readings.usage_tokens``); 0 when it did not say."""
        return usage_tokens((self.usage or {}).get(key))

    def reported_cached_tokens(self) -> int | None:
        """Prompt tokens the engine says it served from its cache (OpenAI usage details, or llama.cpp's
        ``timings.cache_n``), held like any usage figure; None when it did not say."""
        details = (self.usage or {}).get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and not isinstance(cached, bool):
            return usage_tokens(cached)
        cache_n = (self.timings or {}).get("cache_n")
        return usage_tokens(cache_n) if isinstance(cache_n, int) and not isinstance(cache_n, bool) else None

    def reasoning_tokens(self) -> int:
        """Completion tokens spent reasoning, where the engine says (0 where it does not)."""
        usage = self.usage
        if not usage:
            return 0
        details = usage.get("completion_tokens_details")
        return usage_tokens(details.get("reasoning_tokens") if isinstance(details, dict) else usage.get(
            "reasoning_tokens"))

    def cached_tokens(self) -> int:
        return self.reported_cached_tokens() or 0


# A request the gateway sends a backend says how many gateways it came through; one that comes back through more
# than MAX_HOPS is refused (508): a backend URL naming the gateway itself (a port or service-name slip) sent each
# request round ~10,000 times, 7,186 connections and 280 MB for one client request, sweep 27.
HOPS_HEADER = b"x-gateway-hops"
MAX_HOPS = 4


def hops(value: bytes | None) -> int:
    """The gateways a request says it came through (0 when it does not say, or says it badly); GatewayError 508
    past MAX_HOPS."""
    if value is None or not value.isdigit() or len(value) > 3:
        return 0
    count = int(value)
    if count > MAX_HOPS:
        raise GatewayError(508, f"this request came through {count} gateways: a backend's URL leads back to a "
                                "gateway (a loop)", code="loop_detected")
    return count
