"""``create_app(settings)``: build the components, hang them off the app, start and stop them in lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from gateway import __version__
from gateway.api import errors
from gateway.api.admin import ADMIN, CROSS_ORIGIN, NO_ADMIN, build_admin_router, same_origin
from gateway.api.agent_apis import AgentApi, count_tokens_api, messages_api, responses_api
from gateway.api.openapi import install_openapi
from gateway.api.proxy_endpoint import EndpointSettings, ProxyEndpoint, request_id
from gateway.api.response_store import ResponseStore
from gateway.api.routes import CLIENT, build_router
from gateway.asgi import Message, Receive, Scope, Send, header, send_body
from gateway.auth import KeyScope, KeyStore
from gateway.clock import SYSTEM, Clock
from gateway.config import ApiKeySettings, ConfigError, Settings
from gateway.control import ControlPlane
from gateway.errors import GatewayError
from gateway.kvcache.subscriber import EventHub, StreamSettings
from gateway.kvcache.tokenizer import PromptTokenizer, TokenizerError
from gateway.pool.backend import Backend
from gateway.pool.discovery import Resolver
from gateway.pool.pool import ClientFactory, Pool
from gateway.proxy.accounting import Accounting
from gateway.proxy.admission import Admission, Priorities
from gateway.proxy.dispatch import Dispatcher
from gateway.proxy.forward import ALIASES, PATHS, Forwarder
from gateway.proxy.h1 import H1Transport
from gateway.proxy.models import ModelMap
from gateway.proxy.transport import Transport
from gateway.routing.policies import build_pipeline
from gateway.routing.state import RoutingState
from gateway.state.sealing import fleet_secret
from gateway.state.shared import SharedState, key_place_of
from gateway.structured.offload import ValidationWorkers
from gateway.tasks import cancel_and_wait
from gateway.telemetry.metrics import GatewayMetrics
from gateway.telemetry.recent import Recent
from gateway.telemetry.tracing import Tracing, provider_from_environment
from gateway.workers import InForce, Siblings, WorkerIdentity

log = logging.getLogger("gateway")


# sections a running gateway cannot change: a reload keeps their values and says a restart is needed
RESTART_ONLY = ("server", "state", "scrape", "discovery", "access_log", "responses", "breaker")


class Gateway:
    """The composition root: builds the running gateway's components and wires each to the few others it
    uses. One per app; nothing global. No component is handed this object."""

    def __init__(
        self,
        settings: Settings,
        *,
        client_factory: ClientFactory | None = None,
        registry: CollectorRegistry | None = None,
        resolver: Resolver | None = None,
        tracer_provider: TracerProvider | None = None,
        transport: Transport | None = None,
        worker: WorkerIdentity | None = None,
        config_path: str | None = None,
        config_content: bytes | None = None,
        on_applied: Callable[[InForce], None] | None = None,
        known_keys: Sequence[ApiKeySettings] = (),
        clock: Clock = SYSTEM,
    ) -> None:
        self.settings = settings
        self.clock = clock  # the time its breakers, buckets, admission, pool and stored responses read
        self.config_path = config_path  # the YAML file a reload (SIGHUP, the admin API, the file watch) reads
        self._reloading = asyncio.Lock()
        self.tracing = Tracing(tracer_provider if tracer_provider is not None else provider_from_environment())
        self.kv_events = EventHub(clock)
        # limits and routing state shared with the other processes and replicas, when a store is configured
        # (its messages to the others sealed with a secret they share: state.secret_env, else derived from the
        # Redis password and the keys configured at start; a worker's: its supervisor's, one for all its workers)
        secret = (worker.seal_secret if worker is not None
                  else fleet_secret(settings.state, [k.digest() for k in settings.auth.keys]))
        self.shared = (SharedState(settings.state, secret=secret, clock=clock) if settings.state.url is not None
                       else None)
        routing_state = RoutingState(settings.routing.engine_profile, events=self.kv_events,
                                     tokenizers=load_tokenizers(settings), clock=clock)
        if self.shared is not None:
            routing_state.peers = self.shared
        self.pipeline = build_pipeline(settings.routing, routing_state)
        # one of several workers (server.workers): all but the first take the first one's backend readings
        self.siblings: Siblings | None = None
        several = worker is not None and worker.count > 1
        follow = several and worker is not None and worker.index != 0

        async def leader() -> bytes | None:
            return await self.siblings.leader_snapshot() if self.siblings is not None else None

        self.pool = Pool(settings.backends, settings.scrape, client_factory, discovery=settings.discovery,
                         resolver=resolver, breaker=settings.breaker, leader=leader if follow else None, clock=clock,
                         on_kv_source=lambda: self.kv_events.sync(self._event_streams()))
        self.transport: Transport = transport if transport is not None else H1Transport(settings.timeouts)
        # (its periodic look for slots no release announced: with shared state, at the heartbeat)
        self.admission = Admission(settings.admission, kick_seconds=settings.state.heartbeat_seconds
                                   if settings.state.url else 1.0, clock=clock)
        self.keys = KeyStore(settings.auth, clock=clock)
        self.validation_workers = ValidationWorkers(settings.limits)
        self.metrics = GatewayMetrics(registry)
        self.metrics.watch_pool(self.pool)
        self.metrics.watch_kv_events(self.kv_events)
        if several and worker is not None:
            self.siblings = Siblings(worker, self.metrics.registry, self.pool)
        self._kv_task: asyncio.Task[None] | None = None
        self.forwarder = Forwarder(self.transport, settings.timeouts, settings.server.max_response_bytes,
                                   settings.server.max_response_values)
        self.dispatcher = Dispatcher(self.pool, self.pipeline, self.admission,
                                     self.forwarder, self.metrics, settings.retries,
                                     settings.structured_output, shared=self.shared,
                                     priorities=Priorities(settings.admission, settings.auth.keys),
                                     models=ModelMap(settings.models), checker=self.validation_workers)
        self.pool.on_loop = self.dispatcher.guard.reading
        self.pool.wants_alone = self.dispatcher.guard.wants_alone
        self.pool.on_alone = self.dispatcher.guard.alone
        self.metrics.flow.admission = self.admission
        if self.shared is not None:
            pool, admission = self.pool, self.admission
            # (and every capped key's in-flight places, counted like a backend's slots)
            keys = self.keys
            self.shared.slotted = lambda: ({b.name for b in pool if b.max_concurrency}
                                           | {key_place_of(k.name) for k in keys.settings.keys if k.max_in_flight})
            self.shared.on_freed(lambda name: admission.freed(b for b in pool if name in ("*", b.name)))
            # priority across replicas: each says what waits on it, the others' lower requests yield to it
            shared = self.shared
            admission.announce = lambda model, priority: shared.publish("waiting", [shared.replica, model, priority])
            shared.subscribe("waiting", lambda p: admission.elsewhere(str(p[0]), str(p[1]),
                                                                      None if p[2] is None else int(p[2])))
            self.metrics.watch_state(self.shared)
        self.recent = Recent()  # the operator's last minutes per backend (GET /admin/backends, /ui)
        self.accounting = Accounting(self.metrics, self.pipeline.observe, settings.access_log.enabled, self.recent)
        self.responses = ResponseStore.of(settings.responses,
                                          shared=self.shared.responses if self.shared is not None else None,
                                          clock=clock)
        self.control = ControlPlane(lambda: self.settings, self.pool, self.admission, self.shared,
                                    self.metrics.registry, apply=self.reconfigure, config_path=config_path,
                                    recent=self.recent, models=lambda: self.dispatcher.models,
                                    siblings=self.siblings, config_content=config_content, on_applied=on_applied,
                                    known=known_keys, clock=clock)
        self._endpoints: list[ProxyEndpoint] = []
        self.started_at = int(time.time())

    def endpoint(self, route: str, api: AgentApi | None = None) -> ProxyEndpoint:
        endpoint = ProxyEndpoint(route, EndpointSettings.of(self.settings), keys=self.keys,
                                 workers=self.validation_workers, dispatcher=self.dispatcher, tracing=self.tracing,
                                 live=self.metrics.live, finish=self.accounting, api=api, shared=self.shared)
        self._endpoints.append(endpoint)
        return endpoint

    def endpoints(self) -> dict[str, ProxyEndpoint]:
        """The generation routes, by path: the OpenAI ones, and the agent APIs translated to chat."""
        hot = {path: self.endpoint(route) for route, path in PATHS.items()}
        for path, route in ALIASES.items():
            hot[path] = hot[PATHS[route]]
        for path, api in (("/v1/messages", messages_api()), ("/v1/messages/count_tokens", count_tokens_api()),
                          ("/v1/responses", responses_api(self.responses))):
            hot[path] = self.endpoint(api.name, api)
        return hot

    async def start(self) -> None:
        self.metrics.loop_lag.start()
        if self.siblings is not None:
            await self.siblings.start()
        await self.transport.start()
        await self.pool.start()
        if self.shared is not None:
            await self.shared.start()
        if any(b.kv_events is not None for b in self.settings.backends):
            self.kv_events.sync(self._event_streams())
            if any(b.dns is not None and b.kv_events is not None for b in self.settings.backends):
                self._kv_task = asyncio.create_task(self._follow_replicas(), name="kv-events-replicas")
        server = self.settings.server
        await self.control.start(watch_seconds=server.reload_watch_seconds, settle_seconds=server.reload_settle_seconds)

    def _event_streams(self) -> Iterator[tuple[Backend, StreamSettings]]:
        """Each backend's KV-event stream: where its settings say, or (``discover``) where its engine said."""
        for backend in self.pool:
            kv = self.pool.settings_of(backend).kv_events
            if kv is None:
                continue
            if kv.discover:
                source = backend.kv_source
                if source is None:  # (not said yet, or nothing: the approximate index meanwhile)
                    continue
                yield backend, StreamSettings(source.endpoint, source.replay_endpoint, source.topic,
                                              kv.block_size or source.block_size, kv.silence_seconds,
                                              kv.history_seconds)
                continue
            endpoint, replay = kv.addresses(backend.url)
            yield backend, StreamSettings(endpoint, replay, kv.topic, kv.block_size, kv.silence_seconds,
                                          kv.history_seconds)

    async def _follow_replicas(self) -> None:
        """Replicas found by DNS come and go: subscribe to new ones, drop the gone."""
        while True:
            await asyncio.sleep(self.settings.discovery.interval)
            self.kv_events.sync(self._event_streams())

    # -- reloads --------------------------------------------------------------------------------------------------
    async def reconfigure(self, new: Settings) -> dict[str, object]:
        """Apply a validated configuration without dropping a stream or a queued request: backends (added,
        removed after a drain, changed), keys and limits, routing, timeouts, retries, input limits, admission,
        structured output and the models section (aliases, splits, fallbacks). Sections that only a restart
        applies (the listener, workers, shared state, scraping, discovery, the access log, stored responses, the
        breaker, tokenizers, DNS entries) keep their running values and are named in ``restart_needed``."""
        async with self._reloading:
            old = self.settings
            restart = [name for name in RESTART_ONLY if getattr(old, name) != getattr(new, name)]
            kept: dict[str, object] = {name: getattr(old, name) for name in RESTART_ONLY}
            routing = new.routing
            if (routing.tokenizers, routing.engine_profile, routing.tokenize_max_chars) != (
                    old.routing.tokenizers, old.routing.engine_profile, old.routing.tokenize_max_chars):
                restart.append("routing.tokenizers/engine_profile/tokenize_max_chars")
                routing = routing.model_copy(update={"tokenizers": old.routing.tokenizers,
                                                     "engine_profile": old.routing.engine_profile,
                                                     "tokenize_max_chars": old.routing.tokenize_max_chars})
            backends = [b for b in new.backends if b.dns is None] + [b for b in old.backends if b.dns is not None]
            if [b for b in new.backends if b.dns is not None] != [b for b in old.backends if b.dns is not None]:
                restart.append("backends (DNS entries)")
            pipeline = self.dispatcher.pipeline
            if routing != old.routing:
                pipeline = build_pipeline(routing, pipeline.state)
            effective = new.model_copy(update={**kept, "routing": routing, "backends": backends})
            self.keys.update(effective.auth)  # first: a revoked key is revoked whatever fails after it
            changes = await self.pool.reconcile(effective.backends, effective.server.shutdown_timeout)
            self.admission.settings = effective.admission
            self.dispatcher.reconfigure(pipeline, effective.retries, effective.structured_output,
                                        Priorities(effective.admission, effective.auth.keys),
                                        ModelMap(effective.models))
            self.pipeline = pipeline
            self.accounting.relearn(pipeline.observe)
            self.forwarder.set_timeouts(effective.timeouts)
            if isinstance(self.transport, H1Transport):
                self.transport.set_timeouts(effective.timeouts)
            self.validation_workers.set_limits(effective.limits)
            for endpoint in self._endpoints:
                endpoint.reconfigure(EndpointSettings.of(effective))
            self.settings = effective
            if any(b.kv_events is not None for b in (*old.backends, *effective.backends)):
                self.kv_events.sync(self._event_streams())
            return {**changes, "restart_needed": restart,
                    "sections": [name for name in type(new).model_fields
                                 if name not in RESTART_ONLY and getattr(old, name) != getattr(effective, name)]}

    async def stop(self) -> None:
        await self.control.stop()
        await cancel_and_wait([self._kv_task])
        await self.kv_events.stop()
        if self.shared is not None:
            await self.shared.stop()
        await self.pool.stop()
        await self.transport.close()
        await self.validation_workers.close()
        if self.siblings is not None:
            await self.siblings.stop()
        await self.tracing.shutdown()
        await self.metrics.loop_lag.stop()


