"""Turn a :class:`~gateway.bench.runner.RunResult` into a report: a JSON document, a terminal table (rich)
and PNG charts (matplotlib, Agg backend; imported only when a chart is drawn).

Report JSON (``schema: "gateway-bench/1"``)::

    {"schema", "created", "config": {...as given...},
     "targets": {NAME: {"url", "requests", "ok", "errors", "error_samples": [str],
                        "wall_s", "output_tokens", "output_tok_s", "requests_per_s", "chunks_per_s",
                        "cpu_s", "cpu_ms_per_request", "cpu_us_per_chunk",       # null unless a pid is known
                        "prompt_tokens", "cached_tokens", "cache_hit_ratio",    # cached / prompt, where reported
                        "backends": {BACKEND: count},
                        "metrics": {"ttfb_s"|"ttft_s"|"itl_s"|"e2e_s"|"decode_tok_s"|"output_tokens":
                                    {"count","mean","min","p50","p90","p99","max"}}}},
     "ratios": {NAME: {"ttft_s.p50": x, ..., "added_ttft_ms.p50": d, ...}},   # vs the first target
     "requests": {NAME: [per-request records]}}          # only with include_requests
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.client import RequestResult
from gateway.bench.runner import RunResult
from gateway.bench.stats import QUANTILES, finite_or_none, ratio, summarize

SCHEMA = "gateway-bench/1"
METRICS = ("ttfb_s", "ttft_s", "itl_s", "e2e_s", "decode_tok_s", "output_tokens")


def _metric_values(results: Sequence[RequestResult], metric: str) -> list[float]:
    ok = [r for r in results if r.ok]
    if metric == "ttfb_s":
        return [r.ttfb for r in ok]
    if metric == "ttft_s":
        return [r.ttft for r in ok]
    if metric == "itl_s":
        return [gap for r in ok for gap in r.itl]
    if metric == "e2e_s":
        return [r.e2e for r in ok]
    if metric == "decode_tok_s":
        return [r.decode_tok_s for r in ok]
    if metric == "output_tokens":
        return [float(r.output_tokens) for r in ok]
    raise KeyError(metric)


def _clean(doc: Any) -> Any:
    if isinstance(doc, float):
        return finite_or_none(doc)
    if isinstance(doc, dict):
        return {k: _clean(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_clean(v) for v in doc]
    return doc


def target_summary(run: RunResult, name: str) -> dict[str, Any]:
    results = run.results[name]
    ok = [r for r in results if r.ok]
    wall = run.wall(name)
    cpu = run.cpu(name)
    chunks = sum(r.chunks for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt_reported = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    errors = [r.error for r in results if not r.ok and r.error]
    target = next(t for t in run.targets if t.name == name)
    return {
        "url": target.url,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall if wall > 0 else math.nan,
        "requests_per_s": len(ok) / wall if wall > 0 else math.nan,
        "chunks_per_s": chunks / wall if wall > 0 else math.nan,
        "cpu_s": cpu,
        "cpu_ms_per_request": 1000 * cpu / len(results) if cpu is not None and results else None,
        "cpu_us_per_chunk": 1e6 * cpu / chunks if cpu is not None and chunks else None,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_tokens": cached if reported else None,
        "cache_hit_ratio": cached / prompt_reported if reported and prompt_reported else None,
        "backends": dict(Counter(r.backend for r in ok if r.backend)),
        "metrics": {m: summarize(_metric_values(results, m)) for m in METRICS},
    }


def ratios(targets: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each target against the first: ratios of every metric's percentiles and throughput, plus the added
    TTFT and inter-chunk gap in milliseconds."""
    names = list(targets)
    if len(names) < 2:
        return {}
    ref = targets[names[0]]
    out: dict[str, dict[str, float]] = {}
    for name in names[1:]:
        cur = targets[name]
        row: dict[str, float] = {}
        for metric in ("ttft_s", "itl_s", "e2e_s", "decode_tok_s"):
            for q in QUANTILES:
                key = f"p{q}"
                row[f"{metric}.{key}"] = ratio(cur["metrics"][metric][key], ref["metrics"][metric][key])
        for metric, label in (("ttft_s", "added_ttft_ms"), ("itl_s", "added_itl_ms")):
            for q in QUANTILES:
                key = f"p{q}"
                row[f"{label}.{key}"] = 1000 * (cur["metrics"][metric][key] - ref["metrics"][metric][key])
            row[f"{label}.mean"] = 1000 * (cur["metrics"][metric]["mean"] - ref["metrics"][metric]["mean"])
        for key in ("output_tok_s", "requests_per_s", "chunks_per_s"):
            row[key] = ratio(cur[key], ref[key])
        out[name] = row
    return out


