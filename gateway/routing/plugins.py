"""The three plugin kinds, the learning hooks, and the registries.

A filter returns the eligible subset; a scorer returns one score in [0, 1] per candidate (higher is better);
a picker orders the candidates, best first (the rest are the failover order). Weights live in the profile,
never in a scorer. Each plugin is built as ``Plugin(state, **params)``: ``state`` is the gateway's shared
:class:`~gateway.routing.state.RoutingState`, ``params`` come from the profile's YAML, checked against the
constructor's annotations (types, and bounds written as ``Annotated[float, Gt(0)]``) before it is built, so a
profile in the file, a reload or the admin API with a bad value is refused naming it. Registering a plugin is
one line in its package's ``__init__``.

A plugin that learns implements either hook of :class:`Learner` (``routed``: the request was sent to a
backend; ``observe``: it finished there) and the pipeline calls it; state shared by several plugins (the
prefix index) is a learner of its own, attached to the ``RoutingState``. What one plugin leaves for a later
stage travels in typed fields of :class:`~gateway.routing.request.RouteRequest`, never a free dictionary.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from gateway.pool.backend import Backend
from gateway.routing.request import Outcome, RouteRequest

if TYPE_CHECKING:
    from gateway.routing.state import RoutingState


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


class Learner(Protocol):
    """Hooks of a plugin (or shared state) that learns; a plugin may implement either or both."""

    def routed(self, request: RouteRequest, backend: Backend) -> None:
        """The request is being sent to ``backend`` (once per attempt: failover calls it again)."""

    def observe(self, outcome: Outcome, backend: Backend) -> None:
        """The request finished on ``backend``: what it cost, what the engine reported."""


def hooks(plugin: object) -> tuple[Callable[[RouteRequest, Backend], None] | None,
                                   Callable[[Outcome, Backend], None] | None]:
    """The ``routed`` and ``observe`` hooks a plugin implements (None for each it does not)."""
    return getattr(plugin, "routed", None), getattr(plugin, "observe", None)


FILTERS: dict[str, Callable[..., Filter]] = {}
SCORERS: dict[str, Callable[..., Scorer]] = {}
PICKERS: dict[str, Callable[..., Picker]] = {}


def build_plugin(registry: dict[str, Callable[..., Any]], kind: str, name: str, state: RoutingState,
                 params: dict[str, Any]) -> Any:
    """``name``'s plugin built with ``params``; ValueError naming the plugin and the parameter at fault."""
    factory = registry.get(name)
    if factory is None:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(registry))}")
    try:
        checked = parameters(factory).model_validate(params)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"]) or "parameters"
        raise ValueError(f"{kind} {name!r}: {where}: {error['msg']}") from None
    try:  # (only the parameters given: the rest keep the constructor's defaults)
        return factory(state, **{field: getattr(checked, field) for field in params})
    except TypeError as exc:
        raise ValueError(f"{kind} {name!r}: {exc}") from None


@functools.cache
def parameters(factory: Callable[..., Any]) -> type[BaseModel]:
    """The parameters ``factory`` takes after ``state``, as a model of its constructor's annotations (an
    unknown one refused; one of a type no file can write, like a ``random.Random``, refused whatever it is)."""
    fields: dict[str, Any] = {
        param.name: (Any if param.annotation is inspect.Parameter.empty else param.annotation,
                     ... if param.default is inspect.Parameter.empty else param.default)
        for param in list(inspect.signature(factory, eval_str=True).parameters.values())[1:]}
    config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    model: type[BaseModel] = create_model(f"{getattr(factory, '__name__', 'plugin')}Parameters", __config__=config,
                                          **fields)
    return model
