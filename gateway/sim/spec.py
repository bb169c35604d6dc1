"""SimSpec: what one emulated server is (engine, model, port, profile, flags). Holds settings only."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gateway.sim.profiles import DEFAULT_PROFILE, PROFILES, Profile

EngineName = Literal["llamacpp", "vllm", "sglang", "tabbyapi"]
ENGINES: tuple[EngineName, ...] = ("llamacpp", "vllm", "sglang", "tabbyapi")
KV_EVENTS_KEYS = frozenset({"endpoint", "replay_endpoint", "topic", "buffer_steps", "page_size"})
# the releases an emulator can behave as, where they differ in what the gateway relies on (the default first)
VERSIONS: dict[str, tuple[str, ...]] = {
    # --block-size's default: 16 before 0.34, 64 from it. The default stays 16, the size the emulated workloads
    # (prompts of a few hundred tokens) and the prefix benchmark's figures were built on; the gateway reads the
    # block size vLLM shows, and the tests cover both
    "vllm": ("0.33.0", "0.34.0"),
    "sglang": ("0.5.23", "0.5.19"),  # /ready (503 while warming up or paused) from 0.5.20
    # its chat and completion rework of 2026-03-30: usage on a non-streamed answer only when asked
    "tabbyapi": ("e632af4", "2026-03-29"),
}


@dataclass
class SimSpec:
    """One emulated engine server.

    ``time_scale`` > 1 runs faster: every simulated duration is divided by it. ``overrides`` replaces any
    :class:`~gateway.sim.profiles.Profile` field (``max_seqs``, ``prefill_tok_s``, ``decode_base_s``,
    ``decode_growth``, ``knee``, ``knee_growth``, ``kv_capacity_tokens``, ``context_length``, ...).
    ``load_seconds`` is a slow start, in simulated seconds.

    ``kv_events`` (vLLM and SGLang only) publishes the prefix cache's KV events in the engine's wire format
    (:mod:`gateway.sim.kv_events`): ``endpoint`` (default ``tcp://127.0.0.1:*``, an ephemeral port),
    ``replay_endpoint`` (the same default; ``None``: no replay socket), ``topic`` (``""``), ``buffer_steps``
    (batches kept for replay, 10000) and, for SGLang, ``page_size`` (1). Ports bound once are kept across
    restarts (``SimServer.kv_events_endpoint``, ``kv_replay_endpoint``). ``tokenizer`` is a Hugging Face tokenizer
    directory (``tokenizer.json``, ``tokenizer_config.json``): any engine then renders chat prompts with its chat
    template and counts, caches and publishes the model's token ids (else the emulators' own word tokenizer and
    Llama 2 layout).

    Agent features (:mod:`gateway.sim.agent`): ``reasoning`` marks a reasoning model, whose chat answers start with
    reasoning text in the engine's own field (vLLM ``reasoning``; SGLang, llama.cpp and TabbyAPI
    ``reasoning_content``); ``tool_call_rate`` is the share of ``tool_choice: "auto"`` chat requests with tools
    that the model answers with a tool call (deterministic for a given ``seed`` and prompt).

    ``priority_scheduling`` (vLLM and SGLang only) runs the engine as with vLLM's ``--scheduling-policy priority``
    or SGLang's ``--enable-priority-scheduling``: the request's ``priority`` orders the waiting queue (vLLM: lower
    first; SGLang: higher first). Without it both ignore the field.

    ``tool_template`` False (llama.cpp only) serves a model whose chat template has no tool support: ``/props``
    says so (``chat_template_caps.supports_tools`` false) and, as llama-server then does, ``tools`` and
    ``tool_choice`` are ignored (the model answers in text).

    ``version`` is the release the emulator behaves as where releases differ in what the gateway relies on
    (:data:`VERSIONS`; None: the first listed there): vLLM ``0.34.0`` caches in blocks of 64 tokens (16 before);
    SGLang ``0.5.19`` has no ``/ready``; TabbyAPI ``2026-03-29`` (before its
    rework) puts ``usage`` in every non-streamed answer, ``e632af4`` only when ``stream_options.include_usage``
    asks for it.
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
    reasoning: bool = False
    tool_call_rate: float = 0.0
    priority_scheduling: bool = False
    version: str | None = None
    tool_template: bool = True

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; one of {ENGINES}")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.priority_scheduling and self.engine not in ("vllm", "sglang"):
            raise ValueError(f"priority_scheduling: {self.engine} does not schedule by priority")
        known = VERSIONS.get(self.engine, ())
        if self.version is not None and self.version not in known:
            raise ValueError(f"version: the {self.engine} emulator behaves as one of {list(known)}, not "
                             f"{self.version!r}")
        if self.version is None and self.engine in VERSIONS:
            self.version = VERSIONS[self.engine][0]
        if not 0.0 <= self.tool_call_rate <= 1.0:
            raise ValueError("tool_call_rate must be between 0 and 1")
        if not self.tool_template and self.engine != "llamacpp":
            raise ValueError(f"tool_template: only the llamacpp emulator says what its chat template can do, not "
                             f"{self.engine}")
        if self.profile is None:
            self.profile = DEFAULT_PROFILE[self.engine]
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; one of {sorted(PROFILES)}")
        if self.name is None:
            self.name = f"sim-{self.engine}"
        self.resolved_profile()  # validate overrides early
        if self.kv_events is not None:
            self._check_kv_events(self.kv_events)
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: no tokenizer.json in {self.tokenizer}")

    def _check_kv_events(self, kv: dict[str, Any]) -> None:
        if self.engine not in ("vllm", "sglang"):
            raise ValueError(f"kv_events: engine {self.engine} publishes no KV-cache events (vllm and sglang do)")
        if not isinstance(kv, dict):
            raise ValueError("kv_events must be a mapping")
        unknown = set(kv) - KV_EVENTS_KEYS
        if unknown:
            raise ValueError(f"kv_events: unknown keys {sorted(unknown)}; known: {sorted(KV_EVENTS_KEYS)}")
        if not isinstance(kv.get("endpoint", ""), str) or not isinstance(kv.get("topic", ""), str):
            raise ValueError("kv_events: endpoint and topic must be strings")
        if not isinstance(kv.get("replay_endpoint", ""), str | None):
            raise ValueError("kv_events: replay_endpoint must be a string or null")
        for key in ("buffer_steps", "page_size"):
            value = kv.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events: {key} must be an integer >= 1")
        if "page_size" in kv and self.engine != "sglang":
            raise ValueError("kv_events: page_size is SGLang's (vLLM's blocks are 16 tokens)")

    def resolved_profile(self) -> Profile:
        assert self.profile is not None
        return PROFILES[self.profile].with_overrides(self.overrides)
