"""``gateway profile``: each backend's speed curve over concurrency, for the engine-shape routing policy.

For every backend (``--backend NAME=URL`` repeated, or the backends of a gateway configuration file) and every
concurrency level (1, 2, 4, ..., 64 by default) a closed loop of ``level`` users sends ``level * requests_per_user``
requests (random prompt of ``input_len`` words, ``output_len`` tokens with ``ignore_eos``) and measures, at the
client: per-user decode speed (median over requests of ``(output_tokens - 1) / (e2e - ttft)``), aggregate output
tokens/s (all output tokens / the level's wall time), TTFT p50 and a prefill-speed estimate
(median prompt tokens / median TTFT; it includes queueing, so it is a lower bound).

``--time-scale S`` is for emulators run with ``--time-scale S`` (S times faster than the engine they emulate):
speeds are divided by S and times multiplied by S, so the profile is in the real engine's units.

Profile file (JSON, ``schema: "gateway-engine-profile/1"``)::

    {
      "schema": "gateway-engine-profile/1",
      "created": "2026-11-29T12:00:00+0000",
      "settings": {"levels": [1, 2, ...], "input_len": 256, "output_len": 64, "requests_per_user": 2,
                   "time_scale": 1.0},
      "backends": {
        "<backend name>": {
          "engine": "vllm",                   # from the gateway config or --engine; "unknown" otherwise
          "url": "http://...",
          "model": "...",
          "levels": [
            {"concurrency": 1,
             "per_user_decode_tok_s": 175.2,  # median single-stream decode speed at this level
             "aggregate_tok_s": 160.3,        # output tokens/s over all users
             "ttft_p50_s": 0.031,
             "ttft_p90_s": 0.035,
             "prefill_tok_s": 8400.0,         # estimate; null when unknown
             "requests": 2, "errors": 0,
             "host_cpu_busy": 0.41,           # share of this machine's CPUs busy during the level (Linux)
             "host_saturated": false},        # busy >= 0.9: the load generator's machine was the limit
                                              # (never set for an engine computing on this machine itself)
            ...
          ]
        }
      }
    }

Levels are sorted by concurrency. A consumer interpolates between levels (log2 of concurrency), holds the
last level's figures beyond it, and should distrust levels marked ``host_saturated`` (when the emulators and
the load generator share a small machine, fast emulated engines saturate its CPUs before the engine does).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import RequestResult, Target, parse_target
from gateway.bench.report import write_json
from gateway.bench.runner import Arrival, host_busy_share, host_cpu_times, run, run_sync
from gateway.bench.stats import finite_or_none, percentile
from gateway.bench.workload import WorkloadConfig, build_workload

SCHEMA = "gateway-engine-profile/1"
SATURATED = 0.9  # host CPU busy share from which a level measures the machine, not the engine


@dataclass
class ProfileSettings:
    levels: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    input_len: int = 256
    output_len: int = 64
    requests_per_user: int = 2
    time_scale: float = 1.0
    seed: int = 0


def default_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_concurrency`` (added when not a power of two)."""
    out = []
    c = 1
    while c <= max_concurrency:
        out.append(c)
        c *= 2
    if out[-1] != max_concurrency:
        out.append(max_concurrency)
    return out


def level_figures(results: list[RequestResult], wall: float, concurrency: int, time_scale: float = 1.0
                  ) -> dict[str, Any]:
    """One level's entry of the profile file (see the module docstring)."""
    ok = [r for r in results if r.ok]
    decode = [r.decode_tok_s for r in ok if math.isfinite(r.decode_tok_s)]
    ttft = [r.ttft for r in ok if math.isfinite(r.ttft)]
    prompt = [float(r.prompt_tokens) for r in ok if r.prompt_tokens]
    tokens = sum(r.output_tokens for r in ok)
    ttft_p50 = percentile(ttft, 50)
    prefill = percentile(prompt, 50) / ttft_p50 if prompt and ttft and ttft_p50 > 0 else math.nan
    return {
        "concurrency": concurrency,
        "per_user_decode_tok_s": finite_or_none(percentile(decode, 50) / time_scale),
        "aggregate_tok_s": finite_or_none(tokens / wall / time_scale) if wall > 0 else None,
        "ttft_p50_s": finite_or_none(ttft_p50 * time_scale),
        "ttft_p90_s": finite_or_none(percentile(ttft, 90) * time_scale),
        "prefill_tok_s": finite_or_none(prefill / time_scale),
        "requests": len(results),
        "errors": len(results) - len(ok),
    }


async def profile_backend(target: Target, settings: ProfileSettings, log: Any = print,
                          saturated_at: float | None = SATURATED) -> list[dict[str, Any]]:
    """One backend's levels. ``saturated_at``: the host CPU busy share from which a level is marked
    ``host_saturated``; None for an engine that computes on this machine's CPUs itself (a real llama-server
    here), whose busy CPUs are the engine at work, not a floor set by the load generator."""
    levels = []
    for c in sorted(settings.levels):
        count = c * settings.requests_per_user
        wl = WorkloadConfig(kind="random", count=count, seed=settings.seed + c, input_min=settings.input_len,
                            input_max=settings.input_len, output_min=settings.output_len,
                            output_max=settings.output_len, ignore_eos=True)
        before = host_cpu_times()
        result = await run([target], build_workload(wl), Arrival(concurrency=c), request_timeout=600)
        fig = level_figures(result.results[target.name], result.wall(target.name), c, settings.time_scale)
        fig["host_cpu_busy"] = host_busy_share(before, host_cpu_times())
        busy = fig["host_cpu_busy"]
        fig["host_saturated"] = saturated_at is not None and busy is not None and busy >= saturated_at
        levels.append(fig)
        log(f"  {target.name:<16} c={c:<3} per-user {fig['per_user_decode_tok_s'] or 0:8.1f} tok/s  aggregate "
            f"{fig['aggregate_tok_s'] or 0:9.1f} tok/s  TTFT p50 {1000 * (fig['ttft_p50_s'] or 0):8.1f} ms"
            + (f"  errors {fig['errors']}" if fig["errors"] else "")
            + ("  (this machine's CPUs were saturated: a floor, not the engine's figure)"
               if fig["host_saturated"] else ""))
    return levels


