"""Fixtures for the emulator tests: a fleet of all four engines in a background thread, fast time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.sim import FleetThread, SimServer, SimSpec, default_fleet_specs

ENGINES = ("llamacpp", "vllm", "sglang", "tabbyapi")
MODEL = "sim-llama-2-7b"


def ask_usage(engine: str) -> dict[str, object]:
    """What a non-streamed request must carry for the engine to put ``usage`` in its answer: TabbyAPI (since its
    rework of 2026-03-30) answers without it unless ``stream_options.include_usage`` asks; the others always do."""
    return {"stream_options": {"include_usage": True}} if engine.endswith("tabbyapi") else {}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    with FleetThread(default_fleet_specs(base_port=0, time_scale=50)) as ft:
        yield ft


@pytest.fixture
def server_of(fleet: FleetThread):  # type: ignore[no-untyped-def]
    def get(engine: str) -> SimServer:
        return fleet.fleet[f"sim-{engine}"]

    return get


@pytest.fixture
def make_spec():  # type: ignore[no-untyped-def]
    def make(engine: str, **kw: object) -> SimSpec:
        kw.setdefault("time_scale", 50.0)
        return SimSpec(engine=engine, model=MODEL, **kw)  # type: ignore[arg-type]

    return make
