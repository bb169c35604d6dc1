"""(d) ``gateway bench routing real-shape``: engine-shape vs least-load on real llama-server processes of two shapes.

Two ``llama-server`` processes on one generated model: ``one-slot`` (1 slot, 2 threads: fastest alone, queues
everyone else) and ``four-slot`` (4 slots, 1 thread: slower alone, serves four at once). First a copy of that
pair is profiled with ``gateway profile``'s code, each server behind its own single-backend gateway (as the
gateway under test sees it; and the bench client straight to llama-server loses every other request to the
connection llama-server closes after a stream), and the profile is written as ``real-shape-profile.json``. Then
each policy gets its own fresh pair and a gateway seeded with that profile (``routing.engine_profile``;
least-load ignores it), and a closed-loop ramp of 1, 2, 4, 8 users runs them interleaved round by round, so
both see the same machine. Per level and policy: aggregate output tokens/s, TTFT p50/p90, end to end p90,
requests per backend; and engine-shape against least-load (x better). ``compare_seeding`` adds engine-shape
seeded from the engine defaults (one llama.cpp seed for both servers: only their slot counts tell them apart).

On a 2-core machine the engines, the gateways and the load generator share the CPUs: the figures are this
machine's, and only the ratios within one run compare.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.bench.client import Target
from gateway.bench.profile import ProfileSettings, profile_fleet
from gateway.bench.report import build_report
from gateway.bench.routing.seeding import print_seeding, seed, seeding_level
from gateway.bench.routing.stack import (
    SHAPE_POLICIES,
    Log,
    PortPool,
    Stack,
    better,
    fmt,
    policy_summary,
    rich_console,
    run_interleaved,
)
from gateway.bench.runner import Arrival, host_busy_share, host_cpu_times, run_sync
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload


@dataclass(frozen=True)
class ServerShape:
    name: str
    slots: int
    threads: int


REAL_SHAPES = (ServerShape("one-slot", slots=1, threads=2), ServerShape("four-slot", slots=4, threads=1))


@dataclass
class RealShapeConfig:
    policies: list[str] = field(default_factory=lambda: list(SHAPE_POLICIES))
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    rounds: int = 8
    min_round: int = 8  # requests per policy per round, at least (and at least the level)
    input_len: int = 128  # words; the generated model's tokenizer makes ~2.9 tokens of each
    output_len: int = 64
    model_size: str = "large"
    ctx: int = 2048  # per slot
    profile_levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    profile_requests_per_user: int = 4
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18840
    profiles: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("reports/routing")
    seed_from: str = "profile"  # or "engine-defaults" (the same llama.cpp seed for both servers)
    compare_seeding: bool = False  # also run engine-shape seeded the other way, as engine-shape@SEEDING

    @classmethod
    def quick(cls, **overrides: Any) -> RealShapeConfig:
        """The smallest meaningful run (tens of seconds): the tiny model, two levels, one short round each."""
        small: dict[str, Any] = {"levels": [1, 4], "rounds": 1, "min_round": 4, "input_len": 32, "output_len": 16,
                                 "model_size": "tiny", "ctx": 1024, "profile_levels": [1, 4],
                                 "profile_requests_per_user": 1}
        return cls(**{**small, **overrides})


def real_shape_requests(cfg: RealShapeConfig, level: int) -> tuple[list[BenchRequest], int]:
    """The requests of one level (the same for every policy) and the round size."""
    round_size = max(cfg.min_round, level)
    wl = WorkloadConfig(kind="random", count=round_size * cfg.rounds, seed=cfg.seed + level,
                        input_min=cfg.input_len, input_max=cfg.input_len, output_min=cfg.output_len,
                        output_max=cfg.output_len, ignore_eos=True)
    return build_workload(wl), round_size


def real_shape_level(doc: dict[str, Any]) -> dict[str, Any]:
    """One level's figures per policy, and engine-shape against least-load (x better; above 1: better)."""
    rows = {name: policy_summary(t) for name, t in doc["targets"].items()}
    out: dict[str, Any] = {"policies": rows}
    if "least-load" in rows and "engine-shape" in rows:
        ll, es = rows["least-load"], rows["engine-shape"]
        out["engine_shape_vs_least_load"] = {
            "throughput_x": better(ll["output_tok_s"], es["output_tok_s"], lower_is_better=False),
            "ttft_p50_x": better(ll["ttft_ms_p50"], es["ttft_ms_p50"]),
            "ttft_p90_x": better(ll["ttft_ms_p90"], es["ttft_ms_p90"]),
            "e2e_p90_x": better(ll["e2e_ms_p90"], es["e2e_ms_p90"]),
        }
    return out


