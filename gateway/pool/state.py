"""Normalised state of one backend: the only vocabulary routing sees.

Every engine adapter turns its engine's own signals (Prometheus metric names, ``/slots``, ``/v1/loads``,
``/props``) into these records, so a scorer reads ``waiting``, never ``vllm:num_requests_waiting``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet
    READY = "ready"
    LOADING = "loading"  # up but not serving yet (llama.cpp "503 Loading model")
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One reading of an engine's load. ``None`` means the engine does not expose that signal."""

    running: int | None
    waiting: int | None
    kv_usage: float | None  # fraction of KV cache in use, 0..1
    read_at: float  # time.monotonic() of the reading
    # the engine's own queue-time histogram, when it keeps one: ((le, cumulative count), ...), sum, count
    queue_histogram: tuple[tuple[tuple[str, float], ...], float, float] | None = None
    # the fields the engine gave garbage for (NaN, Inf, negative, not a number), left None above
    rejected: tuple[str, ...] = ()
    # a sequence was reading its prompt (llama.cpp's /slots: processing, nothing generated yet): its loop's steps
    # are as long as a batch of prompt takes (gateway.proxy.stall_guard)
    prefilling: bool = False
    # the engine's ids of the sequences it runs (llama.cpp's /slots: each processing slot's id_task), None unsaid
    tasks: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class Capacity:
    """What an engine says it can hold. Read once it is ready, and again after it restarts."""

    slots: int | None = None  # concurrent sequences it will run
    context_length: int | None = None  # tokens per sequence
    cache_tokens: int | None = None  # tokens its KV / prefix cache holds in all
    page_tokens: int | None = None  # tokens per cache page (vLLM's block size), where it says
    # whether it can call tools (llama.cpp: its chat template's caps; None: not said, as engines mostly do not)
    tool_calls: bool | None = None


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where an engine says it publishes its KV-cache events (``kv_events: discover``): addresses to connect to
    (a wildcard host the engine bound, ``*`` or ``0.0.0.0``, already replaced by the backend's own host)."""

    endpoint: str  # its PUB socket
    replay_endpoint: str | None = None  # its ROUTER replay socket
    topic: str = ""
    block_size: int | None = None  # tokens per event block, where the engine says


@dataclass(frozen=True, slots=True)
class Probe:
    """The outcome of one health check."""

    health: Health
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ShapeSeed:
    """An engine kind's performance shape before anything is measured: where a routing model that predicts
    speed starts (a ``gateway profile`` file or observed requests then take over).

    Per-token decode time at ``b`` concurrent sequences = (1 + growth x (b - 1)) / tok_s.
    """

    tok_s: float  # single-stream decode tokens/s
    growth: float
    prefill_tok_s: float


# an unknown engine: middling speed, mild slowdown with concurrency
NEUTRAL_SHAPE = ShapeSeed(tok_s=100.0, growth=0.05, prefill_tok_s=5_000.0)


@dataclass(frozen=True, slots=True)
class LoopReading:
    """One reading of a backend's loop (EngineSpec.load_waits_for_loop): its step took ``step`` seconds or more;
    the engine said it runs or queues ``running`` sequences (None: the reading timed out; -1: unsaid); ``in_flight``:
    this process's requests there then (None: not known here, a worker taking another's readings); ``prefilling``:
    a sequence was reading its prompt (a step is then as long as a batch of prompt takes); ``tasks``: the engine's
    ids of the sequences it runs (None: unsaid), so that one begun, or ended, since the last reading is seen whoever
    sent it."""

    backend: str
    step: float
    running: int | None
    in_flight: int | None
    prefilling: bool = False
    tasks: frozenset[int] | None = None
