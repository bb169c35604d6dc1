"""The whole gateway in this process with no socket, for unit-tier tests: the engines' data plane is a
:class:`MockTransport`, their health, models and load readings httpx's mock transport, and the client talks to
the app through ``httpx.ASGITransport``. Every engine serves model ``m``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx

from gateway.app import GatewayApp, create_app
from gateway.clock import SYSTEM, Clock
from gateway.config import BackendSettings, settings_from_mapping
from gateway.engines.base import EngineAdapter
from gateway.proxy.transport import MockRequest, MockResponse, MockTransport

Engine = Callable[[MockRequest], MockResponse | Awaitable[MockResponse]]


def control_plane(settings: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
    """An engine's health, models (``m``) and an idle vLLM load reading."""
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_running{model_name="m"} 0\n'
                                             'vllm:num_requests_waiting{model_name="m"} 0\n')
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url=settings.url or "")


@contextlib.asynccontextmanager
async def in_process(config: dict[str, Any], engine: Engine,
                     clock: Clock = SYSTEM) -> AsyncIterator[tuple[GatewayApp, httpx.AsyncClient]]:
    """The gateway of ``config`` over ``engine`` (every backend's answers), started; its app and a client."""
    app = create_app(settings_from_mapping(config), client_factory=control_plane, transport=MockTransport(engine),
                     clock=clock)
    await app.gateway.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
            yield app, client
    finally:
        await app.gateway.stop()
