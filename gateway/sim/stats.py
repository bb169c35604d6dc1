"""What an emulated server has done: counters for tests (:class:`Stats`) and per-request latency records."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.sim.metrics_text import LATENCY_BUCKETS, TOKEN_BUCKETS, Histogram


@dataclass
class Stats:
    """Counters since the server (process) started. Durations are simulated seconds."""

    requests: int = 0
    active_sequences: int = 0
    waiting: int = 0
    peak_requests: int = 0  # most generation requests held at once (waiting + running)
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    last_cancel_time: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Latencies:
    """Engine-side histograms (simulated seconds) and per-scrape windows for llama.cpp's averaged gauges."""

    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prompt_len: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    gen_len: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    busy_slot_steps: int = 0
    max_tokens_seen: int = 0
    # window since the last llama.cpp /metrics scrape
    win_prompt_tokens: int = 0
    win_prompt_seconds: float = 0.0
    win_gen_tokens: int = 0
    win_decode_seconds: float = 0.0
    win_steps: int = 0
    win_busy_slot_steps: int = 0


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


def recorder(maxlen: int = 256) -> deque[RecordedRequest]:
    return deque(maxlen=maxlen)
