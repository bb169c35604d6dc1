"""The set of backends and the background loop that keeps each one's health, load and models fresh."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import httpx

from gateway.config import BackendSettings, ScrapeSettings
from gateway.engines import BackendError, EngineAdapter, create_adapter
from gateway.pool.backend import Backend
from gateway.pool.state import Health, Probe

log = logging.getLogger("gateway.pool")

ClientFactory = Callable[[BackendSettings, EngineAdapter], httpx.AsyncClient]


def default_client_factory(scrape: ScrapeSettings) -> ClientFactory:
    def factory(settings: BackendSettings, adapter: EngineAdapter) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=settings.url,
            headers=adapter.auth_headers(settings.resolved_api_key()),
            timeout=scrape.timeout,
        )

    return factory


class Pool:
    """Owns the backends. ``start`` probes every backend once (so the gateway starts ready when it can be)
    and then runs one scrape loop per backend; ``stop`` ends them and closes their clients."""

    def __init__(
        self,
        backends: list[BackendSettings],
        scrape: ScrapeSettings,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self._scrape = scrape
        self._settings = {b.name: b for b in backends}
        self._factory = client_factory or default_client_factory(scrape)
        self.backends: list[Backend] = [
            Backend(
                b.name,
                b.engine,
                b.url,
                models=b.models,
                max_concurrency=b.max_concurrency,
                stale_after=scrape.stale_after,
            )
            for b in backends
        ]
        self.adapters: dict[str, EngineAdapter] = {b.name: create_adapter(b.engine) for b in backends}
        for backend in self.backends:
            backend.structured = self.adapters[backend.name].structured
        self._by_name = {b.name: b for b in self.backends}
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._cycles: dict[str, int] = {}

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.backends)

    def get(self, name: str) -> Backend:
        return self._by_name[name]

    def models(self) -> list[str]:
        """Models served by at least one routable backend."""
        return sorted({m for b in self.backends if b.routable for m in b.models})

    def known_models(self) -> frozenset[str]:
        """Models any backend has served (routable or not)."""
        return frozenset(m for b in self.backends for m in b.models)

    async def start(self) -> None:
        for backend in self.backends:
            settings = self._settings[backend.name]
            self._clients[backend.name] = self._factory(settings, self.adapters[backend.name])
        if self.backends:
            await asyncio.gather(*(self.scrape_once(b) for b in self.backends))
        self._tasks = [asyncio.create_task(self._loop(b), name=f"scrape:{b.name}") for b in self.backends]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for client in self._clients.values():
            await client.aclose()
        self._clients = {}

    async def _loop(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self._scrape.interval)
            await self.scrape_once(backend)

    async def scrape_once(self, backend: Backend) -> None:
        """Probe one backend; when ready, refresh its models (on recovery and every few cycles), its capacity
        (on recovery) and its load. Never raises: every failure becomes state."""
        adapter = self.adapters[backend.name]
        client = self._clients[backend.name]
        cycle = self._cycles.get(backend.name, 0)
        self._cycles[backend.name] = cycle + 1
        marks = backend.marked_down
        try:
            probe = await asyncio.wait_for(adapter.probe(client), self._scrape.timeout)
        except (BackendError, TimeoutError) as exc:
            probe = Probe(Health.DOWN, str(exc) or "health check timed out")
        if backend.marked_down != marks:
            return  # the proxy saw it fail while this probe was out: the probe's answer is older news
        if probe.health is not Health.READY:
            self._transition(backend, probe)
            backend.record_load(None)
            return
        recovering = backend.health is not Health.READY
        try:
            if recovering or cycle % self._scrape.models_every == 0:
                if backend.configured_models is None:
                    backend.models = frozenset(await adapter.list_models(client))
                backend.capacity = await adapter.read_capacity(client)
        except BackendError as exc:
            backend.scrape_errors += 1
            if recovering:
                self._transition(backend, Probe(Health.DOWN, f"healthy but unusable: {exc}"))
                return
            log.warning("backend %s: refreshing models/capacity failed: %s", backend.name, exc)
        if not backend.models:
            self._transition(backend, Probe(Health.DOWN, "serves no model"))
            return
        try:
            backend.record_load(await adapter.read_load(client))
        except BackendError as exc:
            backend.scrape_errors += 1
            log.debug("backend %s: load reading failed: %s", backend.name, exc)
        self._transition(backend, probe)

    @staticmethod
    def _transition(backend: Backend, probe: Probe) -> None:
        before = backend.health
        backend.record_probe(probe)
        if before is not probe.health:
            level = logging.INFO if probe.health is Health.READY else logging.WARNING
            log.log(level, "backend %s (%s) is %s%s", backend.name, backend.engine, probe.health.value,
                    f": {probe.detail}" if probe.detail else "")
