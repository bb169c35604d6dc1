"""Seeding a gateway's engine-shape model for a benchmark: from a ``gateway profile`` measurement of the fleet
under test (``profile``) or from each engine's built-in shape (``engine-defaults``); which targets run which,
the profile itself, and what changed between the two per level. Shared by ``routing shape`` and
``routing real-shape``."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gateway.bench.profile import plot_profile
from gateway.bench.report import write_json
from gateway.bench.routing.stack import Log, better, fmt

SEEDINGS = ("profile", "engine-defaults")


def uses_shape_model(policy: str, profiles: dict[str, Any]) -> bool:
    """Whether the policy's routing profile scores with ``engine-shape`` (so its seeding matters)."""
    from gateway.config import ProfileSettings as RoutingProfile
    from gateway.routing.policies import BUILTIN

    profile = RoutingProfile.model_validate(profiles[policy]) if policy in profiles else BUILTIN.get(policy)
    return profile is not None and any(s.name == "engine-shape" for s in profile.scorers)


def levels_the_gateway_uses(path: Path, log: Log) -> dict[str, list[int]]:
    """The profile's levels per backend as the gateway loads them (it skips levels measured on a saturated
    machine); says so when a backend is left with none, as its model then starts from the engine seed."""
    from gateway.routing.shape_model import load_profile_file

    used = {name: sorted(table) for name, (table, _) in load_profile_file(path).items()}
    doc = json.loads(path.read_text())
    for name in doc.get("backends", {}):
        if not used.get(name):
            log(f"  note: every level of {name} was measured on a saturated machine; the gateway ignores them "
                f"and seeds {name} from its engine's defaults")
    return used


class SeedingOptions(Protocol):
    policies: list[str]
    seed_from: str
    compare_seeding: bool
    profiles: dict[str, Any]


def seeded_targets(cfg: SeedingOptions) -> list[tuple[str, str, str]]:
    """(target name, policy, seeding) per routed target: every policy seeded as ``seed_from`` under its own
    name; with ``compare_seeding``, each shape-modelling policy also seeded the other way, as POLICY@SEEDING."""
    if cfg.seed_from not in SEEDINGS:
        raise ValueError(f"seed_from: {cfg.seed_from!r}; known: {', '.join(SEEDINGS)}")
    other = next(s for s in SEEDINGS if s != cfg.seed_from)
    out = [(p, p, cfg.seed_from) for p in cfg.policies]
    if cfg.compare_seeding:
        out += [(f"{p}@{other}", p, other) for p in cfg.policies if uses_shape_model(p, cfg.profiles)]
    return out


@dataclass
class Seeding:
    """The measured profile the gateways are seeded from (none when every target uses the engine defaults)."""

    targets: list[tuple[str, str, str]]  # (target name, policy, seeding), as seeded_targets gives them
    doc: dict[str, Any] | None = None
    path: Path | None = None
    used: dict[str, list[int]] = field(default_factory=dict)  # levels the gateway loads, per backend

    def profile_for(self, seeding: str) -> Path | None:
        return self.path if seeding == "profile" else None

    def report(self, seed_from: str) -> dict[str, Any]:
        return {"from": seed_from, "targets": {n: s for n, _, s in self.targets},
                "profile_path": None if self.path is None else str(self.path),
                "profile_levels_used": self.used, "profile": self.doc}


def seed(cfg: SeedingOptions, measure: Callable[[], dict[str, Any]], path: Path, log: Log) -> Seeding:
    """The targets to run and, when one of them is seeded from a profile, the profile ``measure`` takes,
    written to ``path`` (JSON and PNG)."""
    seeding = Seeding(seeded_targets(cfg))
    if any(s == "profile" for _, _, s in seeding.targets):
        seeding.doc = measure()
        seeding.path = write_json(seeding.doc, path)
        plot_profile(seeding.doc, seeding.path.with_suffix(".png"))
        seeding.used = levels_the_gateway_uses(seeding.path, log)
    return seeding


def seeding_level(rows: dict[str, dict[str, Any]], targets: Sequence[tuple[str, str, str]]
                  ) -> dict[str, dict[str, Any]]:
    """Per policy run both ways: aggregate output tok/s, TTFT p50/p90 and e2e p90 (ms) under each seeding,
    and profile against engine-defaults (x better; above 1: seeding from the profile is better)."""
    out: dict[str, dict[str, Any]] = {}
    by_policy: dict[str, dict[str, str]] = {}
    for name, policy, seeding in targets:
        by_policy.setdefault(policy, {})[seeding] = name
    for policy, names in by_policy.items():
        if len(names) < 2 or any(n not in rows for n in names.values()):
            continue
        figs = {seeding: {k: rows[name][k] for k in ("output_tok_s", "ttft_ms_p50", "ttft_ms_p90", "e2e_ms_p90")}
                for seeding, name in names.items()}
        prof, base = figs["profile"], figs["engine-defaults"]
        out[policy] = {**figs, "profile_vs_engine_defaults": {
            "throughput_x": better(base["output_tok_s"], prof["output_tok_s"], lower_is_better=False),
            "ttft_p50_x": better(base["ttft_ms_p50"], prof["ttft_ms_p50"]),
            "ttft_p90_x": better(base["ttft_ms_p90"], prof["ttft_ms_p90"]),
            "e2e_p90_x": better(base["e2e_ms_p90"], prof["e2e_ms_p90"])}}
    return out


def print_seeding(console: Any, doc: dict[str, Any]) -> None:
    """Per level, each policy run both ways: seeded from the profile vs from the engine defaults."""
    from rich.table import Table

    levels = sorted(int(k) for k in doc["levels"])
    rows = [(lv, policy, fig) for lv in levels for policy, fig in doc["levels"][str(lv)].get("seeding", {}).items()]
    if not rows:
        return
    table = Table(title="seeded from the profile vs from engine defaults (profile / defaults; x: above 1, profile "
                        "better)")
    for col in ("users", "policy", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "tok/s x", "TTFT p50 x",
                "TTFT p90 x"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for lv, policy, fig in rows:
        prof, base, x = fig["profile"], fig["engine-defaults"], fig["profile_vs_engine_defaults"]
        table.add_row(str(lv), policy, *[f"{fmt(prof[k], 0)} / {fmt(base[k], 0)}"
                                         for k in ("output_tok_s", "ttft_ms_p50", "ttft_ms_p90")],
                      fmt(x["throughput_x"], 2), fmt(x["ttft_p50_x"], 2), fmt(x["ttft_p90_x"], 2))
    console.print(table)