class ServerPairs:
    """Starts llama-server pairs of :data:`REAL_SHAPES` on one binary and model; each stop goes to ``stack``."""

    def __init__(self, cfg: RealShapeConfig, ports: PortPool) -> None:
        from gateway.llamacpp.build import build
        from gateway.llamacpp.model import model_path

        self.cfg = cfg
        self.ports = ports
        self.binary = build(quiet=True)
        self.model = model_path(cfg.model_size)

    def pair(self, stack: Stack) -> list[tuple[str, str, str]]:
        """A fresh pair, each answered one short request; their (name, engine, url) gateway entries."""
        from gateway.llamacpp.server import LlamaServer

        out = []
        for shape in REAL_SHAPES:
            server = LlamaServer(self.binary, self.model, self.ports.take(), slots=shape.slots, ctx=self.cfg.ctx,
                                 threads=shape.threads)
            stack.add_stopper(server.stop)
            server.start(timeout=120)
            # the first request of a fresh process pays for paging the model in; no policy should
            httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
            out.append((shape.name, "llamacpp", server.url))
        return out


def profile_real_pair(cfg: RealShapeConfig, servers: ServerPairs, log: Log) -> dict[str, Any]:
    """Profile a pair like the ones under test, each behind its own single-backend gateway, by backend name."""
    stack = Stack(cfg.out / "real-shape", log, cfg.scrape_interval)
    settings = ProfileSettings(levels=sorted(set(cfg.profile_levels)), input_len=cfg.input_len,
                               output_len=cfg.output_len, requests_per_user=cfg.profile_requests_per_user,
                               seed=cfg.seed)
    try:
        pairs = []
        for name, engine, url in servers.pair(stack):
            gw = stack.gateway(f"profile-{name}", servers.ports.take(), [(name, engine, url)], "least-load",
                               backend_options={"cache_ram_mib": 0})
            pairs.append((Target(name, gw.url), engine))
        # the engines compute on this machine's CPUs: a busy machine is the engine at work, not a floor
        doc = profile_fleet(pairs, settings, log, saturated_at=None)
    finally:
        stack.stop()
    doc["measured_for"] = {"benchmark": "real-shape", "through": "a single-backend gateway per server",
                           "servers": [asdict(s) for s in REAL_SHAPES], "model": str(servers.model)}
    return doc


def run_real_shape(cfg: RealShapeConfig, log: Log = print) -> dict[str, Any]:
    workdir = cfg.out / "real-shape"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    started = time.perf_counter()
    servers = ServerPairs(cfg, ports)

    def measure() -> dict[str, Any]:
        log(f"real-shape: profiling {', '.join(s.name for s in REAL_SHAPES)} at levels {cfg.profile_levels}")
        return profile_real_pair(cfg, servers, log)

    seeding = seed(cfg, measure, cfg.out / "real-shape-profile.json", log)
    seeded = seeding.targets
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    levels: dict[str, Any] = {}
    try:
        targets = [stack.gateway(name, ports.take(), servers.pair(stack), policy,
                                 engine_profile=seeding.profile_for(seeded_as), backend_options={"cache_ram_mib": 0})
                   for name, policy, seeded_as in seeded]
        log(f"real-shape: targets {', '.join(t.name for t in targets)}; levels {cfg.levels}")
        for level in cfg.levels:
            requests, round_size = real_shape_requests(cfg, level)
            before = host_cpu_times()
            t0 = time.perf_counter()
            result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=level), round_size,
                                              request_timeout=300))
            row = real_shape_level(build_report(result, {"level": level}, include_requests=False))
            row["seeding"] = seeding_level(row["policies"], seeded)
            row["host_busy_share"] = host_busy_share(before, host_cpu_times())
            levels[str(level)] = row
            log(f"  {level:>2} users: {time.perf_counter() - t0:5.1f} s  " + "  ".join(
                f"{n} {fmt(p['output_tok_s'], 0)} tok/s TTFT p90 {fmt(p['ttft_ms_p90'], 0)} ms"
                for n, p in row["policies"].items()))
            time.sleep(2 * cfg.scrape_interval)  # let every gateway read the idle engines
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["model"] = str(servers.model)
    config["servers"] = [asdict(s) for s in REAL_SHAPES]
    return {"schema": "gateway-bench-routing/1", "benchmark": "real-shape",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
            "wall_s": time.perf_counter() - started,
            "seeding": seeding.report(cfg.seed_from), "levels": levels}