def load_tokenizers(settings: Settings) -> dict[str, PromptTokenizer]:
    """``routing.tokenizers``: each model's tokenizer and chat template, loaded once."""
    loaded: dict[Path, PromptTokenizer] = {}
    out: dict[str, PromptTokenizer] = {}
    for model, directory in settings.routing.tokenizers.items():
        if directory not in loaded:
            try:
                loaded[directory] = PromptTokenizer.from_dir(directory,
                                                             max_chars=settings.routing.tokenize_max_chars)
            except TokenizerError as exc:
                raise ConfigError(f"routing.tokenizers: {exc}") from None
        out[model] = loaded[directory]
    return out


def create_app(
    settings: Settings,
    *,
    client_factory: ClientFactory | None = None,
    registry: CollectorRegistry | None = None,
    resolver: Resolver | None = None,
    tracer_provider: TracerProvider | None = None,
    transport: Transport | None = None,
    worker: WorkerIdentity | None = None,
    config_path: str | None = None,
    config_content: bytes | None = None,
    on_applied: Callable[[InForce], None] | None = None,
    known_keys: Sequence[ApiKeySettings] = (),
    clock: Clock = SYSTEM,
) -> GatewayApp:
    """The gateway's ASGI app. ``config_path``: the file a reload reads, ``config_content`` the bytes of it that
    ``settings`` came from (what the file watch compares the file with); ``on_applied`` is told what is in force
    after each change (a worker tells its supervisor); ``known_keys``: the keys the gateway's workers have had in
    force (``InForce.known``)."""
    gateway = Gateway(settings, client_factory=client_factory, registry=registry, resolver=resolver,
                      tracer_provider=tracer_provider, transport=transport, worker=worker, config_path=config_path,
                      config_content=config_content, on_applied=on_applied, known_keys=known_keys,
                      clock=clock)

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
    errors.install(app)
    install_openapi(app)
    siblings = gateway.siblings
    app.include_router(build_router(gateway.pool, gateway.metrics.registry, gateway.started_at,
                                    exposition=siblings.metrics if siblings is not None else None,
                                    aliases=lambda: gateway.dispatcher.models.aliases(),
                                    keyed=lambda: gateway.keys.enabled))
    app.include_router(build_admin_router(gateway.control))
    return GatewayApp(app, gateway, gateway.endpoints(), gateway.keys)


