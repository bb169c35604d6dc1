"""One module per engine. Adding an engine is a new module plus one line in ``ADAPTERS``."""

from __future__ import annotations

from gateway.engines.base import BackendError, EngineAdapter
from gateway.engines.llamacpp import LlamaCppAdapter
from gateway.engines.openai import OpenAIAdapter
from gateway.engines.sglang import SGLangAdapter
from gateway.engines.tabbyapi import TabbyAPIAdapter
from gateway.engines.vllm import VLLMAdapter

ADAPTERS: dict[str, type[EngineAdapter]] = {
    "llamacpp": LlamaCppAdapter,
    "vllm": VLLMAdapter,
    "sglang": SGLangAdapter,
    "tabbyapi": TabbyAPIAdapter,
    "openai": OpenAIAdapter,
}


def create_adapter(engine: str) -> EngineAdapter:
    return ADAPTERS[engine]()


__all__ = ["ADAPTERS", "BackendError", "EngineAdapter", "create_adapter"]