def targets_from_config(path: Path) -> list[tuple[Target, str]]:
    from gateway.config import load_settings

    settings = load_settings(path)
    found: list[tuple[Target, str]] = []
    for b in settings.backends:
        if b.url is None:
            raise SystemExit(f"profile: backend {b.name} is found by DNS ({b.dns}); name its replicas with --backend")
        found.append((Target(b.name, b.url, b.models[0] if b.models else None, b.resolved_api_key()), b.engine))
    return found


def build_profile(settings: ProfileSettings, backends: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "settings": {"levels": sorted(settings.levels), "input_len": settings.input_len,
                         "output_len": settings.output_len, "requests_per_user": settings.requests_per_user,
                         "time_scale": settings.time_scale},
            "backends": backends}


def profile_fleet(pairs: list[tuple[Target, str]], settings: ProfileSettings, log: Any = print,
                  saturated_at: float | None = SATURATED) -> dict[str, Any]:
    """Profile each (target, engine) in turn; the profile file's document, keyed by target name."""
    backends: dict[str, dict[str, Any]] = {}
    for target, engine in pairs:
        log(f"profiling {target.name} ({engine}) at {target.base}")
        curve = run_sync(profile_backend(target, settings, log, saturated_at))
        backends[target.name] = {"engine": engine, "url": target.url, "model": target.model, "levels": curve}
    return build_profile(settings, backends)


def plot_profile(doc: dict[str, Any], path: Path) -> Path:
    """The seed's two-by-two as curves: per-user decode speed, aggregate throughput, TTFT, prefill estimate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("per_user_decode_tok_s", "per-user decode tok/s", 1.0, "log"),
              ("aggregate_tok_s", "aggregate output tok/s", 1.0, "log"),
              ("ttft_p50_s", "TTFT p50 (ms)", 1000.0, "log"),
              ("prefill_tok_s", "prefill tok/s (estimate)", 1.0, "log")]
    levels = doc["settings"]["levels"]
    for ax, (key, label, scale, yscale) in zip(axes.flat, panels, strict=True):
        for name, b in doc["backends"].items():
            pts = [(lv["concurrency"], lv[key] * scale, lv.get("host_saturated")) for lv in b["levels"] if lv.get(key)]
            if pts:
                line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} ({b['engine']})")
                sat = [p for p in pts if p[2]]
                if sat:  # machine-bound points: hollow
                    ax.plot([p[0] for p in sat], [p[1] for p in sat], "o", markersize=10, markerfacecolor="white",
                            color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_yscale(yscale)
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    sat_note = "; hollow: this machine's CPUs saturated" if any(
        lv.get("host_saturated") for b in doc["backends"].values() for lv in b["levels"]) else ""
    scale_note = f", time scale {doc['settings']['time_scale']:g} undone" if doc["settings"]["time_scale"] != 1 else ""
    s = doc["settings"]
    fig.suptitle(f"engine profiles ({s['input_len']} in / {s['output_len']} out{scale_note}{sat_note})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway profile",
                                description="Measure each backend's decode speed, throughput and TTFT over "
                                            "concurrency; write a profile file and a chart.")
    p.add_argument("--backend", action="append", default=[], metavar="NAME=URL", help="repeatable")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=ENGINE", help="engine of a --backend")
    p.add_argument("--config", type=Path, help="profile the backends of this gateway configuration file")
    p.add_argument("--model", help="model to request (default: the first each backend lists)")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--levels", help="explicit comma-separated levels (overrides --max-concurrency)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--time-scale", type=float, default=1.0, help="emulators' --time-scale, undone in the figures")
    p.add_argument("--out", type=Path, default=Path("reports/profile.json"), help="profile file (chart: .png)")
    a = p.parse_args(argv)
    pairs: list[tuple[Target, str]] = []
    if a.config:
        pairs += targets_from_config(a.config)
    engines = dict(e.split("=", 1) for e in a.engine)
    for spec in a.backend:
        t = parse_target(spec)
        pairs.append((t, engines.get(t.name, "unknown")))
    if not pairs:
        p.error("give --backend NAME=URL (repeatable) or --config FILE")
    if a.model:
        pairs = [(Target(t.name, t.url, a.model, t.api_key), e) for t, e in pairs]
    levels = [int(x) for x in a.levels.split(",")] if a.levels else default_levels(a.max_concurrency)
    settings = ProfileSettings(levels=levels, input_len=a.input_len, output_len=a.output_len,
                               requests_per_user=a.requests_per_user, time_scale=a.time_scale)
    doc = profile_fleet(pairs, settings)
    write_json(doc, a.out)
    chart = plot_profile(doc, a.out.with_suffix(".png"))
    print(f"wrote {a.out} and {chart}")
    return 0

