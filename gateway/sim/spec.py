"""SimSpec: what one emulated server is (engine, model, port, profile, flags). Holds settings only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile

EngineName = Literal["llamacpp", "vllm", "sglang", "tabbyapi"]
ENGINES: tuple[EngineName, ...] = ("llamacpp", "vllm", "sglang", "tabbyapi")


@dataclass
class SimSpec:
    """One emulated engine server.

    ``time_scale`` > 1 runs faster: every simulated duration is divided by it. ``overrides`` replaces any
    :class:`~gateway.sim.profiles.Profile` field (``max_seqs``, ``prefill_tok_s``, ``decode_base_s``,
    ``decode_growth``, ``knee``, ``knee_growth``, ``kv_capacity_tokens``, ``context_length``, ...).
    ``load_seconds`` is a slow start, in simulated seconds. ``kv_events`` (vLLM and SGLang) publishes the
    prefix cache's events as the engine does: ``endpoint`` (default ``tcp://127.0.0.1:*``, an ephemeral port
    kept across restarts), ``replay_endpoint`` (none by default), ``topic``, ``buffer_steps`` (10000), and for
    SGLang ``page_size`` (1). ``tokenizer`` is a Hugging Face tokenizer directory: prompts are rendered with its
    chat template and tokenized with it (else the emulators' own word tokenizer and Llama-2 layout).
    """

    engine: EngineName
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    profile: str | None = None
    api_key: str | None = None
    time_scale: float = 1.0
    metrics: bool = True
    cache_report: bool = True
    load_seconds: float = 0.0
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    kv_events: dict[str, Any] | None = None
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; one of {ENGINES}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.profile is None:
            self.profile = DEFAULT_PROFILE[self.engine]
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; one of {sorted(PROFILES)}")
        if self.name is None:
            self.name = f"sim-{self.engine}"
        self.resolved_profile()  # validate overrides early
        if self.kv_events is not None:
            if self.engine not in ("vllm", "sglang"):
                raise ValueError(f"kv_events: engine {self.engine} publishes no KV-cache events")
            unknown = set(self.kv_events) - {"endpoint", "replay_endpoint", "topic", "buffer_steps", "page_size"}
            if unknown:
                raise ValueError(f"kv_events: unknown keys {sorted(unknown)}")

    def resolved_profile(self) -> Profile:
        assert self.profile is not None
        return PROFILES[self.profile].with_overrides(self.overrides)
