"""Performance profiles: the numbers that give each emulated engine its shape.

Decode step time for a batch of ``b`` sequences:
    ``step(b) = decode_base_s * (1 + decode_growth * (b - 1) + knee_growth * max(0, b - knee))``
``exllamav2``: growth ~0.9, so a step for 2b sequences takes ~2x: each user's speed halves when users double.
``vllm`` / ``sglang``: growth ~0.012 until ``knee`` (saturation), so aggregate throughput grows almost with b.
``llamacpp``: a few fixed slots, moderate growth. Single-stream anchors (Llama 2 7B ~4 bit, RTX 4090):
llama.cpp 186 tok/s, ExLlamaV2 211 tok/s; vLLM and SGLang a little under llama.cpp alone.
Prefill runs at ``prefill_tok_s`` in chunks of at most ``prefill_chunk_tokens`` per step; cached prompt
tokens skip it. ``kv_capacity_tokens`` bounds the tokens of all running sequences; ``context_length`` bounds one.

Context terms (calibrated against a real ``llama-server``, see ``gateway.llamacpp.calibrate``); all default to 0:
``prefill_base_s`` is the fixed cost of a step that processes prompt tokens (batch setup, the first token's
logits and sampling, the request's own handling), so a tiny prompt still takes a few milliseconds;
``prefill_ctx_growth``: attention makes a prompt token at position ``p`` cost ``(1 + prefill_ctx_growth * p /
1000) / prefill_tok_s``, so an uncached prompt of ``L`` tokens costs ``L / prefill_tok_s * (1 + g * L / 2000)``
(quadratic, as llama.cpp's prefill is) and a cached prefix still slows the uncached tail that attends to it;
``decode_ctx_growth``: each decoding sequence adds ``decode_base_s * decode_ctx_growth * ctx / 1000`` to a
step, ``ctx`` being its prompt plus generated tokens (reading its KV cache).
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
    prefill_base_s: float = 0.0
    prefill_ctx_growth: float = 0.0
    decode_ctx_growth: float = 0.0

    def decode_seconds(self, batch: int, ctx_tokens: int = 0) -> float:
        """One decode step for ``batch`` sequences holding ``ctx_tokens`` tokens of context between them."""
        if batch <= 0:
            return 0.0
        growth = 1.0 + self.decode_growth * (batch - 1) + self.knee_growth * max(0, batch - self.knee)
        return self.decode_base_s * (growth + self.decode_ctx_growth * ctx_tokens / 1000)

    def prefill_seconds(self, tokens: int, start: int = 0) -> float:
        """Prefilling the prompt tokens at positions ``start .. start + tokens`` of one sequence (no fixed cost)."""
        if tokens <= 0:
            return 0.0
        mid = start + tokens / 2
        return tokens / self.prefill_tok_s * (1.0 + self.prefill_ctx_growth * mid / 1000)

    def step_seconds(self, batch: int, prefill_tokens: int, prefill_start: int = 0,
                     decode_ctx_tokens: int = 0) -> float:
        """Simulated duration of one engine step (before time scaling). The scheduler sums per-sequence
        :meth:`prefill_seconds` itself when several prompts share a step; this is the one-prompt form."""
        t = self.decode_seconds(batch, decode_ctx_tokens)
        if prefill_tokens > 0:
            t += self.prefill_base_s + self.prefill_seconds(prefill_tokens, prefill_start)
        return t

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        known = {f.name: f.type for f in fields(self)}
        clean: dict[str, Any] = {}
        for key, value in overrides.items():
            if key not in known or key == "name":
                raise ValueError(f"unknown profile parameter {key!r}; known: {sorted(known)}")
            clean[key] = int(value) if known[key] == "int" else float(value)
        return replace(self, **clean)


PROFILES: dict[str, Profile] = {
    # anchored to the published single-user figure; context terms left at 0 (no GPU measurement to anchor them)
    "llamacpp": Profile(
        name="llamacpp", max_seqs=4, decode_base_s=1 / 186, decode_growth=0.30, knee=4, knee_growth=0.0,
        prefill_tok_s=5_000, prefill_chunk_tokens=2_048, kv_capacity_tokens=16_384, context_length=4_096,
    ),
    # measured by gateway.llamacpp.calibrate: real llama-server, generated "large" model (width 256, 4 layers,
    # f32), 2 slots, 1 CPU thread, on one of our 2-core machines
    "llamacpp-cpu": Profile(
        name="llamacpp-cpu", max_seqs=2, decode_base_s=0.00055, decode_growth=1.6, knee=2, knee_growth=0.0,
        prefill_tok_s=8_300, prefill_chunk_tokens=2_048, kv_capacity_tokens=8_192, context_length=4_096,
        prefill_base_s=0.002, prefill_ctx_growth=1.7, decode_ctx_growth=7.0,
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
