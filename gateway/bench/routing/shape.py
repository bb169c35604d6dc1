"""(b) ``gateway bench routing shape``: an ExLlamaV2-like and a vLLM-like backend over a 1 -> 64 user ramp.

The gateways under test model each engine's shape from a measurement, not from the emulator's constants:
before the ramp the benchmark profiles a fresh copy of its own fleet with ``gateway profile``'s code (a few
levels, the benchmark's own request lengths), writes ``shape-profile.json`` into the report directory and gives
it to every gateway as ``routing.engine_profile``. ``seed_from="engine-defaults"`` runs without it (the shape
model then starts from the engine specs' seeds); ``compare_seeding`` runs each policy that models engine shape
both ways, the other way as a target named ``POLICY@SEEDING``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import Target
from gateway.bench.profile import ProfileSettings, profile_fleet
from gateway.bench.report import build_report
from gateway.bench.routing.seeding import print_seeding, seed, seeding_level
from gateway.bench.routing.stack import (
    SHAPE_POLICIES,
    SIM_MODEL,
    Log,
    PortPool,
    Stack,
    better,
    fmt,
    policy_summary,
    print_targets,
    rich_console,
    run_interleaved,
    sim_server,
    target_check,
)
from gateway.bench.runner import (
    Arrival,
    host_busy_share,
    host_cpu_times,
    run_sync,
)
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload


@dataclass
class ShapeConfig:
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    policies: list[str] = field(default_factory=lambda: list(SHAPE_POLICIES))
    alone: bool = True  # each engine alone behind a single-backend gateway, as the reference
    rounds: int = 2
    min_round: int = 8  # requests per target per round, at least (and at least the level)
    input_len: int = 64
    output_len: int = 64
    time_scale: float = 1.0
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18760
    profiles: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("reports/routing")
    seed_from: str = "profile"  # or "engine-defaults"
    compare_seeding: bool = False  # run the shape-modelling policies seeded both ways
    profile_levels: list[int] | None = None  # default: 1, 4, 16, ... and the ramp's top level
    profile_requests_per_user: int = 1

    @classmethod
    def quick(cls, **overrides: Any) -> ShapeConfig:
        """A run of well under a minute: two levels, one round, fast emulators, short requests."""
        small: dict[str, Any] = {"levels": [1, 4], "alone": False, "rounds": 1, "min_round": 4, "input_len": 32,
                                 "output_len": 16, "time_scale": 2.0, "profile_levels": [1, 4]}
        return cls(**{**small, **overrides})


SHAPE_ENGINES = (("tabby", "tabbyapi"), ("vllm", "vllm"))


def profile_levels(cfg: ShapeConfig) -> list[int]:
    """The profile's levels: as configured, else 1, 4, 16, ... up to and including the ramp's top level."""
    if cfg.profile_levels:
        return sorted(set(cfg.profile_levels))
    top = max(cfg.levels)
    out = [1]
    while out[-1] * 4 < top:
        out.append(out[-1] * 4)
    return sorted({*out, top})


def profile_shape_fleet(cfg: ShapeConfig, ports: PortPool, log: Log) -> dict[str, Any]:
    """Profile a fresh copy of the benchmark's fleet (same backend names, engines and time scale) with the
    benchmark's request lengths; its figures stay in the units the gateway sees (a time scale is not undone)."""
    stack = Stack(cfg.out / "shape", log, cfg.scrape_interval)
    settings = ProfileSettings(levels=profile_levels(cfg), input_len=cfg.input_len, output_len=cfg.output_len,
                               requests_per_user=cfg.profile_requests_per_user, seed=cfg.seed)
    try:
        servers = [sim_server(label, engine, ports.take(), cfg.time_scale) for label, engine in SHAPE_ENGINES]
        urls = stack.fleet("profile", servers)
        pairs = [(Target(s["name"], u, SIM_MODEL), engine)
                 for s, u, (_, engine) in zip(servers, urls, SHAPE_ENGINES, strict=True)]
        doc = profile_fleet(pairs, settings, log)
    finally:
        stack.stop()
    doc["measured_for"] = {"benchmark": "shape", "emulator_time_scale": cfg.time_scale,
                           "units": "as the gateway under test sees them (time scale not undone)"}
    return doc


def shape_requests(cfg: ShapeConfig, level: int) -> tuple[list[BenchRequest], int]:
    """The requests of one level (same for every target) and the round size."""
    round_size = max(cfg.min_round, level)
    wl = WorkloadConfig(kind="random", count=round_size * cfg.rounds, seed=cfg.seed + level,
                        input_min=cfg.input_len, input_max=cfg.input_len, output_min=cfg.output_len,
                        output_max=cfg.output_len, ignore_eos=True)
    return build_workload(wl), round_size


