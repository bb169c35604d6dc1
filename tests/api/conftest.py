"""The gateway in front of emulated engines, all on loopback, driven by the official OpenAI SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gateway.app import GatewayApp, create_app
from gateway.config import settings_from_mapping
from gateway.sim import FleetThread, SimServer, SimSpec
from tests.conftest import ServerThread, serve_in_thread

ENGINES = ("llamacpp", "vllm", "sglang", "tabbyapi")
TIME_SCALE = 20.0  # emulated engines run 20x faster than the real ones would


def gateway_settings(servers: list[SimServer], *, real: dict[str, str] | None = None, **extra: Any) -> Any:
    """The gateway in front of ``servers`` (and ``real``: more backends, as written in a config)."""
    backends = [{"name": s.spec.name, "engine": s.spec.engine, "url": s.url,
                 **({"api_key": s.spec.api_key} if s.spec.api_key else {})} for s in servers]
    backends += [{"name": name, "engine": "llamacpp", "url": url} for name, url in (real or {}).items()]
    # (a 3 s health-check timeout: beside the rest of the suite, in two processes, an idle emulator's check once
    # took past 1 s, and a backend taken for down answered a test's request 503)
    return settings_from_mapping({"backends": backends, "scrape": {"interval": 0.1, "timeout": 3.0}, **extra})


class Running:
    """A fleet and a gateway in front of it."""

    def __init__(self, fleet: FleetThread, gateway: ServerThread, app: GatewayApp) -> None:
        self.fleet = fleet
        self.gateway = gateway
        self.app = app
        self.url = gateway.url

    def server(self, name: str) -> SimServer:
        return self.fleet.fleet[name]


@pytest.fixture(scope="module")
def engines() -> Iterator[Running]:
    """One emulated server per engine, each serving its own model ``m-<engine>`` (so a test picks the engine
    by model), all keyed with their own API keys, behind one gateway."""
    specs = [SimSpec(engine=e, model=f"m-{e}", name=f"sim-{e}", time_scale=TIME_SCALE, api_key=f"key-{e}")
             for e in ENGINES]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


@pytest.fixture
def pair() -> Iterator[Running]:
    """Two vLLM-like servers serving the same model, behind a gateway; for failure and recovery tests."""
    specs = [SimSpec(engine="vllm", model="shared", name=f"vllm-{x}", time_scale=TIME_SCALE) for x in "ab"]
    with FleetThread(specs) as fleet:
        app = create_app(gateway_settings(fleet.fleet.servers))
        with serve_in_thread(app) as gateway:
            yield Running(fleet, gateway, app)


@contextmanager
def streaming(url: str, key: str, body: dict[str, Any]) -> Iterator[None]:
    """A stream of ``body`` with API key ``key`` open (its first bytes come) for the time of the block, read as it
    comes in a thread (a client that stops reading is cut off, and what its request held is given back)."""
    begun, done = threading.Event(), threading.Event()

    def hold() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}"}) as held:
            assert held.status_code == 200, held.read()
            for _ in held.iter_raw():
                begun.set()
                if done.is_set():
                    break

    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(hold)
        assert begun.wait(30), "the stream did not begin"
        try:
            yield
        finally:
            done.set()
        holding.result()
