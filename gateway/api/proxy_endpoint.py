"""The OpenAI generation routes as one raw ASGI endpoint: read, validate, route, forward, account.

Raw ASGI rather than a framework response: on our machines a framework's streaming response cost 2-3x the
added latency of a raw path (../shared/PERFORMANCE.md). The endpoint still sits in the FastAPI app, so
middleware and the other routes are ordinary.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.api.validation import client_wants_usage, parse_request
from gateway.asgi import Headers, Receive, Scope, Send, header, send_body
from gateway.engines import ADAPTERS
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import PATHS, InvalidOutput
from gateway.proxy.upstream import UpstreamError
from gateway.routing.pipeline import NoRoute
from gateway.routing.request import RouteRequest
from gateway.server_protocol import ARRIVAL
from gateway.structured import can_honour
from gateway.structured.check import CHECKABLE, output_problem
from gateway.telemetry.metrics import UNKNOWN
from gateway.telemetry.tracing import RequestTrace

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger("gateway.proxy")

# A connection refused never reached the backend, so the next-ranked backend may take the request.
MAX_CONNECT_ATTEMPTS = 3


class _ClientGone(Exception):
    pass


def request_id(scope: Scope) -> str:
    given = header(scope, b"x-request-id")
    if given and len(given) <= 128 and given.isascii() and given.decode().isprintable():
        return given.decode()
    return os.urandom(12).hex()


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
    return f"user:{user}" if isinstance(user, str) and user else None


class ProxyEndpoint:
    def __init__(self, gateway: Gateway, route: str) -> None:
        self._gw = gateway
        self._route = route
        self._session_header = gateway.settings.routing.session_header.lower().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope.get("state")
        arrival = state.get(ARRIVAL) if state else None
        exchange = Exchange(request_id=request_id(scope), route=self._route,
                            t_start=arrival if arrival is not None else time.perf_counter())
        in_flight = self._gw.metrics.in_flight
        in_flight.inc()
        if self._gw.tracing.enabled:
            exchange.trace = RequestTrace(self._gw.tracing, self._route, scope["headers"])

        headers: Headers = [(b"x-request-id", exchange.request_id.encode())]
        try:
            if scope["method"] != "POST":
                raise GatewayError(405, f"{scope['path']} only accepts POST", code="method_not_allowed",
                                   headers={"allow": "POST"})
            raw = await read_body(scope, receive, self._gw.settings.server.max_body_bytes)
            session = header(scope, self._session_header)
            await self._handle(exchange, raw, session.decode("latin-1") if session else None, receive, send)
        except GatewayError as exc:
            exchange.status = exc.status
            if exchange.outcome == "pending":
                exchange.outcome = "client_error" if exc.status < 500 else "no_backend"
            extra = [(k.encode(), v.encode()) for k, v in exc.headers.items()]
            exchange.responded = True
            await send_body(send, exc.status, exc.body(), headers + extra)
        except _ClientGone:
            exchange.outcome = "disconnected"
        except Exception:
            # Not behind the framework's error middleware: answer 500 ourselves if nothing was sent yet.
            log.exception("request %s failed inside the gateway", exchange.request_id)
            exchange.status, exchange.outcome = 500, "gateway_error"
            if not exchange.responded:
                error = GatewayError(500, "The gateway failed to handle the request", code="internal_error")
                await send_body(send, 500, error.body(), headers)
        finally:
            exchange.t_end = time.perf_counter()
            in_flight.dec()
            if exchange.trace is not None:
                ttft = exchange.t_first_text - exchange.t_start if exchange.t_first_text is not None else None
                exchange.trace.finish(exchange.status, exchange.outcome, exchange.usage, ttft)
            self._gw.observe(exchange)

    async def _handle(self, exchange: Exchange, raw: bytes, session: str | None, receive: Receive,
                      send: Send) -> None:
        gw = self._gw
        request = parse_request(self._route, raw)
        request.session_key = session if session else _user_session(request.body)
        exchange.stream = request.stream
        exchange.request = request
        trace = exchange.trace
        if trace is not None:
            trace.request(request.route, request.model, request.max_tokens, request.stream)
            trace.route_start()
        try:
            decision = gw.pipeline.route(request, gw.pool.backends)
        except NoRoute as exc:
            if trace is not None:
                trace.route_end(gw.pipeline.policy, f"none: {exc.stage}", "no eligible backend", None)
            raise self._no_route(exc) from None
        if trace is not None:
            trace.route_end(decision.policy, decision.reason, decision.detail, decision.ranked[0].name)
        exchange.model = request.model
        exchange.route_reason = decision.reason
        gw.observe_decision(decision)
        keep_usage = client_wants_usage(request.body)
        route_headers: Headers = [(b"x-gateway-policy", decision.policy.encode()),
                                  (b"x-gateway-route-reason", f"{decision.reason}: {decision.detail}".encode())]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s model=%s -> %s policy=%s reason=%s (%s) plugins: %s", exchange.request_id,
                      request.model, decision.ranked[0].name, decision.policy, decision.reason, decision.detail,
                      " ".join(f"{k}={v * 1e6:.0f}us" for k, v in decision.timings.items()))
        last_error: UpstreamError | None = None
        check, retry_invalid = self._output_check(request, alternatives=len(decision.ranked) > 1)
        for backend in decision.ranked[:MAX_CONNECT_ATTEMPTS]:
            body = gw.pool.adapters[backend.name].prepare_body(request.route, dict(request.body), request.constraint)
            exchange.backend = backend
            exchange.concurrency = backend.estimated_queue() + 1
            gw.pipeline.routed(request, backend)
            upstream_headers = (trace.upstream_start(backend.name, backend.engine, backend.url, PATHS[request.route])
                                if trace is not None else None)
            backend.in_flight += 1
            try:
                await self._forward_until_disconnect(exchange, backend, orjson.dumps(body), keep_usage,
                                                     route_headers, receive, send, check, retry_invalid,
                                                     upstream_headers)
                if exchange.invalid_output is not None:
                    gw.observe_invalid_output(backend, "marked")
                return
            except InvalidOutput as exc:
                gw.observe_invalid_output(backend, "retried")
                gw.metrics.child(gw.metrics.retries, backend.name, "invalid_output").inc()
                log.warning("request %s: %s answered outside its constraint (%s); retrying once elsewhere",
                            exchange.request_id, backend.name, exc)
                retry_invalid = False
                exchange.invalid_output = None
            except UpstreamError as exc:
                last_error = exc
                if trace is not None:
                    trace.upstream_end(None, str(exc))
                if not exc.connect:
                    break
                backend.mark_down(f"connection failed: {exc}")
                gw.metrics.child(gw.metrics.retries, backend.name, "connect_failed").inc()
                log.warning("backend %s unreachable (%s); trying the next", backend.name, exc)
            finally:
                backend.in_flight -= 1
        assert last_error is not None, "a retried invalid answer is always followed by an attempt that marks"
        assert last_error is not None
        exchange.outcome = "upstream_timeout" if last_error.timeout else "upstream_failed"
        status = 504 if last_error.timeout else 502
        name = exchange.backend.name if exchange.backend else UNKNOWN
        raise GatewayError(status, f"backend {name}: {last_error}",
                           code="upstream_timeout" if last_error.timeout else "upstream_failed",
                           headers={"x-gateway-backend": name})

    async def _forward_until_disconnect(
        self, exchange: Exchange, backend: Backend, payload: bytes, keep_usage: bool, extra_headers: Headers,
        receive: Receive, send: Send, check: Callable[[bytes], str | None] | None, retry_invalid: bool,
        upstream_headers: dict[str, str] | None,
    ) -> None:
        """Forward while watching the client: when it disconnects, cancel the upstream request at once
        (uvicorn's ``send`` silently drops writes to a gone client, so nothing else would notice)."""
        task = asyncio.current_task()
        assert task is not None
        state = {"finished": False, "gone": False}

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            if not state["finished"]:
                state["gone"] = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            await self._gw.forwarder.forward(exchange, backend, payload, keep_usage, send, extra_headers, check,
                                             retry_invalid, upstream_headers)
            state["finished"] = True
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()
            exchange.outcome = "disconnected"
        finally:
            state["finished"] = True
            watcher.cancel()

    def _output_check(self, request: RouteRequest,
                      alternatives: bool) -> tuple[Callable[[bytes], str | None] | None, bool]:
        constraint = request.constraint
        mode = self._gw.settings.structured_output.mode(request.model)
        if constraint is None or mode == "off" or request.stream or constraint.kind not in CHECKABLE:
            return None, False
        route = request.route
        # with nowhere else to retry, a failing answer is marked rather than lost
        return (lambda raw: output_problem(route, raw, constraint)), mode == "retry" and alternatives

    def _no_route(self, exc: NoRoute) -> GatewayError:
        model = exc.request.model
        undiscovered = [b.name for b in self._gw.pool.backends if not b.models]
        if exc.stage == "serves-model" and undiscovered:
            return GatewayError(503, f"no available backend serves model '{model}'; the models of "
                                     f"{', '.join(undiscovered)} are not known yet (unreachable so far)",
                                code="no_backend_available", headers={"retry-after": "1"})
        if exc.stage == "structured-output":
            constraint = exc.request.constraint
            assert constraint is not None
            able = sorted(name for name, adapter in ADAPTERS.items() if can_honour(constraint, adapter.structured))
            return GatewayError(400, f"no backend serving '{model}' can honour the {constraint.describe()} "
                                     f"constraint; engines that can: {', '.join(able) or 'none'}",
                                param=constraint.source, code="unsupported_constraint")
        if exc.stage == "fits-context":
            largest = max((b.capacity.context_length or 0 for b in self._gw.pool.backends if model in b.models),
                          default=0)
            needed = exc.request.notes.get("estimated_tokens")
            return GatewayError(400, f"This request needs at least {needed} tokens (prompt plus max_tokens), more "
                                     f"than the context of any backend serving '{model}' (largest: {largest})",
                                param="max_tokens", code="context_length_exceeded")
        if exc.stage == "below-max-concurrency":
            return GatewayError(429, f"every backend serving '{model}' is at its max_concurrency; retry shortly",
                                code="backends_at_capacity", headers={"retry-after": "1"})
        if exc.stage == "serves-model":
            return GatewayError(404, f"The model '{model}' does not exist or is not served by any backend",
                                type="invalid_request_error", param="model", code="model_not_found")
        states = ", ".join(
            f"{b.name}: {b.health.value}" for b in self._gw.pool.backends if model in b.models
        )
        return GatewayError(503, f"no backend can take a request for model '{model}' now ({exc.stage} left none;"
                                 f" {states})", code="no_backend_available", headers={"retry-after": "1"})
