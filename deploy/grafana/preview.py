#!/usr/bin/env python3
"""Render a Grafana dashboard's panels from a Prometheus into one PNG, to review the dashboard without Grafana.

    python deploy/grafana/preview.py --prometheus http://127.0.0.1:9090 \\
        --dashboard deploy/grafana/dashboards/gateway.json --since 30m --out reports/dashboard-preview.png

Every panel's queries run as ``/api/v1/query_range`` over the range, with the template variables substituted
(``$backend``/``$model`` default to ``.*``, ``$__rate_interval`` to ``--rate-interval``); each panel becomes one
line chart in a grid, rows of the dashboard in order. Standard library plus matplotlib (Agg) only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    row: str
    title: str
    kind: str
    unit: str
    targets: tuple[Target, ...]


@dataclass
class Series:
    name: str
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def panels(dashboard: Mapping[str, Any]) -> list[Panel]:
    """The dashboard's query panels in order, with the row each sits in (collapsed rows' panels too)."""
    found: list[Panel] = []
    row = ""

    def add(raw: Mapping[str, Any]) -> None:
        targets = tuple(Target(t["expr"], t.get("legendFormat", "")) for t in raw.get("targets", ())
                        if t.get("expr") and not t.get("hide"))
        unit = raw.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        found.append(Panel(row, raw.get("title", ""), raw.get("type", ""), unit, targets))

    for raw in dashboard.get("panels", ()):
        if raw.get("type") == "row":
            row = raw.get("title", "")
            for inner in raw.get("panels", ()):
                add(inner)
        else:
            add(raw)
    return found


def variable_defaults(dashboard: Mapping[str, Any]) -> dict[str, str]:
    """What each template variable stands for when "All" is selected: its allValue (``.*``) or its query."""
    values: dict[str, str] = {}
    for var in dashboard.get("templating", {}).get("list", ()):
        if var.get("type") == "datasource":
            values[var["name"]] = str(var.get("current", {}).get("value", ""))
        else:
            values[var["name"]] = var.get("allValue") or ".*"
    return values


def substitute(expr: str, variables: Mapping[str, str], rate_interval: str) -> str:
    """Grafana's variable substitution, for the forms the dashboard uses: ``$name`` and ``${name}``."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}", rate_interval)

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"unknown dashboard variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def legend(fmt: str, labels: Mapping[str, str]) -> str:
    if not fmt or fmt == "__auto":
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{{{inner}}}" if inner else "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()


def api(prometheus: str, path: str, params: Mapping[str, str], timeout: float = 10.0) -> Any:
    """GET ``path`` of the Prometheus HTTP API; the ``data`` of its answer."""
    url = prometheus.rstrip("/") + path + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{path} {dict(params)}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query_range(prometheus: str, expr: str, start: float, end: float, step: float,
                legend_format: str = "") -> list[Series]:
    data = api(prometheus, "/api/v1/query_range",
               {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"})
    out = []
    for result in data["result"]:
        series = Series(legend(legend_format, result["metric"]))
        for t, v in result["values"]:
            series.times.append(float(t))
            series.values.append(float(v))
        out.append(series)
    return out


def collect(prometheus: str, dashboard: Mapping[str, Any], start: float, end: float, step: float,
            rate_interval: str) -> list[tuple[Panel, list[Series]]]:
    variables = variable_defaults(dashboard)
    return [(panel, [s for t in panel.targets
                     for s in query_range(prometheus, substitute(t.expr, variables, rate_interval), start, end,
                                          step, t.legend)])
            for panel in panels(dashboard)]


def render(results: Sequence[tuple[Panel, Sequence[Series]]], out: Path, title: str = "", columns: int = 3,
           max_legend: int = 8) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(results) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 3.4 * rows), squeeze=False)
    t0 = min((s.times[0] for _, series in results for s in series if s.times), default=0.0)
    for i, (panel, series) in enumerate(results):
        ax = axes[i // columns][i % columns]
        ax.set_title(f"{panel.row} / {panel.title}" + (" (stat)" if panel.kind == "stat" else ""), fontsize=9)
        plotted = 0
        for s in sorted(series, key=lambda s: s.name):
            finite = [(t - t0, v) for t, v in zip(s.times, s.values, strict=True) if math.isfinite(v)]
            if not finite:
                continue
            xs, ys = zip(*finite, strict=True)
            name = f"({s.name})" if s.name.startswith("_") else s.name  # matplotlib hides labels starting "_"
            ax.plot(xs, ys, linewidth=1.2, marker="." if len(xs) < 4 else None,
                    label=name if plotted < max_legend else None)
            plotted += 1
        if plotted == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="red")
        else:
            ax.legend(fontsize=6, loc="upper left", framealpha=0.6,
                      title=f"+{plotted - max_legend} more" if plotted > max_legend else None, title_fontsize=6)
        ax.set_ylabel(panel.unit, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if panel.unit == "percentunit":
            ax.set_ylim(bottom=0)
    for j in range(len(results), rows * columns):
        axes[j // columns][j % columns].axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=7)
    height = 3.4 * rows
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / height) if title else None)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not match:
        raise argparse.ArgumentTypeError(f"a duration like 30s, 15m or 1h, not {text!r}")
    return float(match.group(1)) * units[match.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--dashboard", type=Path, default=Path(__file__).parent / "dashboards" / "gateway.json")
    parser.add_argument("--since", type=_duration, default=_duration("30m"), help="range ending now")
    parser.add_argument("--step", type=_duration, default=None, help="default: range / 120")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--out", type=Path, default=Path("reports/dashboard-preview.png"))
    args = parser.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    end = time.time()
    start = end - args.since
    step = args.step or max(1.0, args.since / 120)
    results = collect(args.prometheus, dashboard, start, end, step, args.rate_interval)
    render(results, args.out, title=f"{dashboard.get('title', '')} - {args.prometheus}")
    empty = [p.title for p, series in results if not series]
    print(f"{args.out}: {len(results)} panels" + (f"; no data: {', '.join(empty)}" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
