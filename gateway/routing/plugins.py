"""The three plugin kinds and their registries.

A filter returns the eligible subset; a scorer returns one score in [0, 1] per candidate (higher is better);
a picker orders the candidates, best first (the rest are the failover order). Weights live in the profile,
never in a scorer. Each plugin is built as ``Plugin(state, **params)``: ``state`` is the gateway's shared
:class:`RoutingState`, ``params`` come from the profile's YAML. Registering a plugin is one line in its
package's ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gateway.pool.backend import Backend
from gateway.routing.request import RouteRequest
from gateway.routing.state import RoutingState


class Filter(Protocol):
    name: str

    def filter(self, request: RouteRequest, backends: Sequence[Backend]) -> list[Backend]: ...


class Scorer(Protocol):
    name: str
    uses_prefix: bool  # the pipeline keeps the prefix index up to date when any plugin says so

    def score(self, request: RouteRequest, backends: Sequence[Backend]) -> list[float]: ...


class Picker(Protocol):
    name: str

    def pick(self, request: RouteRequest, backends: Sequence[Backend], scores: Sequence[float]) -> list[Backend]:
        ...


FILTERS: dict[str, Callable[..., Filter]] = {}
SCORERS: dict[str, Callable[..., Scorer]] = {}
PICKERS: dict[str, Callable[..., Picker]] = {}


def build_plugin(registry: dict[str, Callable[..., Any]], kind: str, name: str, state: RoutingState,
                 params: dict[str, Any]) -> Any:
    factory = registry.get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    try:
        return factory(state, **params)
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}") from None