def shape_level(doc: dict[str, Any], policies: Sequence[str], alone: Sequence[str]) -> dict[str, Any]:
    """One level's figures: per target e2e p50/p90 (ms) and ratios (x better; above 1: better)."""
    rows = {name: policy_summary(t) for name, t in doc["targets"].items()}
    out: dict[str, Any] = {"targets": rows}
    if "least-load" in rows and "engine-shape" in rows:
        out["engine_shape_vs_least_load_p90_x"] = better(rows["least-load"]["e2e_ms_p90"],
                                                         rows["engine-shape"]["e2e_ms_p90"])
        out["engine_shape_vs_least_load_p50_x"] = better(rows["least-load"]["e2e_ms_p50"],
                                                         rows["engine-shape"]["e2e_ms_p50"])
    alone_p90 = [rows[a]["e2e_ms_p90"] for a in alone if a in rows and rows[a]["e2e_ms_p90"] is not None]
    if alone_p90:
        best = min(alone_p90)
        out["best_alone"] = next(a for a in alone if a in rows and rows[a]["e2e_ms_p90"] == best)
        out["best_alone_p90_ms"] = best
        for p in policies:
            if p in rows:
                out[f"{p}_vs_best_alone_p90_x"] = better(best, rows[p]["e2e_ms_p90"])
    return out


def shape_verdict(levels: dict[str, dict[str, Any]], tolerance: float = 0.05) -> list[dict[str, Any]]:
    """The two targets over the ramp: engine-shape p90 at least 1.3x better than least-load (worst level and
    levels >= 8 reported), and never worse than the better engine alone (``tolerance``: run-to-run noise)."""
    ll = {str(k): v.get("engine_shape_vs_least_load_p90_x") for k, v in levels.items()}
    alone = {str(k): v.get("engine-shape_vs_best_alone_p90_x") for k, v in levels.items()}
    out: list[dict[str, Any]] = []
    known = [v for v in ll.values() if v is not None]
    if known:
        worst = min(known)
        check = target_check("shape_vs_least_load_all", worst, 1.3,
                             "engine-shape p90 vs least-load, worst level")
        check["per_level"] = ll
        check["levels_met"] = sorted(int(k) for k, v in ll.items() if v is not None and v >= 1.3)
        out.append(check)
        high = [v for k, v in ll.items() if v is not None and int(k) >= 8]
        if high:
            out.append(target_check("shape_vs_least_load_8plus", min(high), 1.3,
                                    "engine-shape p90 vs least-load, worst level of 8+ users"))
    known_alone = [v for v in alone.values() if v is not None]
    if known_alone:
        worst = min(known_alone)
        check = target_check("shape_vs_best_alone", worst, 1.0,
                             "engine-shape p90 vs the better engine alone, worst level")
        check["per_level"] = alone
        check["within_tolerance"] = worst >= 1.0 - tolerance
        check["tolerance"] = tolerance
        out.append(check)
    return out


def run_shape(cfg: ShapeConfig, log: Log = print) -> dict[str, Any]:
    workdir = cfg.out / "shape"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    started = time.perf_counter()

    def measure() -> dict[str, Any]:
        log(f"shape: profiling the fleet at levels {profile_levels(cfg)}")
        return profile_shape_fleet(cfg, ports, log)

    seeding = seed(cfg, measure, cfg.out / "shape-profile.json", log)
    seeded = seeding.targets
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    levels: dict[str, Any] = {}
    alone_names = [f"{label}-alone" for label, _ in SHAPE_ENGINES] if cfg.alone else []
    try:
        targets: list[Target] = []
        for name, policy, seeded_as in seeded:
            servers = [sim_server(label, engine, ports.take(), cfg.time_scale) for label, engine in SHAPE_ENGINES]
            urls = stack.fleet(name, servers)
            backends = [(s["name"], s["engine"], u) for s, u in zip(servers, urls, strict=True)]
            targets.append(stack.gateway(name, ports.take(), backends, policy,
                                         engine_profile=seeding.profile_for(seeded_as)))
        if cfg.alone:
            servers = [sim_server(label, engine, ports.take(), cfg.time_scale) for label, engine in SHAPE_ENGINES]
            urls = stack.fleet("alone", servers)
            for s, u, name in zip(servers, urls, alone_names, strict=True):
                targets.append(stack.gateway(name, ports.take(), [(s["name"], s["engine"], u)], "least-load"))
        targets = [Target(t.name, t.url, SIM_MODEL, pid=t.pid) for t in targets]
        log(f"shape: targets {', '.join(t.name for t in targets)}; levels {cfg.levels}")
        for level in cfg.levels:
            requests, round_size = shape_requests(cfg, level)
            before = host_cpu_times()
            t0 = time.perf_counter()
            result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=level), round_size,
                                              request_timeout=600))
            bench = build_report(result, {"level": level}, include_requests=False)
            row = shape_level(bench, cfg.policies, alone_names)
            row["seeding"] = seeding_level(row["targets"], seeded)
            row["host_busy_share"] = host_busy_share(before, host_cpu_times())
            levels[str(level)] = row
            t = row["targets"]
            log(f"  {level:>3} users: {time.perf_counter() - t0:5.1f} s  " + "  ".join(
                f"{n} p90 {fmt(t[n]['e2e_ms_p90'], 0)} ms" for n in t))
            time.sleep(2 * cfg.scrape_interval)  # let every gateway read the idle engines
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {"schema": "gateway-bench-routing/1", "benchmark": "shape", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config, "wall_s": time.perf_counter() - started,
            "seeding": seeding.report(cfg.seed_from), "levels": levels, "targets": shape_verdict(levels)}


