"""The light routes: model list, liveness, readiness, Prometheus metrics.

With API keys configured, :class:`gateway.app.GatewayApp` authenticates these requests before FastAPI sees
them and leaves the key's :class:`~gateway.auth.Client` in ``scope["state"][CLIENT]`` (absent when the
gateway is open, and on an unprotected ``/ready`` asked without a valid key).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.auth import Client
from gateway.errors import GatewayError
from gateway.pool.pool import Pool

CLIENT = "gateway.client"  # scope["state"] key of the authenticated API key
# the scopes of an operator's keys: with API keys configured, only such a key sees /ready's per-model and
# per-backend state (an anonymous probe, or a client key, would otherwise learn the models a key's allow-list hides)
DETAIL_SCOPES = frozenset({"admin", "metrics"})


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _allowed(request: Request, models: list[str]) -> list[str]:
    """The models the request's API key may use (all of them when the gateway is open)."""
    client: Client | None = request.scope.get("state", {}).get(CLIENT)
    return models if client is None else [m for m in models if client.allows(m)]


def _model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "llm-gateway"}


def _sees_details(request: Request, keyed: bool) -> bool:
    """Whether /ready may describe each model and backend to this request: always on an open gateway; with API
    keys, only to an operator's key (DETAIL_SCOPES)."""
    if not keyed:
        return True
    client: Client | None = request.scope.get("state", {}).get(CLIENT)
    return client is not None and not DETAIL_SCOPES.isdisjoint(client.settings.scopes)


def build_router(pool: Pool, registry: CollectorRegistry, created: int, *,
                 exposition: Callable[[], Awaitable[bytes]] | None = None,
                 aliases: Callable[[], dict[str, list[str]]] | None = None,
                 keyed: Callable[[], bool] = lambda: False) -> APIRouter:
    """The routes, over the pool they report on, the registry they expose and the models' creation time.
    ``exposition``: what /metrics serves instead of the registry's own (every worker's figures, added up);
    ``aliases``: the configured aliases and the served models each splits over (listed as models); ``keyed``:
    whether API keys are configured now (then /ready details only to an operator's key)."""
    router = APIRouter()

    def servable() -> list[str]:
        served = pool.models()
        if aliases is None:
            return served
        names = set(served)
        names.update(alias for alias, targets in aliases().items() if names.intersection(targets))
        return sorted(names)

    @router.get("/v1/models")
    async def list_models(request: Request) -> JSONBytes:
        """Models served by at least one routable backend, and aliases with such a model among their targets,
        that the API key may use."""
        models = _allowed(request, servable())
        return JSONBytes({"object": "list", "data": [_model_card(m, created) for m in models]})

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> JSONBytes:
        """One model, as listed; a model the API key may not use is 404 like an unknown one (as OpenAI answers),
        so a key learns nothing of models beyond its allow-list."""
        if model not in _allowed(request, servable()):
            raise GatewayError(404, f"The model '{model}' does not exist or is not served by any backend",
                               type="invalid_request_error", param="model", code="model_not_found")
        return JSONBytes(_model_card(model, created))

    @router.get("/health")
    async def health() -> JSONBytes:
        """Liveness: the process answers."""
        return JSONBytes({"status": "ok"})

    @router.get("/ready")
    async def ready(request: Request) -> JSONBytes:
        """Readiness: can this gateway serve a request now, not merely "is the process alive" (that is /health).

        A model is ready when at least one backend serving it is routable: healthy by its last check and not
        ejected by its circuit breaker (an ejected backend counts again once its cooldown ends, since the next
        request is its probe). The body lists every known model with its routable backends, and every backend's
        health and breaker state.

        The status is 200 while at least one model is ready and 503 when none is. So a gateway with a single
        model leaves its Service when that model cannot be served, while a gateway serving several models stays
        in for the ones it can serve (a request for the model that is down gets 503 from the API itself); alert
        on ``gateway_model_ready`` to hear of the latter.

        With API keys configured, the body lists models and backends only to a key with the ``admin`` or
        ``metrics`` scope; anyone else (a probe without a key, a client key) gets the status and counts only
        (``ready_models``, ``known_models``, ``routable_backends``, ``known_backends``). The status code is the
        same for everyone.
        """
        backends = {b.name: {"engine": b.engine, "health": b.health.value, "breaker": b.breaker.state.value,
                             "routable": b.routable, "models": sorted(b.models)}
                    for b in pool.backends}
        serving: dict[str, list[str]] = {m: [] for m in sorted(pool.known_models())}
        for b in pool.backends:
            if b.routable:
                for m in b.models:
                    serving[m].append(b.name)
        models = {m: {"ready": bool(names), "backends": names} for m, names in serving.items()}
        servable = any(names for names in serving.values())
        status, code = ("ready", 200) if servable else ("not_ready", 503)
        if not _sees_details(request, keyed()):
            return JSONBytes({"status": status, "ready_models": sum(1 for m in models.values() if m["ready"]),
                              "known_models": len(models),
                              "routable_backends": sum(1 for b in backends.values() if b["routable"]),
                              "known_backends": len(backends),
                              "detail": "each model and backend: with a key whose scopes include admin or metrics"},
                             status_code=code)
        return JSONBytes({"status": status, "models": models, "backends": backends}, status_code=code)

    @router.get("/metrics")
    async def metrics() -> Response:
        body = generate_latest(registry) if exposition is None else await exposition()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
