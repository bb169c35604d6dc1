"""The three plugin kinds and their registries.

A filter returns the eligible subset; a scorer returns one score in [0, 1] per candidate (higher is better);
a picker orders the candidates, best first (the rest are the failover order). Weights live in the policy,
never in a scorer. Registering a plugin is one line in its package's ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest


class Filter(Protocol):
    name: str

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]: ...


class Scorer(Protocol):
    name: str

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]: ...


class Picker(Protocol):
    name: str

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        ...


FILTERS: dict[str, Callable[[], Filter]] = {}
SCORERS: dict[str, Callable[[], Scorer]] = {}
PICKERS: dict[str, Callable[[], Picker]] = {}
