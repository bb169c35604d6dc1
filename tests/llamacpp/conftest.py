"""Real llama-server processes (built once from the pinned sdist, cached) on generated models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.llamacpp.build import build
from gateway.llamacpp.model import model_path
from gateway.llamacpp.server import LlamaServer
from tests.conftest import free_port_block


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    return build()  # about 10 minutes on 2 cores the first time, then cached outside the repository


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return model_path("tiny")


@pytest.fixture(scope="session")
def large_model() -> Path:
    return model_path("large")


def start_servers(binary: Path, model: Path, count: int, **kwargs: object) -> list[LlamaServer]:
    base = free_port_block(count)
    servers: list[LlamaServer] = []
    try:
        for i in range(count):
            servers.append(LlamaServer(binary, model, base + i, **kwargs).start())  # type: ignore[arg-type]
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def tiny_pair(llama_binary: Path, tiny_model: Path) -> Iterator[list[LlamaServer]]:
    servers = start_servers(llama_binary, tiny_model, 2, slots=2, ctx=2048)
    yield servers
    for server in servers:
        server.stop()
