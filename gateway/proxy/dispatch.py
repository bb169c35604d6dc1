"""From a parsed request to an answer: route (waiting for a slot when every backend is full), then attempt
backends in the routing order, failing over before any byte reached the client.

Failover (tenacity): a refused connection, a failure before the first byte, a first-byte timeout, an
engine status listed in its adapter's ``retry_statuses`` (429 and 5xx) or, when output checks retry, an
answer outside its constraint, send the request to the next-ranked backend; at most
``retries.max_attempts`` attempts and no new one after ``retries.max_seconds``. Never after streaming began.
Every attempt's outcome feeds the backend's circuit breaker.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import orjson
from prometheus_client import Counter
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, stop_after_delay, wait_none

from gateway.asgi import ClientWriter, Headers, Receive, Send
from gateway.auth import ANONYMOUS
from gateway.config import RetrySettings, StructuredOutputSettings
from gateway.engines.base import EngineAdapter
from gateway.engines.registry import ENGINES
from gateway.engines.sampling import MAX_TOP_K
from gateway.errors import GatewayError, normalise_upstream_error
from gateway.pool.backend import Backend
from gateway.proxy.admission import Admission, Priorities, Refused, Ticket, retry_after
from gateway.proxy.cache_isolation import hidden_figures, isolate
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import PATHS, AttemptOptions, Forwarder, InvalidOutput, NativeApi, RetryableStatus
from gateway.proxy.models import FALLBACK_CODES, ModelMap
from gateway.proxy.stall_guard import StallGuard
from gateway.proxy.upstream import ResponseTooLarge, Stopped, UpstreamError
from gateway.routing.pipeline import Decision, NoRoute, Pipeline
from gateway.routing.request import POOLING_ROUTES, RouteRequest
from gateway.state.shared import SharedState, Slotted, StateUnavailable
from gateway.structured import can_honour
from gateway.structured.check import CHECKABLE
from gateway.structured.offload import ValidationWorkers
from gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("gateway.proxy")

PLUGIN_SAMPLE = 8  # gateway_routing_plugin_seconds observes one routing decision in this many


class Fleet(Protocol):
    """The backends to route among (the pool's live list) and each one's engine adapter, by backend name."""

    @property
    def backends(self) -> Sequence[Backend]: ...

    @property
    def adapters(self) -> Mapping[str, EngineAdapter]: ...

    async def still_answers(self, backend: Backend) -> bool: ...


def client_wants_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


NO_SUCH_ROUTE = frozenset({404, 405})  # an engine's answer that is no one request's doing


class _Retry(Exception):
    """This attempt failed in a way another backend may fix. ``final`` is the answer if none is tried."""

    def __init__(self, final: GatewayError, reason: str) -> None:
        super().__init__(reason)
        self.final = final
        self.reason = reason


class Dispatcher:
    def __init__(self, fleet: Fleet, pipeline: Pipeline, admission: Admission, forwarder: Forwarder,
                 metrics: GatewayMetrics, retries: RetrySettings, structured_output: StructuredOutputSettings,
                 shared: SharedState | None = None, priorities: Priorities | None = None,
                 models: ModelMap | None = None, checker: ValidationWorkers | None = None,
                 guard: StallGuard | None = None) -> None:
        self._shared = shared
        # stops a request with a grammar that stalls an engine's one loop, and keeps it and its key's off such
        self.guard = guard or StallGuard(structured_output.stall_guard, admission.clock, metrics.registry,
                                         metrics.loop_lag.worst)
        self._checker = checker  # where answers are checked against their constraints (validate_outputs)
        self._fleet = fleet
        self._pipeline = pipeline
        self._admission = admission
        self._clock = admission.clock  # (the time its tickets were stamped with)
        self._forwarder = forwarder
        self._metrics = metrics
        self._retries = retries
        self._structured_output = structured_output
        self._decisions = 0
        self.priorities = priorities or Priorities(admission.settings, ())
        self.models = models or ModelMap({})
        self.fallbacks = Counter("gateway_model_fallbacks", "Requests a fallback model served, by the model asked "
                                 "for, the model that served and why the first could not.",
                                 ["model", "fallback", "reason"], registry=metrics.registry)

    def reconfigure(self, pipeline: Pipeline, retries: RetrySettings, structured_output: StructuredOutputSettings,
                    priorities: Priorities, models: ModelMap) -> None:
        """A reload's routing, retries, structured-output policy and key priorities, for the requests routed
        from now on (one routing already under way finishes with the pipeline it began with)."""
        self._pipeline = pipeline
        self._retries = retries
        self._structured_output = structured_output
        self.guard.configure(structured_output.stall_guard)
        self.priorities = priorities
        self.models = models

    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    def _observe_decision(self, decision: Decision) -> None:
        live = self._metrics.live
        live.count_decision(decision.ranked[0].name, decision.reason)
        # Plugin times are sampled: a dozen histogram observations per request showed in profiles, and one
        # request in PLUGIN_SAMPLE (the first included) gives the same quantiles.
        self._decisions += 1
        if self._decisions % PLUGIN_SAMPLE == 1:
            for plugin, seconds in decision.timings.items():
                live.plugin_time(plugin, seconds)

    def _observe_invalid_output(self, backend: Backend, action: str) -> None:
        self._metrics.child(self._metrics.invalid_outputs, backend.name, backend.engine, action).inc()

    async def dispatch(self, exchange: Exchange, request: RouteRequest, key: str, receive: Receive,
                       send: Send, writer: ClientWriter | None = None, *,
                       allowed: Callable[[str], bool] | None = None) -> None:
        """Route and send the request: to the served model its name resolves to (``models``: aliases and
        splits) and, when none of that model's backends can serve it, to its fallbacks in turn: those the
        key may use (``allowed``, its model allow-list; None: any), as the client could not ask for the others
        itself."""
        models = self.models
        if not models:
            await self._dispatch(exchange, request, key, receive, send, writer)
            return
        asked = request.model
        target = models.resolve(asked, request.session_key)
        if target != asked:
            request.retarget(target)
        chain = models.fallbacks(asked) or models.fallbacks(target)
        if allowed is not None:
            chain = [name for name in chain if allowed(name)]
        failed: GatewayError | None = None
        for i, name in enumerate([None, *chain]):
            if name is not None and failed is not None:
                served = models.resolve(name, request.session_key)
                self.fallbacks.labels(asked, served, failed.code or "").inc()
                log.info("request %s: model %s cannot serve it (%s): falling back on %s", exchange.request_id,
                         request.model, failed.code, served)
                exchange.fallback = f"{request.model} -> {served} ({failed.code})"
                request.retarget(served)
            try:
                await self._dispatch(exchange, request, key, receive, send, writer)
                return
            except GatewayError as exc:
                if i == len(chain) or exchange.responded or exc.code not in FALLBACK_CODES:
                    raise
                failed = exc

    async def _dispatch(self, exchange: Exchange, request: RouteRequest, key: str, receive: Receive,
                        send: Send, writer: ClientWriter | None) -> None:
        admission = self._admission
        placement = exchange.placement = exchange.placement or self.priorities.place(None, None, None)
        ticket = admission.ticket(request.model, key, placement)
        request.stalled = self.guard.kept(request, _owner(exchange))
        try:
            decision = await self._route(exchange, request, ticket)
        except BaseException:
            admission.abandon(ticket)
            if ticket.refused is not None:
                self._metrics.flow.refused(request.model, placement.band, key, ticket.refused.reason)
            if any(request.model in b.models for b in self._fleet.backends):
                # a served model, refused (queue, capacity, no backend up): its metrics and access-log line name
                # it (not a model the client made up: the label's values stay those the fleet serves)
                exchange.model = request.model
            raise
        admission.admitted(ticket)
        self._metrics.flow.admitted(request.model, placement.band, key, self._clock.monotonic() - ticket.arrived)
        try:
            await self._send(exchange, request, decision, receive, send, writer)
        finally:
            admission.finished(ticket)

    async def _send(self, exchange: Exchange, request: RouteRequest, decision: Decision, receive: Receive,
                    send: Send, writer: ClientWriter | None) -> None:
        exchange.model = request.model
        exchange.route_reason = decision.reason
        self._observe_decision(decision)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s model=%s -> %s policy=%s reason=%s (%s) plugins: %s", exchange.request_id,
                      request.model, decision.ranked[0].name, decision.policy, decision.reason, decision.detail,
                      " ".join(f"{k}={v * 1e6:.0f}us" for k, v in decision.timings.items()))
        headers: Headers = [(b"x-gateway-model", request.model.encode())]
        if exchange.explain:  # (every scorer's value: what other keys' prompts left in the caches)
            headers += [(b"x-gateway-policy", decision.policy.encode()),
                        (b"x-gateway-route-reason", f"{decision.reason}: {decision.detail}".encode())]
        if exchange.fallback is not None:
            headers.append((b"x-gateway-fallback", exchange.fallback.encode()))
        settings = self._retries
        candidates = iter(decision.ranked)
        remaining = len(decision.ranked)
        started = self._clock.monotonic()
        # backends that answered this request with a 5xx and were failed over, not yet counted against
        suspects: list[tuple[Backend, int]] = []
        # with one candidate only, a 5xx it answers has nothing to be compared with (see _attempt)
        alone = len(decision.ranked) == 1

        async def attempt(number: int) -> None:
            nonlocal remaining
            backend = next(candidates)
            remaining -= 1
            last = (remaining == 0 or number >= settings.max_attempts
                    or self._clock.monotonic() - started >= settings.max_seconds)
            await self._attempt(exchange, request, backend, last, headers, receive, send, writer, suspects, alone)
            if suspects and 0 < exchange.status < 400:
                # another backend served it: those that answered 5xx failed where it did not (when another key's
                # request met a 5xx there too: a key's requests that one engine refuses eject it for no one)
                for failed, _ in suspects:
                    if failed.breaker.corroborated(_owner(exchange)):
                        failed.breaker.record(False)
                suspects.clear()

        # The first attempt goes without the retry machinery (most succeed, and it showed in profiles); when it
        # fails over, tenacity runs the rest within what is left of the attempts and of the time.
        try:
            await attempt(1)
            return
        except _Retry as exc:
            failed = exc
        elapsed = self._clock.monotonic() - started
        if settings.max_attempts <= 1 or elapsed >= settings.max_seconds:
            raise failed.final from None
        retrying = AsyncRetrying(
            stop=stop_after_attempt(settings.max_attempts - 1) | stop_after_delay(settings.max_seconds - elapsed),
            retry=retry_if_exception_type(_Retry), wait=wait_none(), reraise=True,
        )
        try:
            async for trial in retrying:
                with trial:
                    await attempt(1 + trial.retry_state.attempt_number)
        except _Retry as exc:  # stopped by time between attempts
            raise exc.final from None

    async def _route(self, exchange: Exchange, request: RouteRequest, ticket: Ticket) -> Decision:
        trace = exchange.trace
        admission = self._admission
        pipeline = self._pipeline
        shared = self._shared is not None
        if admission.should_queue(ticket):  # others of its priority or above wait for this model: behind them
            await self._wait_slice(request, ticket)
        while True:
            if ticket.max_saturation is not None and self._saturated(request.model, ticket.max_saturation):
                await self._wait_slice(request, ticket)  # (the slots above its band's share are kept free)
                continue
            if admission.held_back(ticket, self._capacity):
                await self._wait_slice(request, ticket)  # (the free slots left are kept for light keys)
                continue
            if shared and admission.outranked(ticket):
                await self._wait_slice(request, ticket)  # (a higher priority waits for it on another replica)
                continue
            if trace is not None:
                trace.route_start()
            try:
                decision = pipeline.route(request, self._fleet.backends)
            except NoRoute as exc:
                if trace is not None:
                    trace.route_end(pipeline.policy, f"none: {exc.stage}", "no eligible backend", None)
                if exc.stage != "below-max-concurrency" or ticket.deadline <= ticket.arrived:
                    raise self.no_route(exc) from None
                await self._wait_slice(request, ticket)
                continue
            if trace is not None:
                trace.route_end(decision.policy, decision.reason, decision.detail, decision.ranked[0].name)
            if not shared or self._admitted_locally(exchange, decision):
                return decision
            generation = admission.generation
            admitted = await self._admit_shared(exchange, decision)
            if admitted is None:
                # the shared state did not answer: route again now, as a gateway on its own would (the await
                # let other requests take this replica's slots meanwhile), and go
                shared = False
                continue
            if not admitted:
                # another replica took the last slots: wait like any request that found every backend full
                if ticket.deadline <= ticket.arrived:
                    raise GatewayError(429, f"every backend serving '{request.model}' is at its max_concurrency; "
                                            "retry shortly", code="backends_at_capacity", headers={"retry-after": "1"})
                if admission.generation == generation:  # (else a slot was freed meanwhile: look again now)
                    await self._wait_slice(request, ticket)
                continue
            return decision

    def _slots(self, model: str) -> int | None:
        """The slots of ``model``'s ready backends (None when a backend's are unknown)."""
        slots = 0
        for backend in self._fleet.backends:
            if model in backend.models and backend.routable:
                if backend.slots is None:
                    return None
                slots += backend.slots
        return slots

    def _capacity(self, model: str) -> tuple[int, int] | None:
        """The slots of ``model``'s ready backends and how many are free (held neither here nor, with shared
        state, by other replicas as the last heartbeat read them); None when a backend's slots are unknown."""
        slots = free = 0
        shared = self._shared
        for backend in self._fleet.backends:
            if model in backend.models and backend.routable:
                size = backend.slots
                if size is None:
                    return None
                held = backend.in_flight + (shared.remote_in_flight(backend.name) if shared is not None else 0)
                slots += size
                free += max(0, size - held)
        return slots, free

    def _saturated(self, model: str, share: float) -> bool:
        """This gateway's requests of ``model`` fill at least ``share`` of its ready backends' slots (False
        when a backend's slots are unknown: nothing to measure against)."""
        slots = self._slots(model)
        return bool(slots) and self._admission.active(model) >= share * (slots or 0)

    async def _wait_slice(self, request: RouteRequest, ticket: Ticket) -> None:
        """Wait until woken for a free slot (a release, or admission's periodic look: see Admission._kick).
        Refusals become 429s with the predicted wait as ``Retry-After``."""
        try:
            await self._admission.wait(ticket)
        except Refused as refused:
            # (for the metrics) without its traceback: the ticket is a local of the frames it holds, a cycle
            # that only the cyclic collector would free, for every refused request
            ticket.refused = refused.with_traceback(None)
            raise self.refusal(request.model, ticket, refused) from None

    def refusal(self, model: str, ticket: Ticket, refused: Refused) -> GatewayError:
        headers = {"retry-after": str(retry_after(refused))}
        predicted = (f"the predicted wait ({refused.predicted:.1f} s, {refused.ahead} requests ahead)"
                     if refused.predicted is not None else "the wait")
        allowed = ticket.deadline - ticket.arrived
        if refused.reason == "queue_full":
            return GatewayError(429, f"every backend serving '{model}' is at its max_concurrency and the gateway's "
                                     "queue is full; retry shortly", code="queue_full", headers=headers)
        if refused.reason == "displaced":
            return GatewayError(429, f"every backend serving '{model}' is at its max_concurrency and the queue is "
                                     "full: a request of higher priority, or of a key holding fewer places in it, "
                                     "took this one's place; retry shortly", code="queue_full", headers=headers)
        if refused.reason == "deadline":
            return GatewayError(429, f"every backend serving '{model}' is busy: {predicted} exceeds what this "
                                     f"request may wait ({allowed:g} s); retry later", code="queue_deadline",
                                headers=headers)
        return GatewayError(429, f"no backend serving '{model}' had a free slot within {allowed:g} s; retry shortly",
                            code="queue_timeout", headers=headers)

    def _admitted_locally(self, exchange: Exchange, decision: Decision) -> bool:
        """With shared state: whether this replica took a slot on the best-ranked backend from what it holds
        (kept slots), or none was needed; no round trip, no await. False: :meth:`_admit_shared` decides. (The
        key's budget was admitted on arrival, by the endpoint.)"""
        shared = self._shared
        assert shared is not None
        ranked = decision.ranked  # (read as they are: admission copies nothing per request)
        if not shared.needed(None, ranked):
            return True
        admitted = shared.try_local(None, 0, ranked)
        if admitted is None:
            return False
        exchange.shared_slot = ranked[0].name if admitted.slot else None
        return True

    async def _admit_shared(self, exchange: Exchange, decision: Decision) -> bool | None:
        """With shared state, after :meth:`_admitted_locally` said False: a slot on the best-ranked backend that
        has one, in one round trip; that backend goes first. False: every ranked backend with a
        ``max_concurrency`` is full (nothing was taken). None: the shared state did not answer; the caller
        routes again on local state (each replica keeps to the ``max_concurrency`` on its own)."""
        shared = self._shared
        assert shared is not None
        try:
            if not shared.up:
                raise StateUnavailable("down")
            admitted = await shared.admit_remote(None, 0, decision.ranked)
        except StateUnavailable:
            return None
        if admitted.full:
            return False
        ranked = decision.ranked
        if admitted.chosen:
            ranked.insert(0, ranked.pop(admitted.chosen))
        exchange.shared_slot = ranked[0].name if admitted.slot else None
        return True

    def _payload(self, request: RouteRequest, backend: Backend, priority: int) -> bytes:
        """The body in the backend's dialect (the request's validation made sure it encodes), naming the
        engine slot routing placed it in, where the engine takes one, and carrying the request's priority
        to an engine that schedules by it (the gateway's, whatever the client wrote there). A client's own
        ``priority`` reaches no engine: vLLM and SGLang order their queue by it under a policy the gateway may
        not have been told of, and a key would then reorder every tenant's requests there (the gateway's
        priorities are its keys' and the x-gateway-priority header's, see docs/flow-control.md)."""
        body = self._fleet.adapters[backend.name].prepare_body(request.route, dict(request.body),
                                                                 request.constraint)
        isolate(body, request, backend.spec, request.route)  # (the request's cache domain: its salt, if any)
        field = backend.spec.slot_field
        if field is not None:  # (the gateway's to choose: a client's own pinned any tenant's slot, evicting its prompt)
            if request.engine_slot is not None and request.cached_on is backend:
                body[field] = request.engine_slot
            else:
                body.pop(field, None)
        order = backend.priority_order
        if order is not None:
            body["priority"] = -priority if order == "lower-first" else priority
        else:
            body.pop("priority", None)
        return orjson.dumps(body)

    async def _attempt(self, exchange: Exchange, request: RouteRequest, backend: Backend, last: bool,
                       headers: Headers, receive: Receive, send: Send, writer: ClientWriter | None,
                       suspects: list[tuple[Backend, int]], alone: bool = False) -> None:
        """One attempt on ``backend``. A 5xx answer that fails over is not counted against the backend's breaker
        at once (``suspects``): the same status from the next backend says the request itself is the cause
        (llama.cpp answers 500 to a JSON-constrained answer cut short by max_tokens), and it counts against
        neither; another backend serving it counts it (see ``_send``). Otherwise five such requests ejected
        every backend. With no other backend to compare with (``alone``), a 5xx the backend answered counts
        against neither: one key's requests ejected a model's only llama.cpp server (sweep 10); a connection
        failure or a timeout still counts."""
        shared = self._shared
        if (shared is not None and backend.max_concurrency and exchange.shared_slot != backend.name
                and shared.up):
            # a failover attempt on another backend with a max_concurrency: its own slot first
            try:
                taken = await shared.acquire(Slotted(backend.name, backend.max_concurrency))
            except StateUnavailable:
                taken = True  # (as a replica on its own: the filter kept it below its max_concurrency)
            else:
                if taken:
                    exchange.shared_slot = backend.name
            if not taken:
                full = GatewayError(429, f"every backend serving '{request.model}' is at its max_concurrency; "
                                         "retry shortly", code="backends_at_capacity", headers={"retry-after": "1"})
                if last:
                    raise full
                raise self._retry(exchange, backend, "full", full)
        trace = exchange.trace
        check, retry_invalid = self._output_check(exchange, request, can_retry=not last)
        self._pipeline.routed(request, backend)  # (first: routing may place it in an engine slot)
        # an agent API request goes as the client sent it to an engine that serves that API itself
        native: NativeApi | None = None
        passed = request.agent.native(backend) if request.agent is not None else None
        if passed is not None:
            payload, native = passed
            check, retry_invalid = None, False  # (the checks read chat answers; nothing is constrained here)
        else:
            payload = self._payload(request, backend, exchange.placement.priority if exchange.placement else 0)
        path = native.path if native is not None else PATHS[request.route]
        context = backend.capacity.context_length
        if (not backend.spec.output_in_context and context and request.estimated_tokens is not None
                and request.estimated_tokens > context):
            # an engine that stops at the end of its context (llama.cpp) where max_tokens reaches past it: the
            # answer may end there ("length") before max_tokens
            headers = [*headers, (b"x-gateway-context-limit", str(context).encode())]
        if request.agent is not None:  # which way this agent API request went
            headers = [*headers, (b"x-gateway-agent-api", b"native" if native is not None else b"translated"),
                       *request.agent.notes]
        options = AttemptOptions(
            keep_usage=native is not None or client_wants_usage(request.body), headers=headers, check=check,
            retry_invalid=retry_invalid, retry_statuses=frozenset() if last else backend.spec.retry_statuses,
            writer=writer, native=native, hidden=hidden_figures(request, backend.spec),
            rewrite=self._fleet.adapters[backend.name].rewrite_answer(request.route, request.model, request.body)
            if native is None else native.answer,
            upstream_headers=(trace.upstream_start(backend.name, backend.engine, backend.url, path)
                              if trace is not None else None),
        )
        exchange.backend = backend
        exchange.concurrency = backend.estimated_queue() + 1
        # From begin() on, every path must settle the breaker (record an outcome or release the probe):
        # a half-open breaker whose probe is never settled lets no request through again.
        breaker = backend.breaker
        breaker.begin()
        # (what it answered meanwhile tells a slow request from a stuck backend; for a model's only backend, its
        # health checks too)
        answered, checked = backend.answered, backend.checked
        probe_settled = False

        def on_status(status: int) -> None:
            # a half-open probe is settled when the backend answers, not when a stream it starts ends: a key's
            # long stream as the probe kept the backend from everyone else for as long as it ran (sweep 11)
            nonlocal probe_settled
            if status < 500 and breaker.probing:
                breaker.record(True)
                probe_settled = True

        options.on_status = on_status
        options.watched = self.guard.watch(backend, request, _owner(exchange))
        backend.in_flight += 1
        settled = False
        try:
            await self._forward_until_disconnect(exchange, backend, payload, options, receive, send)
        except InvalidOutput as exc:
            self._observe_invalid_output(backend, "retried")
            # the discarded answer was generated all the same: its key pays for it (else each retry is free)
            exchange.discarded_tokens += exchange.answer_tokens()
            exchange.output_retried = True
            breaker.record(True)  # it answered; the answer was wrong, not the backend
            settled = True
            raise self._retry(exchange, backend, "invalid_output", GatewayError(
                502, f"backend {backend.name}: {exc}", code="invalid_output")) from None
        except RetryableStatus as exc:
            if exc.status >= 500:
                breaker.release()  # (the verdict waits for the next backend's answer)
                suspects.append((backend, exc.status))
                # the engine read the prompt before it failed: its key pays for it (each failover was free, so
                # a request every engine answers 500 cost N backends' work for one charge, sweep 11)
                exchange.failed_over += 1
            else:
                breaker.record(exc.status == 429)
            settled = True
            final = GatewayError(exc.status, "", headers={"x-gateway-backend": backend.name},
                                 body=normalise_upstream_error(exc.status, exc.body, backend.name, backend.secrets,
                                                               cut_short=exc.cut_short))
            raise self._retry(exchange, backend, f"status_{exc.status}", final) from None
        except Stopped as exc:
            # the stall guard stopped it (the engine's loop stalled while it ran there): the engine did nothing
            # wrong, and another such engine would stall as well; not failed over
            breaker.release()
            settled = True
            if trace is not None:
                trace.upstream_end(None, str(exc))
            exchange.outcome = exc.code
            raise GatewayError(503, str(exc), code=exc.code,
                               headers={"x-gateway-backend": backend.name, "retry-after": "1"}) from None
        except ResponseTooLarge as exc:
            # the backend answered; the answer is more than the gateway holds: any backend would answer as much
            breaker.record(True)
            settled = True
            if trace is not None:
                trace.upstream_end(None, str(exc))
            exchange.outcome = exc.code
            raise GatewayError(502, f"backend {backend.name}: {exc}", code=exc.code,
                               headers={"x-gateway-backend": backend.name}) from None
        except UpstreamError as exc:
            if exc.timeout and (backend.answered > answered or (alone and backend.checked > checked)):
                # it answered other requests while this one waited: the request was slow (a long non-streamed
                # generation past timeouts.first_byte), not the backend stuck; counted, a key's long requests
                # ejected every backend of a model (sweep 9). A model's only backend that nothing else was sent
                # to meanwhile, but that passed its health checks, likewise: one key's slow requests on a quiet
                # model ejected it, then kept it from everyone as the half-open probe (sweep 13; ejecting the
                # only backend moves no traffic anywhere; a stuck one still times out each request)
                breaker.release()
            elif exc.answered and not breaker.corroborated(_owner(exchange)):
                breaker.release()  # (an error it answered, as a 5xx: counted where another key met one too)
            else:
                breaker.record(False)
            settled = True
            if trace is not None:
                trace.upstream_end(None, str(exc))
            if exc.connect:
                backend.mark_down(f"connection failed: {exc}")
            exchange.outcome = exc.code
            final = GatewayError(504 if exc.timeout else 502, f"backend {backend.name}: {exc}", code=exc.code,
                                 headers={"x-gateway-backend": backend.name})
            if last:
                raise final from None
            if not exc.connect:
                # the request reached the engine, which read its prompt: its key pays for it, as for a 5xx (each
                # backend timed out on was a prompt's work for nothing, sweep 16)
                exchange.failed_over += 1
                if not exc.timeout and not exc.auth and not await self._fleet.still_answers(backend):
                    # The engine went with the request. Most often it died of its own (killed, out of memory), and
                    # the request goes to the next backend; but a request that ends its engine ends the next one
                    # too (one request aborted every llama-server of a model, each failover to the next: sweep 20).
                    # So a request after which a second engine went is sent to no other.
                    backend.mark_down(f"stopped answering after a request: {exc}")
                    exchange.engines_lost += 1
                    if exchange.engines_lost > 1:
                        raise GatewayError(502, f"backend {backend.name}: {exc}, and it stopped answering, the second "
                                                "backend to after this request; it is not sent to another",
                                           code=exc.code, headers={"x-gateway-backend": backend.name}) from None
            raise self._retry(exchange, backend, exc.reason, final) from None
        except (GatewayError, asyncio.CancelledError):
            raise
        except Exception as exc:
            log.error("request %s: sending to backend %s failed: %s: %s", exchange.request_id, backend.name,
                      type(exc).__name__, backend.secrets.scrub(str(exc)))
            log.debug("request %s: attempt failure", exchange.request_id, exc_info=True)
            settled = True
            if exchange.responded:  # the backend answered: what failed came after, on the way to the client (a
                # client's request can make that fail: it must not count against the backend, sweep 9)
                breaker.record(True)
                raise
            # A failure of the attempt itself (the request could not even be built or sent): the backend
            # cannot be used as configured, so it counts against it and the next backend is tried.
            breaker.record(False)
            exchange.outcome = "upstream_failed"
            final = GatewayError(502, f"backend {backend.name}: the request could not be sent "
                                      f"({type(exc).__name__})", code="upstream_failed",
                                 headers={"x-gateway-backend": backend.name})
            if last:
                raise final from None
            raise self._retry(exchange, backend, "attempt_failed", final) from None
        finally:
            backend.in_flight -= 1
            if options.watched is not None:
                self.guard.ended(options.watched, finished=exchange.outcome == "success")
            if exchange.shared_slot == backend.name and shared is not None:
                exchange.shared_slot = None
                shared.settle(None, 0, backend.name)
            self._admission.released(backend)
            if not settled and not probe_settled:
                if exchange.outcome == "disconnected" or exchange.outcome == "pending":
                    breaker.release()  # nothing was learnt (the client left, or the gateway is stopping)
                elif exchange.status >= 500 and suspects and any(status == exchange.status for _, status in suspects):
                    # the same answer as the backend before it: the request's doing, not either backend's
                    breaker.release()
                    suspects.clear()
                elif (exchange.status >= 500 and alone
                      and exchange.outcome not in ("upstream_failed", "upstream_timeout")):
                    breaker.release()  # (it answered; whose doing the 5xx is, nothing here can tell)
                elif exchange.outcome in ("upstream_failed", "upstream_timeout"):
                    breaker.record(False)
                elif (exchange.status >= 500 or exchange.status in NO_SUCH_ROUTE
                      or (exchange.outcome == "upstream_error" and exchange.status < 400)):
                    # it answered a 5xx, a 404 or 405 (no such route or model: an engine answering every request
                    # so), or an error inside a 200 stream: none is a success (failing at once, such an engine
                    # looked fastest and drew nearly every request, sweep 23); counted against it where another
                    # key's request met one there too (see Breaker.corroborated)
                    if breaker.corroborated(_owner(exchange)):
                        breaker.record(False)
                    else:
                        breaker.release()
                else:
                    breaker.record(True)
        if exchange.invalid_output is not None:
            self._observe_invalid_output(backend, "marked")
        if exchange.output_unchecked is not None:
            self._metrics.child(self._metrics.unchecked_outputs, backend.name, backend.engine).inc()

    def _retry(self, exchange: Exchange, backend: Backend, reason: str, final: GatewayError) -> _Retry:
        self._metrics.child(self._metrics.retries, backend.name, reason).inc()
        log.warning("request %s: backend %s failed (%s); trying the next", exchange.request_id, backend.name, reason)
        exchange.invalid_output = exchange.output_unchecked = None
        exchange.outcome = "pending"
        return _Retry(final, reason)

    async def _forward_until_disconnect(self, exchange: Exchange, backend: Backend, payload: bytes,
                                        options: AttemptOptions, receive: Receive, send: Send) -> None:
        """Forward while watching the client: when it disconnects, cancel the upstream request at once
        (uvicorn's ``send`` silently drops writes to a gone client, so nothing else would notice). The server's
        writer says so from its protocol callback where there is one; else a task waits on ``receive``.

        Except a whole (unstreamed) answer the client set no bound to (no ``max_tokens``): nothing of it has been
        counted on the way, and what the engine generated before it was cut is known only from its usage. It is
        waited for (its writes dropped), charged as it says, and holds its key's place in flight until then: cut
        at once, it was charged its reservation, ~1,050 tokens, for the ~3,300 a llama-server wrote in 6 s (a key
        left each such request after 6.5 s and had 3.3x its tokens per minute generated, sweep 27)."""
        task = asyncio.current_task()
        assert task is not None
        state = {"finished": False, "gone": False}
        request = exchange.request
        unbounded = (request is not None and not request.stream and request.max_tokens is None
                     and request.route not in POOLING_ROUTES)

        def gone() -> None:
            if not state["finished"]:
                state["gone"] = True
                if not unbounded:
                    task.cancel()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            gone()

        writer = options.writer
        watcher: asyncio.Task[None] | None = None
        if writer is not None:
            writer.when_disconnected(gone)
        else:
            watcher = asyncio.create_task(watch())
        try:
            await self._forwarder.forward(exchange, backend, payload, send, options)
            state["finished"] = True
            if state["gone"] and exchange.outcome in ("pending", "success"):
                exchange.outcome = "disconnected"  # (its answer waited for, for its usage, and dropped)
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            if exchange.outcome == "pending":  # (a client that hangs up after [DONE] had its answer)
                exchange.outcome = "disconnected"
        finally:
            state["finished"] = True
            if watcher is not None:
                watcher.cancel()
            if writer is not None:
                writer.when_disconnected(None)

    def _output_check(self, exchange: Exchange, request: RouteRequest, can_retry: bool
                      ) -> tuple[Callable[[bytes], Awaitable[tuple[str | None, str | None]]] | None, bool]:
        constraint = request.constraint
        mode = self._structured_output.mode(request.model)
        checker = self._checker
        if (constraint is None or mode == "off" or request.stream or constraint.kind not in CHECKABLE
                or checker is None):
            return None, False
        route = request.route
        owner = exchange.client.name if exchange.client is not None else ANONYMOUS
        # with nowhere else to retry, a failing answer is marked rather than lost; retried once at most
        retry = mode == "retry" and can_retry and not exchange.output_retried
        return (lambda raw: checker.check_answer(route, raw, constraint, owner)), retry

    def no_route(self, exc: NoRoute) -> GatewayError:
        backends = self._fleet.backends
        model = exc.request.model
        undiscovered = [b.name for b in backends if not b.models]
        if exc.stage == "serves-model" and undiscovered:
            return GatewayError(503, f"no available backend serves model '{model}'; the models of "
                                     f"{', '.join(undiscovered)} are not known yet (unreachable so far)",
                                code="no_backend_available", headers={"retry-after": "1"})
        if exc.stage == "structured-output":
            constraint = exc.request.constraint
            assert constraint is not None
            toolless = sorted(b.name for b in backends if model in b.models and b.capacity.tool_calls is False)
            if constraint.kind == "tool_call" and toolless:
                return GatewayError(400, f"no backend serving '{model}' can force a tool call now: the model's chat "
                                         f"template on {', '.join(toolless)} cannot call tools (llama.cpp's "
                                         "chat_template_caps), and no other backend serving it is available",
                                    param="tool_choice", code="unsupported_constraint")
            able = sorted(name for name, spec in ENGINES.items() if can_honour(constraint, spec.structured))
            return GatewayError(400, f"no backend serving '{model}' can honour the {constraint.describe()} "
                                     f"constraint; engines that can: {', '.join(able) or 'none'}",
                                param=constraint.source, code="unsupported_constraint")
        if exc.stage == "several-generations":
            request = exc.request
            prompts = request.body.get("prompt") if request.route == "completions" else None
            several = isinstance(prompts, list) and len(prompts) > 1 and not isinstance(prompts[0], int)
            param = "prompt" if several else "n"
            unable = sorted({b.spec.name for b in backends if model in b.models and not b.spec.several_generations})
            return GatewayError(400, f"no backend serving '{model}' can take {request.generations} generations in "
                                     f"one request ({', '.join(unable) or 'its engine'}): llama.cpp answers several "
                                     "choices or prompts with the usage of one and runs each in a slot of its own, "
                                     "and a plain 'openai' server may be llama-server, so the request could be "
                                     "neither charged nor scheduled; send one generation per request (n=1, one "
                                     "prompt)", param=param, code="unsupported_value")
        if exc.stage == "whole-vocabulary":
            field = exc.request.whole_vocabulary
            unable = sorted({b.spec.name for b in backends if model in b.models and not b.spec.whole_vocabulary})
            return GatewayError(400, f"no backend serving '{model}' can take this request's '{field}' "
                                     f"({', '.join(unable) or 'its engine'}): it would have llama.cpp sort the whole "
                                     "vocabulary at every token, on the loop every other request shares, and a plain "
                                     "'openai' server may be llama-server; give top_k from 1 to "
                                     f"{MAX_TOP_K}, a samplers chain with top_k before top_p, typical_p, min_p, "
                                     "xtc and a temperature with a dynatemp_range, and no mirostat",
                                param=field, code="unsupported_value")
        if exc.stage == "stalled-loop":
            request = exc.request
            unable = sorted({b.spec.name for b in backends if model in b.models and b.spec.load_waits_for_loop})
            assert request.stalled is not None
            why, seconds = request.stalled
            return GatewayError(429, f"no backend serving '{model}' can take this request now "
                                     f"({', '.join(unable) or 'its engine'}): {why}. Serve the model on vLLM or "
                                     "SGLang too, or send it without a constraint or tools",
                                code="constraint_stalled_engine", headers={"retry-after": str(max(1, int(seconds)))})
        if exc.stage == "many-parses":
            request = exc.request
            param = request.constraint.source if request.constraint and request.constraint.fanout else "tools"
            unable = sorted({b.spec.name for b in backends if model in b.models and not b.spec.many_parses})
            return GatewayError(400, f"no backend serving '{model}' can take this request "
                                     f"({', '.join(unable) or 'its engine'}): {request.fanout}; llama.cpp checks "
                                     "every candidate token against each way its grammar's parse may go, at every "
                                     "token, on the loop every other request shares, and a plain 'openai' server "
                                     "may be llama-server. Write alternatives that begin alike as one with the "
                                     'difference after ("a" ("b" | "c"), not "ab" | "ac"), or serve the model on '
                                     "vLLM or SGLang too", param=param, code="constraint_too_large")
        if exc.stage == "fits-context":
            largest = max((b.capacity.context_length or 0 for b in backends if model in b.models), default=0)
            needed = exc.request.estimated_tokens
            # (without max_tokens the prompt alone is too long: name it, as OpenAI does)
            asked = exc.request.max_tokens is not None
            param = "max_tokens" if asked else {"chat": "messages", "completions": "prompt"}.get(
                exc.request.route, "input")
            return GatewayError(400, f"This request needs at least {needed} tokens "
                                     f"({'prompt plus max_tokens' if asked else 'its prompt'}), more than the "
                                     f"context of any backend serving '{model}' (largest: {largest})",
                                param=param, code="context_length_exceeded")
        if exc.stage == "below-max-concurrency":
            return GatewayError(429, f"every backend serving '{model}' is at its max_concurrency; retry shortly",
                                code="backends_at_capacity", headers={"retry-after": "1"})
        if exc.stage == "serves-model" and any(model in b.models for b in backends):
            # the model is served, by engines that do not serve this route (rerank, count_tokens)
            agent, route = exc.request.agent, exc.request.route
            able = sorted(name for name, spec in ENGINES.items()
                          if route in spec.routes and (agent is None or agent.servable(spec)))
            return GatewayError(400, f"no backend serving '{model}' serves this route "
                                     f"({agent.api if agent is not None else route}); engines that do: "
                                     f"{', '.join(able) or 'none'}", code="unsupported_route")
        if exc.stage == "serves-model":
            return GatewayError(404, f"The model '{model}' does not exist or is not served by any backend",
                                type="invalid_request_error", param="model", code="model_not_found")
        # (how many, in what state; not which: a backend's name and address are the operator's, and a DNS replica
        # is named by its address, sweep 24; GET /admin/backends says which)
        serving = [b for b in backends if model in b.models]
        states = Tally(b.health.value for b in serving)
        states.update(what for b in serving for what, is_so in (("drained", b.drained),
                                                                 ("ejected", not b.breaker.available())) if is_so)
        summary = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
        return GatewayError(503, f"no backend can take a request for model '{model}' now ({exc.stage} left none "
                                 f"of {len(serving)}: {summary})", code="no_backend_available",
                            headers={"retry-after": "1"})


def _owner(exchange: Exchange) -> str | None:
    """Whose request this is, as the breaker tells requests apart: its API key, or None with auth off."""
    return exchange.client.name if exchange.client is not None else None
