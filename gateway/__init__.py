"""A multi-engine LLM gateway: one OpenAI-compatible endpoint in front of llama.cpp, vLLM, SGLang and
TabbyAPI servers (and any other OpenAI-compatible server)."""

__version__ = "0.1.0"
