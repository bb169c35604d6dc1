"""The light routes: model list, liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import GatewayError

if TYPE_CHECKING:
    from gateway.app import Gateway

router = APIRouter()


class JSONBytes(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


def _model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "llm-gateway"}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONBytes:
    """Models served by at least one healthy backend."""
    gw = _gateway(request)
    return JSONBytes({"object": "list", "data": [_model_card(m, gw.started_at) for m in gw.pool.models()]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONBytes:
    gw = _gateway(request)
    if model not in gw.pool.models():
        raise GatewayError(404, f"The model '{model}' does not exist or is not served by any backend",
                           type="invalid_request_error", param="model", code="model_not_found")
    return JSONBytes(_model_card(model, gw.started_at))


@router.get("/health")
async def health() -> JSONBytes:
    """Liveness: the process answers."""
    return JSONBytes({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONBytes:
    """Readiness: at least one backend can take a request."""
    gw = _gateway(request)
    backends = {b.name: {"engine": b.engine, "health": b.health.value, "models": sorted(b.models)}
                for b in gw.pool.backends}
    routable = any(b.routable and b.models for b in gw.pool.backends)
    return JSONBytes(
        {"status": "ready" if routable else "not_ready", "backends": backends}, status_code=200 if routable else 503
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
