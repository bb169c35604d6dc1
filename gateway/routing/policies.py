"""Routing profiles: built-in ones, and any defined in the configuration's ``routing.profiles``."""

from __future__ import annotations

from typing import Any

import gateway.routing.filters
import gateway.routing.pickers
import gateway.routing.scorers  # noqa: F401  (registers the plugins)
from gateway.config import ConfigError, PluginSettings, ProfileSettings, RoutingSettings, Settings
from gateway.routing.pipeline import Pipeline
from gateway.routing.plugins import FILTERS, PICKERS, SCORERS, build_plugin
from gateway.routing.state import RoutingState


def _scorers(*pairs: tuple[str, float]) -> list[PluginSettings]:
    return [PluginSettings(name=name, weight=weight) for name, weight in pairs]


BUILTIN: dict[str, ProfileSettings] = {
    "round-robin": ProfileSettings(picker="round-robin"),
    "least-load": ProfileSettings(scorers=_scorers(("least-load", 1.0))),
    "prefix": ProfileSettings(scorers=_scorers(("prefix", 3.0), ("least-load", 1.0))),
    # the engines' KV events where a backend publishes them (and the model has a tokenizer), else as "prefix"
    "precise-prefix": ProfileSettings(scorers=_scorers(("precise-prefix", 3.0), ("least-load", 1.0))),
    "session": ProfileSettings(scorers=_scorers(("session", 10.0), ("least-load", 1.0))),
    "engine-shape": ProfileSettings(scorers=_scorers(("engine-shape", 1.0))),
    "consistent-prefix": ProfileSettings(picker="consistent-hash"),
    # sessions stick; shared prefixes go where they are cached (as the engines' events say, where they publish
    # them); otherwise the engine predicted to finish first, nudged towards the less loaded
    "default": ProfileSettings(scorers=_scorers(("session", 4.0), ("precise-prefix", 3.0), ("engine-shape", 2.0),
                                                ("least-load", 1.0))),
}


class UnknownPolicy(ValueError):
    pass


def _spec(entry: str | PluginSettings) -> tuple[str, dict[str, Any]]:
    return (entry, {}) if isinstance(entry, str) else (entry.name, entry.params())


def build_pipeline(routing: RoutingSettings | str, state: RoutingState | None = None) -> Pipeline:
    if isinstance(routing, str):
        routing = RoutingSettings(policy=routing)
    profile = routing.profiles.get(routing.policy) or BUILTIN.get(routing.policy)
    if profile is None:
        known = sorted({*BUILTIN, *routing.profiles})
        raise UnknownPolicy(f"routing.policy: unknown policy {routing.policy!r}; known: {', '.join(known)}")
    state = state or RoutingState(routing.engine_profile)
    where = f"routing profile {routing.policy!r}"
    try:
        filters = [build_plugin(FILTERS, "filter", *_spec(f)[:1], state, _spec(f)[1]) for f in profile.filters]
        scorers = [(build_plugin(SCORERS, "scorer", s.name, state, s.params()), s.weight) for s in profile.scorers]
        picker_name, picker_params = _spec(profile.picker)
        picker = build_plugin(PICKERS, "picker", picker_name, state, picker_params)
    except ValueError as exc:
        raise UnknownPolicy(f"{where}: {exc}") from None
    return Pipeline(policy=routing.policy, filters=filters, scorers=scorers, picker=picker, state=state)


def check_settings(settings: Settings) -> None:
    """What the schema cannot check: the configured policy and its plugins exist. Raises ConfigError."""
    try:
        build_pipeline(settings.routing)
    except (UnknownPolicy, OSError) as exc:
        raise ConfigError(str(exc)) from None