def build_report(run: RunResult, config: dict[str, Any], include_requests: bool = True) -> dict[str, Any]:
    targets = {t.name: target_summary(run, t.name) for t in run.targets}
    doc: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config,
                           "targets": targets, "ratios": ratios(targets)}
    if include_requests:
        doc["requests"] = {name: [r.to_json() for r in rs] for name, rs in run.results.items()}
    return _clean(doc)  # type: ignore[no-any-return]


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    return path


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * scale:,.{digits}f}"


def print_table(doc: dict[str, Any]) -> None:
    """p50/p90/p99 per target (and ratios against the first) on the terminal."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="per request (ms unless stated)")
    table.add_column("target")
    table.add_column("ok/all", justify="right")
    for label, qs in (("TTFT", QUANTILES), ("ITL", (50, 99)), ("E2E", (50, 99))):
        for q in qs:
            table.add_column(f"{label} p{q}", justify="right")
    table.add_column("decode tok/s p50", justify="right")
    table.add_column("out tok/s", justify="right")
    table.add_column("cached", justify="right")
    for name, t in doc["targets"].items():
        m = t["metrics"]
        cells = [name, f"{t['ok']}/{t['requests']}"]
        for metric, qs in (("ttft_s", QUANTILES), ("itl_s", (50, 99)), ("e2e_s", (50, 99))):
            cells += [_fmt(m[metric][f"p{q}"], 1000, 2 if metric == "itl_s" else 1) for q in qs]
        cells += [_fmt(m["decode_tok_s"]["p50"]), _fmt(t["output_tok_s"]),
                  _fmt(t["cache_hit_ratio"], 100, 0) + ("%" if t["cache_hit_ratio"] is not None else "")]
        table.add_row(*cells)
    console.print(table)
    for name, t in doc["targets"].items():
        if t["backends"]:
            console.print(f"{name} served by: " + ", ".join(f"{b} {n}" for b, n in sorted(t["backends"].items())))
    if doc["ratios"]:
        first = next(iter(doc["targets"]))
        rt = Table(title=f"against {first}")
        rt.add_column("target")
        for col in ("TTFT p50 x", "TTFT p99 x", "added TTFT p50 ms", "added TTFT p99 ms", "added ITL mean ms",
                    "E2E p50 x", "out tok/s x"):
            rt.add_column(col, justify="right")
        for name, r in doc["ratios"].items():
            rt.add_row(name, _fmt(r["ttft_s.p50"], digits=2), _fmt(r["ttft_s.p99"], digits=2),
                       _fmt(r["added_ttft_ms.p50"], digits=2), _fmt(r["added_ttft_ms.p99"], digits=2),
                       _fmt(r["added_itl_ms.mean"], digits=3), _fmt(r["e2e_s.p50"], digits=2),
                       _fmt(r["output_tok_s"], digits=2))
        console.print(rt)
    for name, t in doc["targets"].items():
        if t["error_samples"]:
            console.print(f"[red]{name}: {t['errors']} failed[/red]; e.g. {t['error_samples'][0]}")


def plot_run(run: RunResult, path: Path, title: str = "") -> Path:
    """Four panels: TTFT CDF, inter-chunk gap CDF, end-to-end CDF, per-request decode speed per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("ttft_s", "time to first token (ms)", 1000.0), ("itl_s", "inter-chunk gap (ms)", 1000.0),
              ("e2e_s", "end to end (ms)", 1000.0)]
    for ax, (metric, label, scale) in zip(axes.flat, panels, strict=False):
        for name, results in run.results.items():
            values = sorted(v * scale for v in _metric_values(results, metric) if math.isfinite(v))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if metric != "itl_s" else "fraction of gaps")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes.flat[3]
    names = list(run.results)
    data = [[v for v in _metric_values(run.results[n], "decode_tok_s") if math.isfinite(v)] or [0.0] for n in names]
    ax.boxplot(data)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("per-request decode tok/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title or "gateway bench")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
