"""What the routing benchmarks share: ports, generated configurations, the process stack of one policy,
interleaved runs, and the figures and verdicts computed from a run."""

from __future__ import annotations

import math
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.client import Target
from gateway.bench.procs import ChildProcess, get_json
from gateway.bench.runner import (
    Arrival,
    RunResult,
    interleave_order,
    run,
    split_rounds,
)
from gateway.bench.workload import BenchRequest

SIM_MODEL = "sim-llama-2-7b"
HOST = "127.0.0.1"
# tokens the emulators' chat template and the workload's "You are assistant N." header add to a system prompt
SYSTEM_OVERHEAD_TOKENS = 16
PREFIX_POLICIES = ("round-robin", "least-load", "prefix", "default")
SHAPE_POLICIES = ("least-load", "engine-shape")
REAL_POLICIES = ("round-robin", "prefix", "default")

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
                   profiles: dict[str, Any] | None = None, engine_profile: Path | None = None,
                   backend_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``python -m gateway serve --config`` document: ``backends`` are (name, engine, url); ``profiles``
    (``routing.profiles``: your own policies, or built-in ones with other plugin parameters),
    ``engine_profile`` (``routing.engine_profile``: a ``gateway profile`` file) and ``backend_options`` (more
    settings of every backend, e.g. how its servers were started) when given."""
    entries: list[dict[str, Any]] = []
    for name, engine, url in backends:
        entry: dict[str, Any] = {"name": name, "engine": engine, "url": url, **(backend_options or {})}
        if models:
            entry["models"] = list(models)
        entries.append(entry)
    routing: dict[str, Any] = {"policy": policy}
    if profiles:
        routing["profiles"] = dict(profiles)
    if engine_profile is not None:
        routing["engine_profile"] = str(engine_profile.resolve())
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
        self.add(proc)
        urls = [f"http://{HOST}:{s['port']}" for s in servers]
        for url in urls:
            proc.wait_http(url + "/health", timeout=60)
        return urls

    def gateway(self, name: str, port: int, backends: Sequence[tuple[str, str, str]], policy: str,
                models: Sequence[str] | None = None, engine_profile: Path | None = None,
                backend_options: dict[str, Any] | None = None) -> Target:
        doc = gateway_config(port, backends, policy, self.scrape_interval, models, self.profiles, engine_profile,
                             backend_options)
        return self.gateway_from_doc(name, port, doc, len(backends))

    def gateway_from_doc(self, name: str, port: int, doc: dict[str, Any], backends: int) -> Target:
        """A gateway on ``port`` with the configuration ``doc``, once it sees its ``backends`` ready."""
        path = dump_yaml(doc, self.workdir / f"gateway-{name}.yaml")
        proc = ChildProcess(f"gateway {name}", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                                "--log-level", "warning"], self.workdir / f"gateway-{name}.log")
        self.add(proc)
        url = f"http://{HOST}:{port}"
        wait_gateway(url, backends, proc)
        return Target(name, url, pid=proc.pid)

    def add(self, proc: ChildProcess) -> None:
        """Start ``proc``; :meth:`stop` ends it."""
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


def fmt(v: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if v is None or not math.isfinite(v) else f"{v:,.{digits}f}{suffix}"


def print_targets(console: Any, targets: Sequence[dict[str, Any]]) -> None:
    for t in targets:
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        extra = f" (misses by {t['miss_by']:.2f}x)" if t.get("miss_by") else ""
        console.print(f"target {t['what']}: {fmt(t['value'], 2)}x against {t['goal']}x: {mark}{extra}")


def rich_console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def phase_note(result: RunResult) -> dict[str, Any]:
    return {"phases": [asdict(p) for p in result.phases]}


# --- (a) prefix -------------------------------------------------------------------------------------------------
