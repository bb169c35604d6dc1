"""Several emulated servers in one process: :class:`Fleet` (one event loop) and :class:`FleetThread`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterable
from types import TracebackType
from typing import Any, TypeVar

from gateway.sim.server import SimServer
from gateway.sim.spec import ENGINES, SimSpec

T = TypeVar("T")
DEFAULT_MODEL = "sim-llama-2-7b"
AGENT_MODEL = "sim-agent"
# what coding agents need of a model: Claude Code's first request is ~12k tokens with max_tokens 32,000
AGENT_CONTEXT = 131_072


def default_fleet_specs(host: str = "127.0.0.1", base_port: int = 18001, **common: Any) -> list[SimSpec]:
    """One server per engine on consecutive ports, all serving ``sim-llama-2-7b``; ``common`` sets other fields."""
    return [SimSpec(engine=e, model=DEFAULT_MODEL, host=host, port=base_port + i if base_port else 0,
                    name=f"sim-{e}", **common) for i, e in enumerate(ENGINES)]


def agent_fleet_specs(host: str = "127.0.0.1", base_port: int = 18001, **common: Any) -> list[SimSpec]:
    """One server per engine serving ``sim-agent``, on the ports after the default fleet's: a reasoning model
    with a 128k context that calls a tool when it may (``tool_call_rate`` 1: the first tool offered, then an
    answer once the tool's result is in), for coding agents and agent SDKs."""
    first = base_port + len(ENGINES) if base_port else 0
    return [SimSpec(engine=e, model=AGENT_MODEL, host=host, port=first + i if base_port else 0,
                    name=f"sim-agent-{e}", reasoning=True, tool_call_rate=1.0,
                    overrides={"context_length": AGENT_CONTEXT, "kv_capacity_tokens": 2 * AGENT_CONTEXT}, **common)
            for i, e in enumerate(ENGINES)]


class Fleet:
    def __init__(self, specs: Iterable[SimSpec]) -> None:
        self.servers = [SimServer(s) for s in specs]
        names = [s.spec.name for s in self.servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique: {names}")

    def __getitem__(self, name: str) -> SimServer:
        for server in self.servers:
            if server.spec.name == name:
                return server
        raise KeyError(name)

    async def start(self) -> None:
        try:
            for server in self.servers:
                await server.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        for server in self.servers:
            await server.stop()


class FleetThread:
    """Runs a :class:`Fleet` on its own event loop in a daemon thread; ``call`` runs a coroutine there."""

    def __init__(self, specs: Iterable[SimSpec]) -> None:
        self.specs = list(specs)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="sim-fleet", daemon=True)
        self.fleet: Fleet

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> FleetThread:
        self._thread.start()

        async def build() -> Fleet:
            fleet = Fleet(self.specs)
            await fleet.start()
            return fleet

        try:
            self.fleet = self.call(build())
        except BaseException:
            self._shutdown(stop_fleet=False)
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._shutdown(stop_fleet=True)

    def _shutdown(self, stop_fleet: bool) -> None:
        if stop_fleet:
            self.call(self.fleet.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
