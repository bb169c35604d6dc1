"""``gateway bench routing {prefix,shape,real-prefix}``: the routing policies measured against each other.

Every benchmark starts what it needs as separate processes on loopback (emulated fleets with
``python -m gateway.sim fleet --config FILE``, real ``llama-server`` processes, and one gateway per policy with
``python -m gateway serve --config FILE``), gives **each policy its own fresh backends and its own gateway**
(so one policy never warms another's caches), drives all gateways with the bench runner's interleaved
``--compare`` machinery (the same requests to every target, round by round, the order rotated each round),
stops every process it started, and writes ``reports/routing/NAME.json`` and ``NAME.png`` (plus the configs
and the processes' logs under ``reports/routing/NAME/``) and prints a table.

* ``prefix``: the shared-prefix workload (default 32 groups of ~1,536-token system prompts, uniform popularity)
  on 4 emulated vLLM-like backends whose prefix caches (``kv_capacity_tokens``) each hold about a third of the
  prefix set. Policies round-robin, least-load, prefix and default. Realized cache-hit rate (cached / prompt
  tokens, from usage), TTFT p50/p90, throughput, and each against round-robin. Target: prefix TTFT p50 at least
  3x better than round-robin.
* ``shape``: closed-loop ramp of 1, 2, 4, ..., 64 users on one ExLlamaV2-like (TabbyAPI) and one vLLM-like
  emulated backend: least-load vs engine-shape (each its own pair of backends and gateway), and each engine
  alone behind a single-backend gateway as the reference. End-to-end p50/p90 per level. Targets: engine-shape
  p90 at least 1.3x better than least-load; at no level worse than the better engine alone.
* ``real-prefix``: prefix vs round-robin on 3 real ``llama-server`` processes per policy (the generated "large"
  model, 2 slots, 1 thread each) with ~1.5k-token shared prefixes: TTFT and cache hits (``timings.cache_n``
  as usage ``cached_tokens``).

A ratio "x better" is reference / this for latencies and this / reference for throughput and hit rate, so
above 1 is always better.
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.client import Target
from gateway.bench.procs import ChildProcess, get_json
from gateway.bench.report import build_report, write_json
from gateway.bench.runner import (
    Arrival,
    RunResult,
    host_busy_share,
    host_cpu_times,
    interleave_order,
    run,
    run_sync,
    split_rounds,
)
from gateway.bench.workload import BenchRequest, WorkloadConfig, build_workload

SIM_MODEL = "sim-llama-2-7b"
HOST = "127.0.0.1"
# tokens the emulators' chat template and the workload's "You are assistant N." header add to a system prompt
SYSTEM_OVERHEAD_TOKENS = 16
PREFIX_POLICIES = ("round-robin", "least-load", "prefix", "default")
SHAPE_POLICIES = ("least-load", "engine-shape")
REAL_POLICIES = ("round-robin", "prefix")

Log = Callable[[str], None]


# --- processes and their configuration ------------------------------------------------------------------------

class PortPool:
    """Consecutive free loopback ports from ``base`` (a port some other process holds is skipped)."""

    def __init__(self, base: int) -> None:
        self.next = base

    def take(self) -> int:
        while self.next < 65535:
            port = self.next
            self.next += 1
            if port_free(port):
                return port
        raise RuntimeError("no free port left")


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def sim_server(name: str, engine: str, port: int, time_scale: float,
               overrides: dict[str, float] | None = None, model: str = SIM_MODEL) -> dict[str, Any]:
    """One entry of a fleet file's ``servers`` list."""
    entry: dict[str, Any] = {"engine": engine, "model": model, "name": name, "port": port,
                             "time_scale": time_scale}
    if overrides:
        entry["set"] = dict(overrides)
    return entry


def fleet_config(servers: Sequence[dict[str, Any]], host: str = HOST) -> dict[str, Any]:
    """A ``python -m gateway.sim fleet --config`` document."""
    return {"host": host, "servers": [dict(s) for s in servers]}