def plot_real_shape(doc: dict[str, Any], path: Path) -> Path:
    """Aggregate tok/s, TTFT p50/p90, engine-shape vs least-load, and each policy's share on one-slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k) for k in doc["levels"])
    rows = [doc["levels"][str(lv)] for lv in levels]
    names = list(rows[0]["policies"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    for name in names:
        ax.plot(levels, [r["policies"][name]["output_tok_s"] or 0 for r in rows], marker="o", label=name)
    ax.set_ylabel("aggregate output tok/s")
    ax = axes[0][1]
    for i, name in enumerate(names):
        color = f"C{i}"
        for key, style in (("ttft_ms_p50", "-"), ("ttft_ms_p90", "--")):
            pts = [(lv, r["policies"][name][key]) for lv, r in zip(levels, rows, strict=True)]
            pts = [(x, y) for x, y in pts if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                    label=f"{name} {key[8:]}")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms; solid p50, dashed p90)")
    ax = axes[1][0]
    for key, label in (("throughput_x", "aggregate tok/s"), ("ttft_p50_x", "TTFT p50"), ("ttft_p90_x", "TTFT p90")):
        pts = [(lv, r.get("engine_shape_vs_least_load", {}).get(key)) for lv, r in zip(levels, rows, strict=True)]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_ylabel("engine-shape vs least-load, x better")
    ax = axes[1][1]
    first = REAL_SHAPES[0].name
    for name in names:
        shares = []
        for r in rows:
            counts = r["policies"][name]["backends"]
            total = sum(counts.values())
            shares.append(counts.get(first, 0) / total if total else 0.0)
        ax.plot(levels, shares, marker="o", label=name)
    ax.set_ylim(-0.05, 1.05)
    ax.set_ylabel(f"share of requests sent to {first}")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrent users")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    shapes = ", ".join(f"{s.name}: {s.slots} slot(s) x {s.threads} thread(s)" for s in REAL_SHAPES)
    fig.suptitle(f"engine shape on real llama-server ({shapes}; {doc['config']['model_size']} model), "
                 "closed-loop ramp")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_real_shape(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = rich_console()
    table = Table(title="real llama-server, per level and policy")
    for col in ("users", "policy", "out tok/s", "TTFT p50 ms", "TTFT p90 ms", "e2e p90 ms", "requests per backend",
                "tok/s x", "TTFT p50 x", "TTFT p90 x", "CPU busy"):
        table.add_column(col, justify="left" if col in ("policy", "requests per backend") else "right")
    for lv in sorted(int(k) for k in doc["levels"]):
        row = doc["levels"][str(lv)]
        x = row.get("engine_shape_vs_least_load", {})
        busy = row.get("host_busy_share")
        for i, (name, p) in enumerate(row["policies"].items()):
            last = i == len(row["policies"]) - 1
            table.add_row(
                str(lv) if i == 0 else "", name, fmt(p["output_tok_s"], 0), fmt(p["ttft_ms_p50"], 0),
                fmt(p["ttft_ms_p90"], 0), fmt(p["e2e_ms_p90"], 0),
                " ".join(f"{b} {n}" for b, n in p["backends"].items())
                + (f" ({p['errors']} err)" if p["errors"] else ""),
                *([fmt(x.get(k), 2) for k in ("throughput_x", "ttft_p50_x", "ttft_p90_x")] if last else ["", "", ""]),
                fmt(None if busy is None else 100 * busy, 0, "%") if last else "")
    console.print(table)
    console.print("x: engine-shape against least-load, above 1: engine-shape better")
    print_seeding(console, doc)
