"""The prompt as prefix caches see it: a canonical rendering of everything that reaches the engine before
generation, cut into fixed-size byte blocks whose hashes are chained, so equal hashes at block ``i`` mean the
whole prefix up to ``i`` is equal.

No tokenizer is involved: engines cache in tokens (vLLM 16-token blocks, SGLang single tokens, ExLlama
256-token pages, llama.cpp per slot), but the gateway only needs to know *which* backend holds the longest
shared prefix, and equal text gives equal tokens. The hash is XXH3 (64 bits), stable across processes and
machines, so several gateway replicas agree on the same keys (the consistent-hash picker depends on that);
not a cryptographic hash, and it need not be: a collision only misplaces a request's cache affinity. It is
4x cheaper than blake2b was here (a 2,000-token prompt's 62 blocks: ~13 us against ~54 us per request).
"""

from __future__ import annotations

from typing import Any

import orjson
from xxhash import xxh3_64_digest

BLOCK_BYTES = 128  # about 32 tokens of English text


def render(route: str, body: dict[str, Any]) -> bytes:
    """Everything in the request that becomes prompt tokens, in order: tools, then each message (role, name,
    content, tool calls), or the completion prompt. Embedding inputs are not cached by engines: empty."""
    if route == "chat":
        parts: list[bytes] = []
        tools = body.get("tools")
        if tools:
            parts.append(b"<tools>" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS))
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            parts.append(b"<" + str(message.get("role", "")).encode() + b">")
            if message.get("name"):
                parts.append(str(message["name"]).encode())
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content.encode())
            elif content is not None:
                parts.append(orjson.dumps(content, option=orjson.OPT_SORT_KEYS))
            if message.get("tool_calls"):
                parts.append(orjson.dumps(message["tool_calls"], option=orjson.OPT_SORT_KEYS))
        return b"\n".join(parts)
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt.encode()
        return orjson.dumps(prompt)
    return b""


def block_hashes(model: str, text: bytes, block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    """Chained hashes of the full blocks of ``text`` (a trailing partial block is not cacheable as a unit),
    seeded with the model so different models never share keys."""
    hashes: list[bytes] = []
    digest = xxh3_64_digest
    previous = digest(model.encode())
    for start in range(0, len(text) - block_bytes + 1, block_bytes):
        previous = digest(previous + text[start : start + block_bytes])
        hashes.append(previous)
    return hashes