def gateway_config(port: int, backends: Sequence[tuple[str, str, str]], policy: str,
                   scrape_interval: float = 0.2, models: Sequence[str] | None = None,
                   profiles: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``python -m gateway serve --config`` document: ``backends`` are (name, engine, url); ``profiles``
    (``routing.profiles``: your own policies, or built-in ones with other plugin parameters) when given."""
    entries: list[dict[str, Any]] = []
    for name, engine, url in backends:
        entry: dict[str, Any] = {"name": name, "engine": engine, "url": url}
        if models:
            entry["models"] = list(models)
        entries.append(entry)
    routing: dict[str, Any] = {"policy": policy}
    if profiles:
        routing["profiles"] = dict(profiles)
    return {"server": {"host": HOST, "port": port}, "backends": entries, "routing": routing,
            "scrape": {"interval": scrape_interval}}


def load_profiles(path: Path | None) -> dict[str, Any]:
    """A YAML mapping of policy name -> routing profile (as under ``routing.profiles``), or ``{"profiles": ...}``."""
    if path is None:
        return {}
    doc = yaml.safe_load(path.read_text()) or {}
    if isinstance(doc, dict) and isinstance(doc.get("profiles"), dict):
        doc = doc["profiles"]
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping of policy name to profile")
    return doc


def dump_yaml(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def wait_gateway(url: str, backends: int, proc: ChildProcess, timeout: float = 60.0) -> None:
    """Until ``/ready`` shows every backend ready with its models (the first probe also read its capacity)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc.proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with status {proc.proc.returncode}; see {proc.log}")
        try:
            doc = get_json(url + "/ready")
        except OSError as exc:  # URLError (503 while not ready, connection refused) is an OSError
            last = exc
        else:
            last = doc
            states = doc.get("backends", {}).values() if isinstance(doc, dict) else []
            if sum(1 for b in states if b.get("health") == "ready" and b.get("models")) == backends:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} did not see its {backends} backends ready within {timeout:.0f} s "
                       f"(last: {last}); see {proc.log}")


class Stack:
    """The processes of one benchmark; :meth:`stop` ends each, newest first, by its own pid."""

    def __init__(self, workdir: Path, log: Log, scrape_interval: float = 0.2,
                 profiles: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.profiles = profiles or {}
        self.log = log
        self.scrape_interval = scrape_interval
        self.procs: list[ChildProcess] = []
        self.stoppers: list[Callable[[], None]] = []

    def fleet(self, name: str, servers: Sequence[dict[str, Any]]) -> list[str]:
        """Start an emulated fleet; the base URLs of its servers, in order."""
        path = dump_yaml(fleet_config(servers), self.workdir / f"fleet-{name}.yaml")
        proc = ChildProcess(f"fleet {name}", [sys.executable, "-m", "gateway.sim", "fleet", "--config", str(path)],
                            self.workdir / f"fleet-{name}.log")
        self._add(proc)
        urls = [f"http://{HOST}:{s['port']}" for s in servers]
        for url in urls:
            proc.wait_http(url + "/health", timeout=60)
        return urls

    def gateway(self, name: str, port: int, backends: Sequence[tuple[str, str, str]], policy: str,
                models: Sequence[str] | None = None) -> Target:
        doc = gateway_config(port, backends, policy, self.scrape_interval, models, self.profiles)
        path = dump_yaml(doc, self.workdir / f"gateway-{name}.yaml")
        proc = ChildProcess(f"gateway {name}", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                                "--log-level", "warning"], self.workdir / f"gateway-{name}.log")
        self._add(proc)
        url = f"http://{HOST}:{port}"
        wait_gateway(url, len(backends), proc)
        return Target(name, url, pid=proc.pid)

    def _add(self, proc: ChildProcess) -> None:
        self.procs.append(proc)
        self.stoppers.append(proc.stop)
        proc.start()

    def add_stopper(self, stop: Callable[[], None]) -> None:
        self.stoppers.append(stop)

    def stop(self) -> None:
        while self.stoppers:
            try:
                self.stoppers.pop()()
            except Exception as exc:  # keep stopping the rest
                self.log(f"stopping a process failed: {exc}")


