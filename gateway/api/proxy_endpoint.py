"""The OpenAI generation routes as one raw ASGI endpoint: authenticate, read, the key's checks, validate,
dispatch, account.

The order is the point: everything a request costs the gateway beyond reading its body and decoding its JSON
(translating an agent API, validating the body, checking a constraint in a worker process, routing) comes after
its key's cheap checks: the key itself, its model allow-list, its ``max_in_flight`` and its rate limits. A key
that may not use the model, or has no budget left, is refused before any of that work is done for it.

Raw ASGI rather than a framework response: on our machines a framework's streaming response cost 2-3x the
added latency of a raw path (../shared/PERFORMANCE.md).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from random import getrandbits
from typing import Any

from gateway.api.agent_apis import AgentApi
from gateway.api.body_head import SMALL_BODY, BodyHead, check_containers, check_same, head_of
from gateway.api.validation import decode_body, parse_body, validate_heavy
from gateway.asgi import BODY_WRITER, Headers, Receive, Scope, Send, header, send_body
from gateway.auth import ANONYMOUS, Client, KeyStore
from gateway.config import LimitSettings, Settings
from gateway.errors import GatewayError
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.exchange import BYTES_PER_TOKEN, HOPS_HEADER, Exchange, estimate_tokens, hops, rerank_rereads
from gateway.routing.request import POOLING_ROUTES
from gateway.server_protocol import ARRIVAL
from gateway.state.shared import Budget, SharedState, StateUnavailable
from gateway.structured.offload import ValidationWorkers
from gateway.telemetry.request_metrics import RequestMetrics
from gateway.telemetry.tracing import RequestTrace, Tracing

log = logging.getLogger("gateway.proxy")


class _ClientGone(Exception):
    pass


def request_id(scope: Scope) -> str:
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.decode().isprintable():
        return given.decode()
    return f"{getrandbits(96):024x}"  # unique enough for a request id, without a system call


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, f"request body is larger than the gateway's limit of {limit} bytes",
                           code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"request body is larger than the gateway's limit of {limit} bytes",
                               code="request_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _user_session(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    return _bounded_session(f"user:{user}") if isinstance(user, str) and user else None


# Session keys are kept (100,000 of them, and in Redis with shared state): a longer one is kept as its digest.
# QA pinned 88 MiB with 20 requests carrying distinct 4 MB "user" values. Shorter keys stay as they are, so
# the sessions (and alias splits) of ordinary ids do not move.
MAX_SESSION_KEY = 128


def _bounded_session(key: str) -> str:
    if len(key) <= MAX_SESSION_KEY:
        return key
    return "blake2b:" + hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


# bytes per prompt token when reserving a key's tokens: typical English tokenizes at ~4 bytes per token; the
# reservation counts the whole body (prompt, inputs, documents, tools), as it comes, before anything is parsed
_NOTHING_GENERATED = POOLING_ROUTES | {"count_tokens"}


def reservation(route: str, body_tokens: int, head: BodyHead, reserve_tokens: int, limits: LimitSettings,
                history: int = 0) -> int:
    """Tokens a request reserves of its key's tokens per minute on arrival, from its head (read before the
    body is decoded or validated): its body's estimate (``estimate_tokens`` of its bytes: every prompt, input
    and document in it) and the ``history`` bytes of the stored conversation it continues, plus, for each choice it asks
    for (``n``, ``best_of``) of each prompt it sends, what it may generate (``max_tokens`` or its spelling,
    else ``reserve_tokens``); a pooling route generates nothing. Settled against the engine's usage at the
    end. Counts past the limits count as the limits (such a request is refused before it is sent)."""
    prompt = body_tokens + history // BYTES_PER_TOKEN
    if route in _NOTHING_GENERATED:
        return prompt
    output = min(head.output or reserve_tokens, limits.max_tokens)
    return prompt + min(head.choices, limits.max_n) * min(head.prompts, limits.max_inputs) * output


# the gateway's own refusals for want of capacity (not the client's fault): outcome "shed", which the error-rate
# alert counts, where "client_error" would hide a gateway refusing most of its traffic
SHED_CODES = frozenset({"queue_full", "queue_deadline", "queue_timeout", "backends_at_capacity"})


def _tokens_used(exchange: Exchange) -> int:
    """What a finished request is charged against its key's tokens per minute: its answer
    (:meth:`Exchange.answer_tokens`), and the answers generated and discarded on the way (an answer that failed its
    check and was asked again, a prompt read by a backend failed over from). Nothing when no backend was reached."""
    return exchange.discarded_tokens + exchange.failed_over_tokens() + exchange.answer_tokens()


@dataclass(frozen=True, slots=True)
class EndpointSettings:
    """What the endpoint reads of the configuration."""

    max_body_bytes: int
    limits: LimitSettings
    session_header: bytes  # lower-case
    reserve_tokens: int  # a key's tokens reserved for a request without max_tokens

    @classmethod
    def of(cls, settings: Settings) -> EndpointSettings:
        return cls(settings.server.max_body_bytes, settings.limits, settings.routing.session_header.lower().encode(),
                   settings.auth.reserve_tokens)


class ProxyEndpoint:
    """One generation route. ``finish`` is called once per request, after its last byte (accounting).

    With ``api`` (an agent API: Responses, Messages) the request is translated to a chat completions request
    on arrival and the answer back on its way out; ``route`` is then the API's name, for the metrics."""

    def __init__(self, route: str, settings: EndpointSettings, *, keys: KeyStore, workers: ValidationWorkers,
                 dispatcher: Dispatcher, tracing: Tracing, live: RequestMetrics,
                 finish: Callable[[Exchange], None], api: AgentApi | None = None,
                 shared: SharedState | None = None) -> None:
        self._route = route
        self._shared = shared  # with it, a key's limits live there
        self._api = api
        self._settings = settings
        self._keys = keys
        self._workers = workers
        self._dispatcher = dispatcher
        self._tracing = tracing
        self._live = live  # (its in_flight count)
        self._finish = finish

    def reconfigure(self, settings: EndpointSettings) -> None:
        """Reloaded settings, for the requests that arrive from now on."""
        self._settings = settings

    async def _admit_key(self, exchange: Exchange, client: Client, head: BodyHead, raw: bytes) -> int:
        """The key's checks, before its request's body is decoded: its model allow-list, then its requests and
        tokens per minute (in this process, or in the shared state with its ``max_in_flight`` there). Raises
        403 / 429 (503 with shared limits down and ``on_failure: closed``); what it takes is on ``exchange``,
        given back in ``__call__``'s ``finally``. Returns the bytes of stored conversation reserved for (see
        :meth:`_reserve_history`)."""
        KeyStore.check_model(client, head.model)
        limits = client.settings
        settings = self._settings
        history = 0
        if limits.tokens_per_minute:
            history = self._api.history_bytes(client.name, head.previous) if self._api is not None else 0
            body_tokens = estimate_tokens(raw)  # (counted only for a key with a token budget)
            exchange.reserve = reservation(self._route, body_tokens, head, settings.reserve_tokens, settings.limits,
                                           history)
            exchange.body_tokens = body_tokens + history // BYTES_PER_TOKEN
            exchange.body_bytes = len(raw) + history
            exchange.max_answer_tokens = settings.limits.max_tokens
        reserve = exchange.reserve
        shared = self._shared
        if shared is None:
            exchange.reserved_tokens = KeyStore.admit(client, head.model, reserve)
            return history
        if not (limits.requests_per_minute or limits.tokens_per_minute or limits.max_in_flight):
            return history
        budget = exchange.budget = Budget(client.name, limits.requests_per_minute, limits.tokens_per_minute,
                                          limits.max_in_flight)
        try:
            if not shared.up:
                raise StateUnavailable("down")
            admitted = shared.try_local(budget, reserve, ())
            if admitted is None:
                admitted = await shared.admit_remote(budget, reserve, ())
        except StateUnavailable:
            if shared.settings.on_failure == "closed":
                raise GatewayError(503, "the gateway's shared limits cannot be checked now (its Redis does not "
                                        "answer); retry shortly", code="limits_unavailable",
                                   headers={"retry-after": "1"}) from None
            shared.fail_open += 1
            return history
        if admitted.limited == "in_flight":
            raise KeyStore.too_many(client.name, limits.max_in_flight or 0)
        if admitted.limited is not None:
            raise KeyStore.rate_limited(client.name, admitted.limited, admitted.retry_after)
        if admitted.key_place:
            exchange.key_place = "shared"
        if limits.tokens_per_minute:
            exchange.reserved_tokens = reserve
        return history

    def _reserve_history(self, exchange: Exchange, client: Client, loaded: int, reserved: int) -> None:
        """The stored conversation a request continues was ``loaded`` bytes, ``reserved`` of them reserved on
        arrival (what this process held): the rest is taken from the key's tokens now (from another replica's
        store: not known on arrival), so the next requests see it."""
        if loaded > reserved and exchange.reserved_tokens:
            exchange.body_bytes += loaded - reserved
            self._reserve_more(exchange, client, (loaded - reserved) // BYTES_PER_TOKEN)

    def _reserve_more(self, exchange: Exchange, client: Client, extra: int) -> None:
        """Take ``extra`` more of the key's tokens for the request now (what its body's head did not show)."""
        if extra <= 0 or not exchange.reserved_tokens:
            return
        exchange.reserved_tokens += extra
        exchange.reserve += extra
        if exchange.budget is not None and self._shared is not None:
            self._shared.settle(exchange.budget, extra, None)
        elif client.tokens is not None:
            client.tokens.charge(extra)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self._settings
        state = scope.get("state")
        arrival = state.get(ARRIVAL) if state else None
        exchange = Exchange(request_id=request_id(scope), route=self._route,
                            t_start=arrival if arrival is not None else time.perf_counter())
        live = self._live
        live.in_flight += 1
        if self._tracing.enabled:
            exchange.trace = RequestTrace(self._tracing, self._route, scope["headers"])
        headers: Headers = [(b"x-request-id", exchange.request_id.encode())]
        translation = self._api.new() if self._api is not None else None
        if translation is not None:
            translation.exchange = exchange
            send = translation.wrap(send)
        # the server's direct writer (see gateway.asgi.ClientWriter); not under a translation, which rewrites
        # what is sent
        writer = state.get(BODY_WRITER) if state and translation is None else None
        try:
            if scope["method"] != "POST":
                raise GatewayError(405, f"{scope['path']} only accepts POST", code="method_not_allowed",
                                   headers={"allow": "POST"})
            exchange.hops = hops(header(scope, HOPS_HEADER))
            client = exchange.client = self._keys.authenticate(header(scope, b"authorization"),
                                                               header(scope, b"x-api-key"))
            exchange.explain = KeyStore.explains_routing(client, header(scope, b"x-gateway-debug"))
            if client is not None and KeyStore.hold(client):
                # (before its body is read: a key trickling bodies holds at most max_in_flight connections here;
                # with shared state, its places in Redis are taken with its budget below)
                exchange.held_locally = True
            raw = await read_body(scope, receive, settings.max_body_bytes)
            body: dict[str, Any] | None = decode_body(raw) if len(raw) <= SMALL_BODY else None
            head = head_of(body) if body is not None else BodyHead.read(raw)
            exchange.placement = self._dispatcher.priorities.place(
                client.name if client is not None else None, header(scope, b"x-gateway-priority"),
                header(scope, b"x-gateway-deadline-ms"))
            history = await self._admit_key(exchange, client, head, raw) if client is not None else 0
            if body is None:  # (a large body: decoded whole once its key passed its checks)
                check_containers(raw, settings.limits)
                body = decode_body(raw)
                check_same(head, body)
            # the request's own work, its key's checks passed
            if translation is not None:
                body = await translation.load(body, settings.limits, settings.max_body_bytes - len(raw))
                if client is not None:
                    self._reserve_history(exchange, client, translation.history_size, history)
            request = parse_body("chat" if translation is not None else self._route, body, settings.limits)
            if request.route == "rerank":
                # the engine reads the query once a document: what the body's bytes do not say (S17-4, S18-1)
                exchange.rereads = rerank_rereads(request.body)
                if client is not None:
                    self._reserve_more(exchange, client, estimate_tokens(str(request.body.get("query", "")))
                                       * max(0, len(request.body.get("documents") or ()) - 1))
            if translation is not None:
                translation.route_request = request
                request.agent = translation
            owner = client.name if client is not None else ANONYMOUS
            await validate_heavy(request, self._workers, owner)  # large constraints: off the event loop
            session = header(scope, settings.session_header)
            request.session_key = (_bounded_session(session.decode("latin-1")) if session
                                   else _user_session(request.body))
            request.cache_domain = KeyStore.cache_domain(exchange.client)
            exchange.stream = request.stream
            exchange.request = request
            if exchange.trace is not None:
                # (named by the API the client spoke: a Responses or Messages request is translated to chat)
                exchange.trace.request(self._route, request.model, request.max_tokens, request.stream)
            await self._dispatcher.dispatch(exchange, request, owner, receive, send, writer,
                                            allowed=client.allows if client is not None else None)
        except GatewayError as exc:
            exchange.status = exc.status
            if exchange.outcome == "pending":
                exchange.outcome = ("no_backend" if exc.status >= 500 else
                                    "shed" if exc.code in SHED_CODES else "client_error")
            extra = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            exchange.responded = True
            await send_body(send, exc.status, exc.body(), headers + extra, writer=writer)
        except _ClientGone:
            exchange.outcome = "disconnected"
        except Exception as exc:
            # Not behind the framework's error middleware: answer 500 ourselves if nothing was sent yet. One
            # line per failure (a flood of bad requests must not become a flood of tracebacks); the trace at
            # debug level.
            log.error("request %s failed inside the gateway: %s", exchange.request_id, type(exc).__name__)
            log.debug("request %s: traceback", exchange.request_id, exc_info=True)
            exchange.status, exchange.outcome = 500, "gateway_error"
            if not exchange.responded:
                error = GatewayError(500, "The gateway failed to handle the request", code="internal_error")
                await send_body(send, 500, error.body(), headers, writer=writer)
        finally:
            exchange.t_end = time.perf_counter()
            if exchange.outcome == "pending":
                exchange.outcome = "interrupted"  # cancelled mid-way: the gateway stopping past its shutdown_timeout
            live.in_flight -= 1
            if exchange.budget is not None and self._shared is not None:
                # (admitted through the shared store: settle there, the key's in-flight place with it)
                if exchange.reserved_tokens or exchange.key_place == "shared":
                    self._shared.settle(exchange.budget, _tokens_used(exchange) - exchange.reserved_tokens, None,
                                        key_place=exchange.key_place == "shared")
            elif exchange.client is not None and exchange.client.tokens is not None:
                KeyStore.settle(exchange.client, exchange.reserved_tokens, _tokens_used(exchange))
            if exchange.held_locally and exchange.client is not None:
                KeyStore.release(exchange.client)
            if exchange.trace is not None:
                ttft = exchange.t_first_text - exchange.t_start if exchange.t_first_text is not None else None
                exchange.trace.finish(exchange.status, exchange.outcome, exchange.usage, ttft)
            self._finish(exchange)
            if translation is not None:
                # the translation, its exchange and its request refer to each other: undone here, so what the
                # request held (its body, its stored conversation) goes at once, not at the next full collection
                # (a tenant's agent-API bodies piled up to 4.3 GB between them)
                translation.exchange = None
                translation.route_request = None
                if exchange.request is not None:
                    exchange.request.agent = None
