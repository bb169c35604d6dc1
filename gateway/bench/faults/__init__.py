"""``gateway bench faults``: bounded, loopback-only fault scenarios and their report (see ``cli.py``).
``harness`` runs a gateway and judges what a client got, ``fakes`` misbehaves, ``scenarios`` combines them
(``front_door`` for the attacks on the gateway's own HTTP server)."""

from gateway.bench.faults.cli import main
from gateway.bench.faults.fakes import (
    GARBAGE,
    AsyncThread,
    GarbageBackend,
    HugeHeaderResult,
    IdleFlood,
    SlowReader,
    free_ports,
    rss_bytes,
    send_huge_header,
)
from gateway.bench.faults.front_door import huge_header, idle_flood
from gateway.bench.faults.harness import (
    Outcome,
    ScenarioReport,
    fleet_and_gateway,
    is_error_envelope,
    judge_stream,
    settings_for,
)
from gateway.bench.faults.scenarios import (
    flapping_backend,
    garbage_backend,
    hanging_backend,
    kill_while_streaming,
    loading_backend,
    slow_client,
)

__all__ = [
    "GARBAGE",
    "AsyncThread",
    "GarbageBackend",
    "HugeHeaderResult",
    "IdleFlood",
    "Outcome",
    "ScenarioReport",
    "SlowReader",
    "flapping_backend",
    "fleet_and_gateway",
    "free_ports",
    "garbage_backend",
    "hanging_backend",
    "huge_header",
    "idle_flood",
    "is_error_envelope",
    "judge_stream",
    "kill_while_streaming",
    "loading_backend",
    "main",
    "rss_bytes",
    "send_huge_header",
    "settings_for",
    "slow_client",
]