async def run_interleaved(targets: Sequence[Target], requests: Sequence[BenchRequest], arrival: Arrival,
                          round_size: int, request_timeout: float = 600.0) -> RunResult:
    """The bench runner's interleaved comparison (same rounds, same rotation: round r starts at target r mod n),
    run phase by phase, each phase on a fresh client session.

    Why not one ``run(targets, ...)``: a target's pooled keep-alive connections sit idle while the others'
    phases run (tens of seconds here), the gateway's server closes them after its keep-alive timeout (uvicorn:
    5 s), and aiohttp, which keeps them for 120 s, reuses a closed one: "Can not write request body".
    """
    out = RunResult(targets=list(targets), results={t.name: [] for t in targets})
    rounds = split_rounds(len(requests), round_size)
    for r, order in enumerate(interleave_order(len(targets), len(rounds))):
        chunk = [requests[i] for i in rounds[r]]
        for k in order:
            target = targets[k]
            phase = await run([target], chunk, arrival, request_timeout=request_timeout)
            for result in phase.results[target.name]:
                result.round = r
            out.results[target.name].extend(phase.results[target.name])
            for p in phase.phases:
                p.round = r
                out.phases.append(p)
    return out


# --- figures ----------------------------------------------------------------------------------------------------

def _ms(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else 1000.0 * v


def better(reference: float | None, value: float | None, lower_is_better: bool = True) -> float | None:
    """How many times better ``value`` is than ``reference`` (above 1: better); None when unknown."""
    if reference is None or value is None or not math.isfinite(reference) or not math.isfinite(value):
        return None
    if lower_is_better:
        return reference / value if value > 0 else None
    return value / reference if reference > 0 else None


def policy_summary(target: dict[str, Any]) -> dict[str, Any]:
    """The figures of one target of a bench report (``build_report(...)["targets"][NAME]``)."""
    m = target["metrics"]
    hit = target.get("cache_hit_ratio")
    return {
        "requests": target["requests"], "ok": target["ok"], "errors": target["errors"],
        "error_samples": target.get("error_samples", []),
        "cache_hit_rate": hit, "prompt_tokens": target.get("prompt_tokens"),
        "cached_tokens": target.get("cached_tokens"),
        "ttft_ms_p50": _ms(m["ttft_s"]["p50"]), "ttft_ms_p90": _ms(m["ttft_s"]["p90"]),
        "ttft_ms_p99": _ms(m["ttft_s"]["p99"]),
        "e2e_ms_p50": _ms(m["e2e_s"]["p50"]), "e2e_ms_p90": _ms(m["e2e_s"]["p90"]),
        "output_tok_s": target.get("output_tok_s"), "requests_per_s": target.get("requests_per_s"),
        "wall_s": target.get("wall_s"), "gateway_cpu_ms_per_request": target.get("cpu_ms_per_request"),
        "backends": dict(sorted(target.get("backends", {}).items())),
    }


def against(summaries: dict[str, dict[str, Any]], reference: str) -> dict[str, dict[str, float | None]]:
    """Each policy against ``reference``: x better (above 1: better)."""
    ref = summaries[reference]
    out: dict[str, dict[str, float | None]] = {}
    for name, s in summaries.items():
        out[name] = {
            "ttft_p50_x": better(ref["ttft_ms_p50"], s["ttft_ms_p50"]),
            "ttft_p90_x": better(ref["ttft_ms_p90"], s["ttft_ms_p90"]),
            "e2e_p50_x": better(ref["e2e_ms_p50"], s["e2e_ms_p50"]),
            "throughput_x": better(ref["output_tok_s"], s["output_tok_s"], lower_is_better=False),
            "hit_rate_x": better(ref["cache_hit_rate"], s["cache_hit_rate"], lower_is_better=False),
        }
    return out


def target_check(name: str, value: float | None, goal: float, what: str) -> dict[str, Any]:
    return {"name": name, "what": what, "value": value, "goal": goal,
            "met": value is not None and value >= goal,
            "miss_by": None if value is None or value >= goal else goal / value}


def _fmt(v: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.{digits}f}{suffix}"


def _print_targets(console: Any, targets: Sequence[dict[str, Any]]) -> None:
    for t in targets:
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        extra = f" (misses by {t['miss_by']:.2f}x)" if t.get("miss_by") else ""
        console.print(f"target {t['what']}: {_fmt(t['value'], 2)}x against {t['goal']}x: {mark}{extra}")


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _phase_note(result: RunResult) -> dict[str, Any]:
    return {"phases": [asdict(p) for p in result.phases]}


# --- (a) prefix -------------------------------------------------------------------------------------------------

@dataclass
class PrefixConfig:
    policies: list[str] = field(default_factory=lambda: list(PREFIX_POLICIES))
    backends: int = 4
    groups: int = 32
    prompts_per_group: int = 16
    system_len: int = 1536
    question_len: int = 64
    output_len: int = 48
    popularity: str = "uniform"
    count: int | None = None  # default: one pass (groups x prompts_per_group)
    cache_share: float = 1 / 3  # of the prefix set, per backend
    concurrency: int = 16
    round_size: int = 128
    time_scale: float = 1.0
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18700
    profiles: dict[str, Any] = field(default_factory=dict)  # extra routing.profiles for every gateway
    out: Path = Path("reports/routing")
    include_requests: bool = True


def prefix_set_tokens(groups: int, system_len: int) -> int:
    """Tokens of all the distinct system prompts as the emulators count them (one per word, plus the
    template's and the header's)."""
    return groups * (system_len + SYSTEM_OVERHEAD_TOKENS)


def kv_capacity_for(groups: int, system_len: int, share: float, question_len: int = 0, output_len: int = 0) -> int:
    """A backend cache holding ``share`` of the prefix set (in the emulators' tokens), and at least two whole
    requests (the emulators also bound one request's prompt + output by it)."""
    one = system_len + question_len + output_len + 2 * SYSTEM_OVERHEAD_TOKENS
    return max(int(prefix_set_tokens(groups, system_len) * share), 2 * one)


def prefix_workload(cfg: PrefixConfig) -> WorkloadConfig:
    return WorkloadConfig(kind="shared-prefix", count=cfg.count, seed=cfg.seed, output_len=cfg.output_len,
                          ignore_eos=True, groups=cfg.groups, prompts_per_group=cfg.prompts_per_group,
                          system_len=cfg.system_len, question_len=cfg.question_len,
                          popularity="zipf" if cfg.popularity == "zipf" else "uniform")


def prefix_fleet(policy: str, cfg: PrefixConfig, ports: Sequence[int]) -> list[dict[str, Any]]:
    kv = kv_capacity_for(cfg.groups, cfg.system_len, cfg.cache_share, cfg.question_len, cfg.output_len)
    return [sim_server(f"vllm-{i}", "vllm", port, cfg.time_scale, {"kv_capacity_tokens": kv})
            for i, port in enumerate(ports)]


def summarize_prefix(doc: dict[str, Any], reference: str = "round-robin") -> dict[str, Any]:
    summaries = {name: policy_summary(t) for name, t in doc["targets"].items()}
    out: dict[str, Any] = {"policies": summaries}
    if reference in summaries:
        out["against"] = against(summaries, reference)
        out["reference"] = reference
        if "prefix" in summaries:
            out["targets"] = [target_check("prefix_ttft_p50", out["against"]["prefix"]["ttft_p50_x"], 3.0,
                                           "prefix TTFT p50 vs round-robin")]
    return out


def run_prefix(cfg: PrefixConfig, log: Log = print) -> dict[str, Any]:
    requests = build_workload(prefix_workload(cfg))
    workdir = cfg.out / "prefix"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    kv = kv_capacity_for(cfg.groups, cfg.system_len, cfg.cache_share, cfg.question_len, cfg.output_len)
    total = prefix_set_tokens(cfg.groups, cfg.system_len)
    log(f"prefix: {len(requests)} requests x {len(cfg.policies)} policies; {cfg.groups} groups of "
        f"~{cfg.system_len + SYSTEM_OVERHEAD_TOKENS}-token prefixes (set ~{total:,} tokens); "
        f"{cfg.backends} vLLM-like backends per policy, cache {kv:,} tokens each")
    try:
        targets = []
        for policy in cfg.policies:
            servers = prefix_fleet(policy, cfg, [ports.take() for _ in range(cfg.backends)])
            urls = stack.fleet(policy, servers)
            backends = [(s["name"], "vllm", u) for s, u in zip(servers, urls, strict=True)]
            targets.append(stack.gateway(policy, ports.take(), backends, policy))
        log("all up; running (interleaved)")
        before = host_cpu_times()
        started = time.perf_counter()
        targets = [Target(t.name, t.url, SIM_MODEL, pid=t.pid) for t in targets]
        result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=cfg.concurrency), cfg.round_size,
                                          request_timeout=300))
        elapsed = time.perf_counter() - started
        busy = host_busy_share(before, host_cpu_times())
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config.update(kv_capacity_tokens=kv, prefix_set_tokens=prefix_set_tokens(cfg.groups, cfg.system_len))
    bench = build_report(result, config, include_requests=cfg.include_requests)
    doc: dict[str, Any] = {"schema": "gateway-bench-routing/1", "benchmark": "prefix",
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                           "host_busy_share": busy, "wall_s": elapsed, **summarize_prefix(bench), "bench": bench,
                           **_phase_note(result)}
    return doc


