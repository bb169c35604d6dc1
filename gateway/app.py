"""``create_app(settings)``: build the components, hang them off the app, start and stop them in lifespan."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from gateway import __version__
from gateway.api import errors
from gateway.api.openapi import install_openapi
from gateway.api.proxy_endpoint import ProxyEndpoint, request_id
from gateway.api.routes import CLIENT, router
from gateway.asgi import Message, Receive, Scope, Send, header, send_body
from gateway.auth import KeyScope, KeyStore
from gateway.config import Settings
from gateway.errors import GatewayError
from gateway.pool.backend import Backend
from gateway.pool.discovery import Resolver
from gateway.pool.pool import ClientFactory, Pool
from gateway.proxy.accounting import access_record, outcome_of, record_metrics
from gateway.proxy.admission import Admission
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import PATHS, Forwarder
from gateway.proxy.upstream import Upstream
from gateway.routing.pipeline import Decision
from gateway.routing.policies import build_pipeline
from gateway.routing.state import RoutingState
from gateway.structured.offload import ValidationWorkers
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.tracing import Tracing, provider_from_environment

access_log = logging.getLogger("gateway.access")


class Gateway:
    """The running gateway's components. One per app; nothing global."""

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: ClientFactory | None = None,
        registry: CollectorRegistry | None = None,
        resolver: Resolver | None = None,
        tracer_provider: TracerProvider | None = None,
    ) -> None:
        self.settings = settings
        self.tracing = Tracing(tracer_provider if tracer_provider is not None else provider_from_environment())
        self.routing = RoutingState(settings.routing.engine_profile)
        self.pipeline = build_pipeline(settings.routing, self.routing)
        self.pool = Pool(settings.backends, settings.scrape, client_factory, discovery=settings.discovery,
                         resolver=resolver, breaker=settings.breaker)
        self.upstream = Upstream(settings.timeouts)
        self.forwarder = Forwarder(self.upstream)
        self.admission = Admission(settings.admission)
        self.keys = KeyStore(settings.auth)
        self.validation_workers = ValidationWorkers(settings.limits)
        self.dispatcher = Dispatcher(self)
        self.metrics = GatewayMetrics(registry)
        self.metrics.watch_pool(self.pool)
        self.started_at = int(time.time())
        self._access_log = settings.access_log.enabled

    async def start(self) -> None:
        await self.upstream.start()
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.upstream.close()
        await self.validation_workers.close()
        self.tracing.shutdown()

    def observe_decision(self, decision: Decision) -> None:
        m, child = self.metrics, self.metrics.child
        child(m.routing_decisions, decision.ranked[0].name, decision.reason).inc()
        for plugin, seconds in decision.timings.items():
            child(m.routing_plugin_seconds, plugin).observe(seconds)

    def observe_invalid_output(self, backend: Backend, action: str) -> None:
        self.metrics.child(self.metrics.invalid_outputs, backend.name, backend.engine, action).inc()

    def observe(self, exchange: Exchange) -> None:
        """Account one finished request in the metrics and the access log, and let routing learn from it."""
        if exchange.request is not None and exchange.backend is not None and exchange.outcome != "pending":
            self.pipeline.observe(outcome_of(exchange, exchange.request), exchange.backend)
        record_metrics(self.metrics, exchange)
        if self._access_log:
            access_log.info(access_record(exchange).decode())


def create_app(
    settings: Settings,
    *,
    client_factory: ClientFactory | None = None,
    registry: CollectorRegistry | None = None,
    resolver: Resolver | None = None,
    tracer_provider: TracerProvider | None = None,
) -> GatewayApp:
    gateway = Gateway(settings, client_factory=client_factory, registry=registry, resolver=resolver,
                      tracer_provider=tracer_provider)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    # /docs and /redoc load their scripts from a CDN (broken offline and under a strict CSP): off unless asked
    # for; /openapi.json is always served. No redirect on a trailing slash: Starlette builds its Location from
    # the client's Host header.
    docs = settings.server.docs
    app = FastAPI(title="LLM gateway", version=__version__, lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, redirect_slashes=False)
    app.state.gateway = gateway
    errors.install(app)
    install_openapi(app)
    app.include_router(router)
    return GatewayApp(app, gateway, {path: ProxyEndpoint(gateway, route) for route, path in PATHS.items()})


class GatewayApp:
    """The ASGI app: the generation routes go straight to their raw endpoints; everything else (lifespan,
    models, health, metrics, unknown paths) goes through FastAPI.

    Skipping the framework's middleware stack on the hot path measurably lowers added latency under
    concurrency (see the commit introducing this class); the endpoints render their own OpenAI errors.
    """

    def __init__(self, app: FastAPI, gateway: Gateway, hot: dict[str, ProxyEndpoint]) -> None:
        self.fastapi = app
        self.gateway = gateway
        self._hot = hot

    def _needs_key(self, path: str) -> bool:
        """With API keys configured: the OpenAI API always; health and metrics when the operator says so."""
        auth = self.gateway.settings.auth
        if not self.gateway.keys.enabled:
            return False
        if path in ("/health", "/ready"):
            return auth.protect_health
        if path == "/metrics":
            return auth.protect_metrics
        return path.startswith("/v1/")

    @staticmethod
    def _scope(path: str) -> KeyScope | None:
        """The scope the key needs: ``metrics`` for /metrics, ``inference`` for the OpenAI API; /health and
        /ready take any valid key."""
        if path == "/metrics":
            return "metrics"
        return "inference" if path.startswith("/v1/") else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fastapi(scope, receive, send)
            return
        endpoint = self._hot.get(scope["path"])
        if endpoint is not None:
            await endpoint(scope, receive, send)
            return
        rid = request_id(scope).encode()
        if self._needs_key(scope["path"]):
            try:
                client = self.gateway.keys.authenticate(header(scope, b"authorization"), header(scope, b"x-api-key"),
                                                        self._scope(scope["path"]))
            except GatewayError as exc:
                await send_body(send, exc.status, exc.body(), [(b"x-request-id", rid)])
                return
            scope.setdefault("state", {})[CLIENT] = client  # the routes filter models by its allow-list

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        await self.fastapi(scope, receive, send_with_id)