class GatewayApp:
    """The ASGI app: the generation routes go straight to their raw endpoints; everything else (lifespan,
    models, health, metrics, unknown paths) goes through FastAPI.

    Skipping the framework's middleware stack on the hot path measurably lowers added latency under
    concurrency (see the commit introducing this class); the endpoints render their own OpenAI errors.
    """

    def __init__(self, app: FastAPI, gateway: Gateway, hot: dict[str, ProxyEndpoint], keys: KeyStore) -> None:
        self.fastapi = app
        self.gateway = gateway  # for tests and embedding: the components, as built
        self._hot = hot
        self._keys = keys  # (and their auth settings, which a reload replaces)

    def _needs_key(self, path: str) -> bool:
        """With API keys configured: the OpenAI API and the admin API always; health and metrics when the
        operator says so."""
        auth = self._keys.settings
        if not self._keys.enabled:
            return False
        if path.startswith(ADMIN):
            return True
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
        if path.startswith(ADMIN):
            return "admin"
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
        if scope["path"].startswith(ADMIN) and not self._keys.enabled:
            await send_body(send, 403, NO_ADMIN, [(b"x-request-id", rid)])
            return
        if scope["path"].startswith(ADMIN) and scope["method"] not in ("GET", "HEAD") and not same_origin(scope):
            # as on the admin listener: a change from a browser only from a page of this origin (QA drained a
            # backend through the main port with Origin: http://evil.example)
            await send_body(send, 403, CROSS_ORIGIN.body(), [(b"x-request-id", rid)])
            return
        if self._needs_key(scope["path"]):
            try:
                client = self._keys.authenticate(header(scope, b"authorization"), header(scope, b"x-api-key"),
                                                        self._scope(scope["path"]))
            except GatewayError as exc:
                await send_body(send, exc.status, exc.body(), [(b"x-request-id", rid)])
                return
            scope.setdefault("state", {})[CLIENT] = client  # the routes filter models by its allow-list
        elif scope["path"] == "/ready" and self._keys.enabled:
            # a probe needs no key, but an operator's key sees the details (a wrong one: as if none was sent, so
            # the status a probe gets never depends on a header it should not be sending)
            with contextlib.suppress(GatewayError):
                client = self._keys.authenticate(header(scope, b"authorization"), header(scope, b"x-api-key"), None)
                scope.setdefault("state", {})[CLIENT] = client

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid)]
            await send(message)

        await self.fastapi(scope, receive, send_with_id)