def plot_policies(doc: dict[str, Any], path: Path, title: str) -> Path:
    """TTFT CDF per policy (when per-request records are present), TTFT p50/p90, hit rate and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = doc["policies"]
    names = list(pol)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    records = doc.get("bench", {}).get("requests") or {}
    drawn = 0
    for name in names:
        values = sorted(1000 * r["ttft"] for r in records.get(name, []) if r.get("ok") and r.get("ttft"))
        if values:
            drawn += 1
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend()
    xs = range(len(names))
    ax = axes[0][1]
    width = 0.4
    ax.bar([x - width / 2 for x in xs], [pol[n]["ttft_ms_p50"] or 0 for n in names], width, label="p50")
    ax.bar([x + width / 2 for x in xs], [pol[n]["ttft_ms_p90"] or 0 for n in names], width, label="p90")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][0]
    ax.bar(list(xs), [100 * (pol[n]["cache_hit_rate"] or 0) for n in names], color="tab:green")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("cache-hit rate (% of prompt tokens)")
    ax.grid(alpha=0.3, axis="y")
    ax = axes[1][1]
    ax.bar(list(xs), [pol[n]["output_tok_s"] or 0 for n in names], color="tab:purple")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tokens/s (while the policy ran)")
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_policies(doc: dict[str, Any], title: str) -> None:
    from rich.table import Table

    console = _console()
    ref = doc.get("reference")
    table = Table(title=title)
    for col in ("policy", "ok/all", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "E2E p50 ms", "out tok/s",
                f"TTFT p50 x vs {ref}", "TTFT p90 x", "tok/s x", "backends"):
        table.add_column(col, justify="left" if col in ("policy", "backends") else "right")
    for name, s in doc["policies"].items():
        a = doc.get("against", {}).get(name, {})
        table.add_row(name, f"{s['ok']}/{s['requests']}",
                      _fmt(None if s["cache_hit_rate"] is None else 100 * s["cache_hit_rate"], 1, "%"),
                      _fmt(s["ttft_ms_p50"]), _fmt(s["ttft_ms_p90"]), _fmt(s["e2e_ms_p50"]),
                      _fmt(s["output_tok_s"], 0), _fmt(a.get("ttft_p50_x"), 2), _fmt(a.get("ttft_p90_x"), 2),
                      _fmt(a.get("throughput_x"), 2),
                      " ".join(f"{b.rsplit('-', 1)[-1]}:{n}" for b, n in s["backends"].items()))
    console.print(table)
    _print_targets(console, doc.get("targets", []))
    if doc.get("host_busy_share") is not None:
        console.print(f"host CPU busy during the run: {100 * doc['host_busy_share']:.0f}%")
    for name, s in doc["policies"].items():
        if s["errors"]:
            console.print(f"[red]{name}: {s['errors']} failed[/red]; e.g. {(s['error_samples'] or ['?'])[0]}")


# --- (b) shape --------------------------------------------------------------------------------------------------

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


SHAPE_ENGINES = (("tabby", "tabbyapi"), ("vllm", "vllm"))


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
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    levels: dict[str, Any] = {}
    busy: dict[str, float | None] = {}
    alone_names = [f"{label}-alone" for label, _ in SHAPE_ENGINES] if cfg.alone else []
    started = time.perf_counter()
    try:
        targets: list[Target] = []
        for policy in cfg.policies:
            servers = [sim_server(label, engine, ports.take(), cfg.time_scale) for label, engine in SHAPE_ENGINES]
            urls = stack.fleet(policy, servers)
            backends = [(s["name"], s["engine"], u) for s, u in zip(servers, urls, strict=True)]
            targets.append(stack.gateway(policy, ports.take(), backends, policy))
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
            busy[str(level)] = host_busy_share(before, host_cpu_times())
            bench = build_report(result, {"level": level}, include_requests=False)
            row = shape_level(bench, cfg.policies, alone_names)
            row["host_busy_share"] = busy[str(level)]
            levels[str(level)] = row
            t = row["targets"]
            log(f"  {level:>3} users: {time.perf_counter() - t0:5.1f} s  " + "  ".join(
                f"{n} p90 {_fmt(t[n]['e2e_ms_p90'], 0)} ms" for n in t))
            time.sleep(2 * cfg.scrape_interval)  # let every gateway read the idle engines
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {"schema": "gateway-bench-routing/1", "benchmark": "shape", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config, "wall_s": time.perf_counter() - started, "levels": levels,
            "targets": shape_verdict(levels)}


def plot_shape(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k) for k in doc["levels"])
    names = list(doc["levels"][str(levels[0])]["targets"])
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
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
    fig.suptitle("engine shape: one ExLlamaV2-like + one vLLM-like emulated backend, closed-loop ramp")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def print_shape(doc: dict[str, Any]) -> None:
    from rich.table import Table

    console = _console()
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
            cells.append(f"{_fmt(t['e2e_ms_p50'], 0)} / {_fmt(t['e2e_ms_p90'], 0)}"
                         + (f" ({t['errors']} err)" if t["errors"] else ""))
        cells += [_fmt(row.get("engine_shape_vs_least_load_p90_x"), 2),
                  _fmt(row.get("engine-shape_vs_best_alone_p90_x"), 2),
                  _fmt(None if row.get("host_busy_share") is None else 100 * row["host_busy_share"], 0, "%")]
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
    _print_targets(console, doc["targets"])


# --- (c) real-prefix --------------------------------------------------------------------------------------------

@dataclass
class RealPrefixConfig:
    policies: list[str] = field(default_factory=lambda: list(REAL_POLICIES))
    servers: int = 3
    slots: int = 2
    ctx: int = 4096  # per slot
    threads: int = 1
    groups: int = 6  # each server's slots hold about a third of them
    prompts_per_group: int = 8
    system_len: int = 500  # words; the generated model's tokenizer makes ~2.9 tokens of each: ~1,450 tokens
    question_len: int = 16
    output_len: int = 8
    concurrency: int = 3
    round_size: int = 16
    count: int | None = None
    scrape_interval: float = 0.5
    seed: int = 0
    base_port: int = 18800
    profiles: dict[str, Any] = field(default_factory=dict)
    out: Path = Path("reports/routing")
    include_requests: bool = True


def real_workload(cfg: RealPrefixConfig) -> WorkloadConfig:
    return WorkloadConfig(kind="shared-prefix", count=cfg.count, seed=cfg.seed, output_len=cfg.output_len,
                          ignore_eos=True, groups=cfg.groups, prompts_per_group=cfg.prompts_per_group,
                          system_len=cfg.system_len, question_len=cfg.question_len)


def run_real_prefix(cfg: RealPrefixConfig, log: Log = print) -> dict[str, Any]:
    from gateway.llamacpp.build import build
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer

    binary = build(quiet=True)
    model = model_path("large")
    requests = build_workload(real_workload(cfg))
    workdir = cfg.out / "real-prefix"
    workdir.mkdir(parents=True, exist_ok=True)
    ports = PortPool(cfg.base_port)
    stack = Stack(workdir, log, cfg.scrape_interval, cfg.profiles)
    log(f"real-prefix: {len(requests)} requests x {len(cfg.policies)} policies; {cfg.servers} llama-server "
        f"({cfg.slots} slots, {cfg.threads} thread) per policy; {cfg.groups} groups")
    try:
        targets = []
        for policy in cfg.policies:
            backends = []
            for i in range(cfg.servers):
                server = LlamaServer(binary, model, ports.take(), slots=cfg.slots, ctx=cfg.ctx, threads=cfg.threads)
                stack.add_stopper(server.stop)
                server.start(timeout=120)
                backends.append((f"llama-{i}", "llamacpp", server.url))
            targets.append(stack.gateway(policy, ports.take(), backends, policy))
        model_id = _first_model(targets[0].url)
        targets = [Target(t.name, t.url, model_id, pid=t.pid) for t in targets]
        log("all up; running (interleaved)")
        before = host_cpu_times()
        started = time.perf_counter()
        result = run_sync(run_interleaved(targets, requests, Arrival(concurrency=cfg.concurrency), cfg.round_size,
                                          request_timeout=300))
        elapsed = time.perf_counter() - started
        busy = host_busy_share(before, host_cpu_times())
    finally:
        stack.stop()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    config["model"] = str(model)
    bench = build_report(result, config, include_requests=cfg.include_requests)
    summary = summarize_prefix(bench)
    prompt = [s["prompt_tokens"] / s["ok"] for s in summary["policies"].values() if s["ok"] and s["prompt_tokens"]]
    return {"schema": "gateway-bench-routing/1", "benchmark": "real-prefix",
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config, "host_busy_share": busy,
            "wall_s": elapsed, "mean_prompt_tokens": sum(prompt) / len(prompt) if prompt else None, **summary,
            "bench": bench, **_phase_note(result)}


def _first_model(url: str) -> str:
    doc = get_json(url + "/v1/models")
    data = doc.get("data") if isinstance(doc, dict) else None
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


# --- command line -----------------------------------------------------------------------------------------------

def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _policies(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway bench routing", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=Path("reports/routing"), help="report directory")
    common.add_argument("--scrape-interval", type=float, default=0.5,
                        help="the gateways' scrape interval (s); each idle gateway scraping 4 emulators every 0.2 s "
                             "costs ~14%% of a core here")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--base-port", type=int, help="first loopback port to try")
    common.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    common.add_argument("--profiles", type=Path, metavar="FILE.yaml",
                        help="extra routing profiles (name: {scorers, picker, ...}) for every gateway; name them "
                             "in --policies")

    a = sub.add_parser("prefix", parents=[common], help="(a) shared prefixes on 4 emulated vLLM-like backends",
                       description="Round-robin vs least-load vs prefix vs default on a shared-prefix workload; "
                                   "each policy with its own 4 emulated vLLM-like backends and gateway.")
    d = PrefixConfig()
    a.add_argument("--policies", default=",".join(d.policies), help="the first is the reference")
    a.add_argument("--backends", type=int, default=d.backends)
    a.add_argument("--groups", type=int, default=d.groups)
    a.add_argument("--prompts-per-group", type=int, default=d.prompts_per_group)
    a.add_argument("--system-len", type=int, default=d.system_len, help="system prompt words (= emulator tokens)")
    a.add_argument("--question-len", type=int, default=d.question_len)
    a.add_argument("--output-len", type=int, default=d.output_len)
    a.add_argument("--popularity", choices=("uniform", "zipf"), default=d.popularity)
    a.add_argument("--count", type=int, help="requests per policy (default: one pass, groups x prompts)")
    a.add_argument("--cache-share", type=float, default=d.cache_share, help="of the prefix set, per backend")
    a.add_argument("--concurrency", type=int, default=d.concurrency)
    a.add_argument("--round-size", type=int, default=d.round_size)
    a.add_argument("--time-scale", type=float, default=d.time_scale)

    b = sub.add_parser("shape", parents=[common], help="(b) concurrency ramp on ExLlamaV2-like + vLLM-like",
                       description="least-load vs engine-shape, each with its own TabbyAPI-like + vLLM-like pair, "
                                   "and each engine alone, over a closed-loop concurrency ramp.")
    s = ShapeConfig()
    b.add_argument("--levels", default=",".join(map(str, s.levels)))
    b.add_argument("--policies", default=",".join(s.policies))
    b.add_argument("--no-alone", action="store_true", help="without the engines-alone references")
    b.add_argument("--rounds", type=int, default=s.rounds)
    b.add_argument("--min-round", type=int, default=s.min_round)
    b.add_argument("--input-len", type=int, default=s.input_len)
    b.add_argument("--output-len", type=int, default=s.output_len)
    b.add_argument("--time-scale", type=float, default=s.time_scale)

    c = sub.add_parser("real-prefix", parents=[common], help="(c) prefix vs round-robin on real llama-server",
                       description="prefix vs round-robin, each with its own 3 llama-server processes (generated "
                                   "'large' model) and gateway.")
    r = RealPrefixConfig()
    c.add_argument("--policies", default=",".join(r.policies))
    c.add_argument("--servers", type=int, default=r.servers)
    c.add_argument("--slots", type=int, default=r.slots)
    c.add_argument("--threads", type=int, default=r.threads)
    c.add_argument("--groups", type=int, default=r.groups)
    c.add_argument("--prompts-per-group", type=int, default=r.prompts_per_group)
    c.add_argument("--system-len", type=int, default=r.system_len)
    c.add_argument("--question-len", type=int, default=r.question_len)
    c.add_argument("--output-len", type=int, default=r.output_len)
    c.add_argument("--count", type=int)
    c.add_argument("--concurrency", type=int, default=r.concurrency)
    c.add_argument("--round-size", type=int, default=r.round_size)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out: Path = args.out
    try:
        profiles = load_profiles(args.profiles)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common: dict[str, Any] = {"out": out, "scrape_interval": args.scrape_interval, "seed": args.seed,
                              "profiles": profiles}
    if args.base_port:
        common["base_port"] = args.base_port
    name = args.bench
    if name == "prefix":
        pcfg = PrefixConfig(policies=_policies(args.policies), backends=args.backends, groups=args.groups,
                            prompts_per_group=args.prompts_per_group, system_len=args.system_len,
                            question_len=args.question_len, output_len=args.output_len,
                            popularity=args.popularity, count=args.count, cache_share=args.cache_share,
                            concurrency=args.concurrency, round_size=args.round_size, time_scale=args.time_scale,
                            include_requests=not args.no_requests, **common)
        doc = run_prefix(pcfg)
        json_path = write_json(doc, out / "prefix.json")
        png = plot_policies(doc, out / "prefix.png",
                            f"shared prefixes: {pcfg.groups} groups x ~{pcfg.system_len} tokens, "
                            f"{pcfg.backends} vLLM-like backends caching ~{pcfg.cache_share:.0%} of the set each")
        print_policies(doc, "shared prefixes on emulated vLLM-like backends")
    elif name == "shape":
        scfg = ShapeConfig(levels=_levels(args.levels), policies=_policies(args.policies), alone=not args.no_alone,
                           rounds=args.rounds, min_round=args.min_round, input_len=args.input_len,
                           output_len=args.output_len, time_scale=args.time_scale,
                           **{k: v for k, v in common.items()})
        doc = run_shape(scfg)
        json_path = write_json(doc, out / "shape.json")
        png = plot_shape(doc, out / "shape.png")
        print_shape(doc)
    else:
        rcfg = RealPrefixConfig(policies=_policies(args.policies), servers=args.servers, slots=args.slots,
                                threads=args.threads, groups=args.groups, prompts_per_group=args.prompts_per_group,
                                system_len=args.system_len, question_len=args.question_len,
                                output_len=args.output_len, count=args.count, concurrency=args.concurrency,
                                round_size=args.round_size, include_requests=not args.no_requests, **common)
        doc = run_real_prefix(rcfg)
        json_path = write_json(doc, out / "real-prefix.json")
        png = plot_policies(doc, out / "real-prefix.png",
                            f"shared prefixes on {rcfg.servers} real llama-server ({rcfg.slots} slots, "
                            f"{rcfg.threads} thread) per policy, ~{doc['mean_prompt_tokens'] or 0:.0f}-token prompts")
        print_policies(doc, "shared prefixes on real llama-server")
    print(f"wrote {json_path} and {png}")
    return 0
