"""Shared fixtures: run ASGI apps on loopback in background threads, as real servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn

from gateway.config import ServerSettings
from gateway.server_limits import uvicorn_config
from tests.waiting import wait_until

pytest_plugins = ["tests.tiers", "pytester"]


def _one_tls_context() -> None:
    """Every httpx client a test makes (thousands: each httpx.get is one, and each OpenAI SDK client) verifies
    with one TLS context, made once, as the gateway's own clients do (gateway.pool.pool.tls_context): made for
    each, httpx parses certifi's authorities again, 15-90 ms a client, 32 s of tests/proxy's 55. The tests reach
    loopback over plain HTTP; a client given its own verify= or cert= still gets its own."""
    import os

    import httpx._transports.default as transports

    made = transports.create_ssl_context
    shared: dict[tuple[bool, str | None, str | None], Any] = {}

    def create(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return made(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in shared:
            shared[key] = made(verify=verify, cert=cert, trust_env=trust_env)
        return shared[key]

    transports.create_ssl_context = create


_one_tls_context()


AGENT_LLAMA = "agent-llama-server"  # the model a real llama-server serves to the agent tests


@pytest.fixture(scope="session")
def agent_llama() -> Iterator[Any]:
    """A real llama-server (built once from the pinned sdist, cached) on the generated agent model: it calls a
    tool when offered tools and answers once the tool's result is in (gateway.llamacpp.agent_model); a 128k
    context, as the agent clients need. Served as ``AGENT_LLAMA``."""
    from gateway.llamacpp.build import build
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer

    # (greedy unless a request asks otherwise, which the agent clients do not: among the tools' names, all
    # equally likely to this model, the same one each time)
    server = LlamaServer(build(), model_path("agent"), free_port_block(1), slots=1, ctx=131072, threads=2,
                         extra=("--alias", AGENT_LLAMA, "--top-k", "1")).start()
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_range(low: int = 20000, high: int = 32000) -> tuple[int, int]:
    """This process's share of [low, high): the suite runs in several processes (pytest-xdist), each picks its
    blocks in its own part, so that one never takes a block another checked free and is about to bind."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(worker.removeprefix("gw")) if worker.startswith("gw") and worker[2:].isdigit() else 0
    share = (high - low) // max(count, 1)
    return low + index * share, low + (index + 1) * share


def free_port_block(count: int) -> int:
    """First of ``count`` consecutive free ports, below Linux's ephemeral range (where client sockets of
    other tests could take them between this check and the bind)."""
    import random

    rng = random.Random()
    low, high = _port_range()
    for _ in range(200):
        base = rng.randrange(low, high - count)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no block of free ports found")


class _Server(uvicorn.Server):
    """uvicorn's server, told to stop at once: its main loop looks for ``should_exit`` every 0.1 s, which every
    test server's stop waited out (hundreds of them a run)."""

    _woken: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._woken = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, less its fixed 0.1 s pause for connections to close where there is none (the test's clients
        closed theirs); with connections open, uvicorn's own."""
        if self.server_state.connections:
            await super().shutdown(sockets)
            return
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self._wait_tasks_to_complete()
        if not self.force_exit:
            await self.lifespan.shutdown()

    def wake(self, loop: asyncio.AbstractEventLoop | None) -> None:
        woken = self._woken
        if loop is not None and woken is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # (the loop may have just ended)
                loop.call_soon_threadsafe(woken.set)


class ServerThread:
    """A uvicorn server (uvloop + httptools, as in production) on its own loop in a daemon thread.

    Configured as ``gateway serve`` configures it (``gateway.server_limits.uvicorn_config``), with the limits of
    ``server`` if given, else of the gateway app's own settings, else the defaults (for emulators and other
    apps); it always listens on 127.0.0.1:``port``."""

    def __init__(self, app: Any, port: int | None = None, server: ServerSettings | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if server is None:
            gateway = getattr(app, "gateway", None)
            server = gateway.settings.server if gateway is not None else ServerSettings()
        server = server.model_copy(update={"host": "127.0.0.1", "port": self.port})
        config = uvicorn_config(app, server, log_level="warning")
        self.server = _Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self.server.serve())

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        """Run a coroutine on the server's loop (e.g. to inspect or change app state)."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> ServerThread:
        self._thread.start()
        wait_until(lambda: self.server.started or not self._thread.is_alive(), "test server started", within=20)
        if not self.server.started:
            raise RuntimeError("test server did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.server.wake(self.loop)
        self._thread.join(timeout=15)


@contextmanager
def serve_in_thread(app: Any, port: int | None = None,
                    server: ServerSettings | None = None) -> Iterator[ServerThread]:
    running = ServerThread(app, port, server).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
