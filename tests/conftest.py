"""Shared fixtures: run ASGI apps on loopback in background threads, as real servers."""

from __future__ import annotations

import asyncio
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


def free_port_block(count: int) -> int:
    """First of ``count`` consecutive free ports, below Linux's ephemeral range (where client sockets of
    other tests could take them between this check and the bind)."""
    import random

    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
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
        self.server = uvicorn.Server(config)
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
