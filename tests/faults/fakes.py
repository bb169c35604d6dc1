"""Fakes for the fault tests: a backend answering garbage SSE, and a client reading a stream slowly.

Both live in :mod:`gateway.bench.faults` (``gateway bench faults`` runs the same scenarios); re-exported here
with the modes the tests pick from.
"""

from __future__ import annotations

from gateway.bench.faults import GARBAGE, AsyncThread, GarbageBackend, SlowReader

__all__ = ["GARBAGE", "AsyncThread", "GarbageBackend", "SlowReader"]
