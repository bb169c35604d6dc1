"""The engines the gateway speaks to, by the name a backend's ``engine:`` setting gives."""

from __future__ import annotations

from gateway.engines import llamacpp, openai, sglang, tabbyapi, vllm
from gateway.engines.base import EngineAdapter
from gateway.engines.spec import EngineSpec

ADAPTERS: dict[str, type[EngineAdapter]] = {
    cls.spec.name: cls
    for cls in (
        llamacpp.LlamaCppAdapter,
        vllm.VLLMAdapter,
        sglang.SGLangAdapter,
        tabbyapi.TabbyAPIAdapter,
        openai.OpenAIAdapter,
    )
}

ENGINES: dict[str, EngineSpec] = {name: cls.spec for name, cls in ADAPTERS.items()}


def create_adapter(engine: str) -> EngineAdapter:
    return ADAPTERS[engine]()
