"""Engine registry: engine name -> the module and class that emulates it, imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.sim.engines.base import Engine
    from gateway.sim.server import SimServer

ENGINE_CLASSES = {
    "llamacpp": "gateway.sim.engines.llamacpp:LlamaCppEngine",
    "vllm": "gateway.sim.engines.vllm:VllmEngine",
    "sglang": "gateway.sim.engines.sglang:SglangEngine",
    "tabbyapi": "gateway.sim.engines.tabbyapi:TabbyEngine",
}


def make_engine(server: SimServer) -> Engine:
    module, _, cls = ENGINE_CLASSES[server.spec.engine].partition(":")
    engine: Engine = getattr(importlib.import_module(module), cls)(server)
    return engine