def plot_shape(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k) for k in doc["levels"])
    names = list(doc["levels"][str(levels[0])]["targets"])
    seeded = sorted({p for lv in levels for p in doc["levels"][str(lv)].get("seeding", {})})
    fig, axes = plt.subplots(1, 4 if seeded else 3, figsize=(21 if seeded else 16, 5))
    for ax, key, label in ((axes[0], "e2e_ms_p50", "end to end p50 (ms)"),
                           (axes[1], "e2e_ms_p90", "end to end p90 (ms)")):
        for name in names:
            ys = [doc["levels"][str(lv)]["targets"][name][key] for lv in levels]
            pts = [(lv, y) for lv, y in zip(levels, ys, strict=True) if y is not None]
            style = "--" if name.endswith("-alone") else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    for key, label in (("engine_shape_vs_least_load_p90_x", "engine-shape vs least-load (p90)"),
                       ("engine-shape_vs_best_alone_p90_x", "engine-shape vs better engine alone (p90)")):
        pts = [(lv, doc["levels"][str(lv)].get(key)) for lv in levels]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.3, color="tab:red", linestyle=":", label="1.3x target")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(lv) for lv in levels])
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("x better (above 1: engine-shape better)")
    ax.grid(alpha=0.3)
    ax.legend()
    if seeded:
        ax = axes[3]
        for policy in seeded:
            for key, label in (("throughput_x", "tok/s"), ("ttft_p50_x", "TTFT p50"), ("ttft_p90_x", "TTFT p90")):
                pts = [(lv, doc["levels"][str(lv)].get("seeding", {}).get(policy, {})
                        .get("profile_vs_engine_defaults", {}).get(key)) for lv in levels]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{policy}: {label}")
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel("x better (above 1: seeded from the profile better)")
        ax.set_title("seeded from a profile vs from engine defaults", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("engine shape: one ExLlamaV2-like + one vLLM-like emulated backend, closed-loop ramp")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_shape(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = rich_console()
    levels = sorted(int(k) for k in doc["levels"])
    names = list(doc["levels"][str(levels[0])]["targets"])
    table = Table(title="end to end per request, ms (p50 / p90)")
    table.add_column("users", justify="right")
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("shape vs least-load p90 x", justify="right")
    table.add_column("shape vs best alone p90 x", justify="right")
    table.add_column("CPU busy", justify="right")
    for lv in levels:
        row = doc["levels"][str(lv)]
        cells = [str(lv)]
        for name in names:
            t = row["targets"][name]
            cells.append(f"{fmt(t['e2e_ms_p50'], 0)} / {fmt(t['e2e_ms_p90'], 0)}"
                         + (f" ({t['errors']} err)" if t["errors"] else ""))
        cells += [fmt(row.get("engine_shape_vs_least_load_p90_x"), 2),
                  fmt(row.get("engine-shape_vs_best_alone_p90_x"), 2),
                  fmt(None if row.get("host_busy_share") is None else 100 * row["host_busy_share"], 0, "%")]
        table.add_row(*cells)
    console.print(table)
    mix = Table(title="requests per backend")
    mix.add_column("users", justify="right")
    for name in names:
        if not name.endswith("-alone"):
            mix.add_column(name)
    for lv in levels:
        row = doc["levels"][str(lv)]["targets"]
        mix.add_row(str(lv), *[" ".join(f"{b} {n}" for b, n in row[name]["backends"].items())
                               for name in names if not name.endswith("-alone")])
    console.print(mix)
    print_seeding(console, doc)
    print_targets(console, doc["targets"])
