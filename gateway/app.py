"""``create_app(settings)``: build the components, hang them off the app, start and stop them in lifespan."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from gateway import __version__
from gateway.api import errors
from gateway.api.proxy_endpoint import ProxyEndpoint
from gateway.api.routes import router
from gateway.config import Settings
from gateway.pool.pool import ClientFactory, Pool
from gateway.proxy.exchange import Exchange
from gateway.proxy.forward import PATHS, Forwarder
from gateway.proxy.upstream import Upstream
from gateway.routing.policies import build_pipeline
from gateway.telemetry.metrics import UNKNOWN, GatewayMetrics


class Gateway:
    """The running gateway's components. One per app; nothing global."""

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: ClientFactory | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.pipeline = build_pipeline(settings.routing.policy)
        self.pool = Pool(settings.backends, settings.scrape, client_factory)
        self.upstream = Upstream(settings.timeouts)
        self.forwarder = Forwarder(
            self.upstream,
            {
                b.name: self.pool.adapters[b.name].auth_headers(b.resolved_api_key())
                for b in settings.backends
            },
        )
        self.metrics = GatewayMetrics(registry)
        self.metrics.watch_pool(self.pool)
        self.started_at = int(time.time())

    async def start(self) -> None:
        await self.upstream.start()
        await self.pool.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.upstream.close()

    def observe(self, exchange: Exchange) -> None:
        """Account one finished request in the metrics."""
        m = self.metrics
        backend = exchange.backend.name if exchange.backend else UNKNOWN
        model = exchange.model if exchange.model is not None else UNKNOWN
        status_class = f"{exchange.status // 100}xx" if exchange.status else "none"
        m.requests.labels(exchange.route, model, backend, status_class, exchange.outcome).inc()
        if exchange.backend is None:
            return
        end = exchange.t_end or time.perf_counter()
        m.request_duration.labels(exchange.route, backend, model).observe(end - exchange.t_start)
        if exchange.t_first is not None:
            m.time_to_first_token.labels(backend, model).observe(exchange.t_first - exchange.t_start)
        if exchange.usage:
            m.prompt_tokens.labels(backend, model).inc(exchange.usage_int("prompt_tokens"))
            m.completion_tokens.labels(backend, model).inc(exchange.usage_int("completion_tokens"))
            m.cached_tokens.labels(backend, model).inc(exchange.cached_tokens())


def create_app(
    settings: Settings,
    *,
    client_factory: ClientFactory | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    gateway = Gateway(settings, client_factory=client_factory, registry=registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="LLM gateway", version=__version__, lifespan=lifespan)
    app.state.gateway = gateway
    errors.install(app)
    app.include_router(router)
    for route, path in PATHS.items():
        app.add_route(path, ProxyEndpoint(gateway, route))  # type: ignore[arg-type]
    return app
