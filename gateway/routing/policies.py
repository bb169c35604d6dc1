"""Named policies: which filters, scorers (with weights) and picker make up each."""

from __future__ import annotations

from dataclasses import dataclass

import gateway.routing.filters
import gateway.routing.pickers
import gateway.routing.scorers  # noqa: F401  (registers the plugins)
from gateway.config import ConfigError, Settings
from gateway.routing.pipeline import Pipeline
from gateway.routing.plugins import FILTERS, PICKERS, SCORERS


@dataclass(frozen=True, slots=True)
class PolicySpec:
    filters: tuple[str, ...]
    scorers: tuple[tuple[str, float], ...]
    picker: str


BASE_FILTERS = ("serves-model", "healthy")

POLICIES: dict[str, PolicySpec] = {
    "round-robin": PolicySpec(BASE_FILTERS, (), "round-robin"),
    "least-load": PolicySpec(BASE_FILTERS, (("least-load", 1.0),), "max-score"),
}


class UnknownPolicy(ValueError):
    pass


def check_settings(settings: Settings) -> None:
    """What the schema cannot check: the configured policy exists. Raises ConfigError."""
    try:
        build_pipeline(settings.routing.policy)
    except UnknownPolicy as exc:
        raise ConfigError(str(exc)) from None


def build_pipeline(policy: str) -> Pipeline:
    spec = POLICIES.get(policy)
    if spec is None:
        raise UnknownPolicy(f"routing.policy: unknown policy {policy!r}; known: {', '.join(sorted(POLICIES))}")
    return Pipeline(
        policy=policy,
        filters=[FILTERS[name]() for name in spec.filters],
        scorers=[(SCORERS[name](), weight) for name, weight in spec.scorers],
        picker=PICKERS[spec.picker](),
    )
