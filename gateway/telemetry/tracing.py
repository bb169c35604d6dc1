"""Tracing with OpenTelemetry: one SERVER span per request, with a ``route`` child and a CLIENT ``upstream``
child, GenAI semantic-convention attributes, W3C ``traceparent`` taken from the client and passed on to the
backend.

Configured by the standard environment variables: tracing is on when an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) or ``OTEL_TRACES_EXPORTER`` names
``otlp`` or ``console``, and ``OTEL_SDK_DISABLED`` is not true; the exporter (OTLP over HTTP/protobuf) reads
its own ``OTEL_EXPORTER_OTLP_*`` settings, the resource ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``.
Off, the request path makes no tracing call at all: ``Tracing.enabled`` is checked once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("gateway.tracing")
SHUTDOWN_SECONDS = 5.0  # what exporting the last spans may add to a shutdown

OPERATION = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings", "rerank": "rerank"}
_PROPAGATOR = TraceContextTextMapPropagator()


def provider_from_environment(environ: Mapping[str, str] = os.environ) -> TracerProvider | None:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    exporters = [e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not exporters:
        exporters = ["otlp"] if endpoint else []
    if not exporters or exporters == ["none"]:
        return None
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "llm-gateway")})
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console, none)", name)
    return provider


class Tracing:
    """The gateway's tracer, or nothing: ``enabled`` is False when no provider is configured."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self._tracer = provider.get_tracer("llm-gateway") if provider is not None else None

    def start_request(self, route: str, headers: list[tuple[bytes, bytes]]) -> Span:
        """The request's span, a child of the client's ``traceparent`` when it sent one."""
        assert self._tracer is not None
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                   if k in (b"traceparent", b"tracestate")}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        operation = OPERATION.get(route, route)
        span = self._tracer.start_span(operation, context=parent, kind=SpanKind.SERVER,
                                       attributes={"gen_ai.operation.name": operation})
        return span

    def start_child(self, parent: Span, name: str, kind: SpanKind = SpanKind.INTERNAL,
                    attributes: dict[str, Any] | None = None) -> Span:
        assert self._tracer is not None
        return self._tracer.start_span(name, context=trace.set_span_in_context(parent), kind=kind,
                                       attributes=attributes)

    @staticmethod
    def inject(span: Span) -> dict[str, str]:
        """W3C trace-context headers naming ``span`` as the parent, for the upstream request."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, Context()))
        return carrier

    @staticmethod
    def fail(span: Span, error_type: str, message: str) -> None:
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, message))

    async def shutdown(self, within: float = SHUTDOWN_SECONDS) -> None:
        """Export what is left and stop, waiting ``within`` seconds at most: the exporter waits out its own
        timeouts on a collector that does not answer (a black hole held the gateway's exit 30 s, on the event
        loop). Past it, the spans not yet exported are dropped, and it says so."""
        provider = self.provider
        if provider is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def stop() -> None:
            try:
                provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=stop, name="otel-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(done, within)
        except TimeoutError:
            log.warning("tracing: the span exporter did not finish within %g s; the spans it had not sent are "
                        "dropped", within)


class RequestTrace:
    """The spans of one request. Created only when tracing is enabled."""

    __slots__ = ("_route", "_tracing", "_upstream", "span")

    def __init__(self, tracing: Tracing, route: str, headers: list[tuple[bytes, bytes]]) -> None:
        self._tracing = tracing
        self.span = tracing.start_request(route, headers)
        self._route: Span | None = None
        self._upstream: Span | None = None

    def request(self, operation: str, model: str, max_tokens: int | None, stream: bool) -> None:
        """``operation``: the route the client called (``responses`` and ``messages`` too)."""
        self.span.update_name(f"{OPERATION.get(operation, operation)} {model}")
        self.span.set_attribute("gen_ai.request.model", model)
        self.span.set_attribute("gen_ai.request.stream", stream)
        if max_tokens is not None:
            self.span.set_attribute("gen_ai.request.max_tokens", max_tokens)

    def route_start(self) -> None:
        self._route = self._tracing.start_child(self.span, "route")

    def route_end(self, policy: str, reason: str, detail: str, backend: str | None) -> None:
        if self._route is None:
            return
        self._route.set_attributes({"gateway.route.policy": policy, "gateway.route.reason": reason,
                                    "gateway.route.detail": detail})
        if backend is not None:
            self._route.set_attribute("gateway.backend", backend)
        self._route.end()
        self._route = None
        self.span.set_attributes({"gateway.route.policy": policy, "gateway.route.reason": reason})

    def upstream_start(self, backend: str, engine: str, url: str, path: str) -> dict[str, str]:
        """Start the CLIENT span of one attempt; returns the traceparent headers to send with it."""
        self.upstream_end(None, None)
        host, _, port = url.split("://", 1)[-1].partition(":")
        attributes: dict[str, Any] = {"http.request.method": "POST", "url.full": url + path, "server.address": host,
                                      "gateway.backend": backend, "gen_ai.provider.name": engine}
        if port.isdigit():
            attributes["server.port"] = int(port)
        self._upstream = self._tracing.start_child(self.span, f"POST {path}", SpanKind.CLIENT, attributes)
        self.span.set_attributes({"gateway.backend": backend, "gen_ai.provider.name": engine})
        return Tracing.inject(self._upstream)

    def upstream_end(self, status: int | None, error: str | None) -> None:
        if self._upstream is None:
            return
        if status:
            self._upstream.set_attribute("http.response.status_code", status)
        if error is not None:
            Tracing.fail(self._upstream, "upstream_failed", error)
        self._upstream.end()
        self._upstream = None

    def finish(self, status: int, outcome: str, usage: dict[str, Any] | None, ttft: float | None,
               response_model: str | None = None) -> None:
        self.upstream_end(status, None if outcome in ("success", "client_error", "disconnected") else outcome)
        span = self.span
        if status:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("gateway.outcome", outcome)
        if ttft is not None:
            span.set_attribute("gen_ai.response.time_to_first_chunk", ttft)
        if usage:
            for key, attribute in (("prompt_tokens", "gen_ai.usage.input_tokens"),
                                   ("completion_tokens", "gen_ai.usage.output_tokens")):
                value = usage.get(key)
                if isinstance(value, int):
                    span.set_attribute(attribute, value)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                span.set_attribute("gen_ai.usage.cache_read_input_tokens", details["cached_tokens"])
        if response_model:
            span.set_attribute("gen_ai.response.model", response_model)
        if status >= 500 or outcome not in ("success", "client_error", "disconnected"):
            Tracing.fail(span, outcome, f"{outcome} (HTTP {status})" if status else outcome)
        span.end()
