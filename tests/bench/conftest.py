"""Fixtures for the benchmark tool's tests: the raw backend and a gateway in front of emulators, on loopback."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.bench.rawbackend import RawBackend, RawBackendConfig
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from tests.conftest import ServerThread, serve_in_thread
from tests.waiting import wait_until


class RawBackendThread:
    """A :class:`RawBackend` on its own event loop in a daemon thread."""

    def __init__(self, config: RawBackendConfig) -> None:
        self.backend = RawBackend(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def __enter__(self) -> RawBackendThread:
        self._thread.start()
        self.call(self.backend.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self.backend.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    @property
    def url(self) -> str:
        return self.backend.url


@pytest.fixture
def raw_backend() -> Iterator[RawBackendThread]:
    with RawBackendThread(RawBackendConfig(tokens=8, gap_ms=1.0)) as rb:
        yield rb


class GatewayFleet:
    def __init__(self, fleet: FleetThread, gateway: ServerThread) -> None:
        self.fleet = fleet
        self.gateway = gateway
        self.url = gateway.url

    def backend_url(self, name: str) -> str:
        return self.fleet.fleet[name].url


@pytest.fixture(scope="module")
def gateway_fleet() -> Iterator[GatewayFleet]:
    """Two emulated engines (vLLM and SGLang, fast time) serving one model, behind a gateway."""
    specs = [SimSpec(engine=e, model="m", name=f"sim-{e}", time_scale=50.0) for e in ("vllm", "sglang")]
    with FleetThread(specs) as fleet:
        backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url} for s in fleet.fleet.servers]
        settings = settings_from_mapping({"backends": backends, "routing": {"policy": "least-load"},
                                          "scrape": {"interval": 0.1, "timeout": 1.0}})
        with serve_in_thread(create_app(settings)) as gateway:
            _wait_discovered(gateway.url, len(backends))
            yield GatewayFleet(fleet, gateway)


def _wait_discovered(url: str, n: int, timeout: float = 15.0) -> None:
    def discovered() -> bool:
        states = httpx.get(url + "/ready").json().get("backends", {}).values()
        return sum(1 for b in states if b.get("health") == "ready" and b.get("models")) == n

    wait_until(discovered, f"the gateway discovered its {n} backends", within=timeout)
