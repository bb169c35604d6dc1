"""Performance profiles: the numbers that give each emulated engine its shape.

Decode step time for a batch of ``b`` sequences:
    ``step(b) = decode_base_s * (1 + decode_growth * (b - 1) + knee_growth * max(0, b - knee))``
``exllamav2``: growth ~0.9, so a step for 2b sequences takes ~2x: each user's speed halves when users double.
``vllm`` / ``sglang``: growth ~0.012 until ``knee`` (saturation), so aggregate throughput grows almost with b.
``llamacpp``: a few fixed slots, moderate growth. Single-stream anchors (Llama 2 7B ~4 bit, RTX 4090):
llama.cpp 186 tok/s, ExLlamaV2 211 tok/s; vLLM and SGLang a little under llama.cpp alone.
Prefill runs at ``prefill_tok_s`` in chunks of at most ``prefill_chunk_tokens`` per step; cached prompt
tokens skip it. ``kv_capacity_tokens`` bounds the tokens of all running sequences; ``context_length`` bounds one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Profile:
    name: str
    max_seqs: int
    decode_base_s: float
    decode_growth: float
    knee: int
    knee_growth: float
    prefill_tok_s: float
    prefill_chunk_tokens: int
    kv_capacity_tokens: int
    context_length: int
    natural_min_tokens: int = 48
    natural_max_tokens: int = 200

    def step_seconds(self, batch: int, prefill_tokens: int) -> float:
        """Simulated duration of one engine step (before time scaling)."""
        t = 0.0
        if batch > 0:
            t = self.decode_base_s * (
                1.0 + self.decode_growth * (batch - 1) + self.knee_growth * max(0, batch - self.knee)
            )
        return t + prefill_tokens / self.prefill_tok_s

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        known = {f.name: f.type for f in fields(self)}
        clean: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known or key == "name":
                raise ValueError(f"unknown profile parameter {key!r}; known: {sorted(known)}")
            clean[key] = int(value) if known[key] == "int" else float(value)
        return replace(self, **clean)


PROFILES: dict[str, Profile] = {
    "llamacpp": Profile(
        name="llamacpp", max_seqs=4, decode_base_s=1 / 186, decode_growth=0.30, knee=4, knee_growth=0.0,
        prefill_tok_s=5_000, prefill_chunk_tokens=2_048, kv_capacity_tokens=16_384, context_length=4_096,
    ),
    "exllamav2": Profile(
        name="exllamav2", max_seqs=64, decode_base_s=1 / 211, decode_growth=0.90, knee=64, knee_growth=0.0,
        prefill_tok_s=8_000, prefill_chunk_tokens=2_048, kv_capacity_tokens=65_536, context_length=4_096,
    ),
    "vllm": Profile(
        name="vllm", max_seqs=256, decode_base_s=1 / 175, decode_growth=0.012, knee=96, knee_growth=0.05,
        prefill_tok_s=10_000, prefill_chunk_tokens=2_048, kv_capacity_tokens=65_536, context_length=4_096,
    ),
    "sglang": Profile(
        name="sglang", max_seqs=256, decode_base_s=1 / 178, decode_growth=0.011, knee=96, knee_growth=0.05,
        prefill_tok_s=10_000, prefill_chunk_tokens=2_048, kv_capacity_tokens=65_536, context_length=4_096,
    ),
}

DEFAULT_PROFILE = {"llamacpp": "llamacpp", "vllm": "vllm", "sglang": "sglang", "tabbyapi": "exllamav2"}
