"""The overhead benchmark's report: its chart (PNG) and its tables on the console, from the document that
:func:`gateway.bench.overhead.run_overhead` writes (one run's, or the median of several)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any


def plot_overhead(doc: dict[str, Any], path: Path) -> Path:
    """Every figure of a run (or of the summary: the medians): added TTFT p50/p99 and the gateway's ratio to the
    Rust router's per level, added gaps, chunks/s and CPU per chunk per level; the cost phase's CPU per request and
    per chunk with the targets; chunks/s and proxy CPU at saturation; the held streams; the targets."""
    import matplotlib

    from gateway.bench.overhead import (  # (the issue's targets, drawn as lines; imported here: no cycle)
        CHUNKS_PER_S_TARGET,
        CPU_US_PER_CHUNK_TARGET,
        CPU_US_PER_REQUEST_TARGET,
        TTFT_X_TARGETS,
    )

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 4, figsize=(22, 13))
    ax_iter = iter(axes.flat)
    levels_doc = doc.get("levels") or {}
    levels = sorted(int(k) for k in levels_doc)
    names = list(dict.fromkeys(n for rows in levels_doc.values() for n in rows))
    sat = (doc.get("saturation") or {}).get("levels") or {}
    cost = (doc.get("cost") or {}).get("targets") or {}
    every = dict.fromkeys([*names, *(n for rows in sat.values() for n in rows), *cost, *(doc.get("hold") or {})])
    color = {name: f"C{i % 10}" for i, name in enumerate(every)}

    def per_level(ax: Any, keys: list[tuple[str, str]], label: str, skip_direct: bool = True) -> None:
        for name in names:
            if skip_direct and name == "direct":
                continue
            for key, style in keys:
                ys = [(levels_doc[str(lv)].get(name) or {}).get(key) for lv in levels]
                pts = [(lv, y) for lv, y in zip(levels, ys, strict=True) if y is not None and math.isfinite(y)]
                if pts:
                    suffix = f" ({key.rsplit('_', 1)[-1]})" if len(keys) > 1 else ""
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name + suffix,
                            color=color[name])
        _level_axis(ax, levels, label)

    per_level(next(ax_iter), [("added_ttft_ms_p50", "-")], "added TTFT p50 (ms)")
    per_level(next(ax_iter), [("added_ttft_ms_p99", "-")], "added TTFT p99 (ms)")
    ax = next(ax_iter)
    vs = doc.get("vs_reference") or {}
    ratio_levels = vs.get("levels") or {}
    for name in dict.fromkeys(n for rows in ratio_levels.values() for n in rows):
        pts = [(int(lv), rows[name]["added_ttft_p50_x"]) for lv, rows in ratio_levels.items()
               if name in rows and rows[name].get("added_ttft_p50_x") is not None]
        if pts:
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=color.get(name))
    tl = [(lv, x) for lv, x in TTFT_X_TARGETS.items() if lv in levels]
    if tl:
        ax.plot([p[0] for p in tl], [p[1] for p in tl], "k--", marker="_", label="target")
    _level_axis(ax, levels, f"added TTFT p50 / {vs.get('reference') or 'reference'}'s (x)")
    per_level(next(ax_iter), [("added_itl_ms_mean", "-"), ("added_itl_ms_p50", ":"), ("added_itl_ms_p99", "--")],
              "added inter-chunk gap (ms)")
    per_level(next(ax_iter), [("chunks_per_s", "-")], "streamed chunks/s", skip_direct=False)
    per_level(next(ax_iter), [("cpu_us_per_chunk", "-")], "CPU / chunks (us, incl. per-request)")
    for key, label, target in (("cpu_us_per_request", "CPU per request, excl. chunks (us)", CPU_US_PER_REQUEST_TARGET),
                               ("cpu_us_per_chunk", "CPU per chunk (us)", CPU_US_PER_CHUNK_TARGET)):
        ax = next(ax_iter)
        tnames = [n for n, v in cost.items() if v.get(key) is not None]
        if tnames:
            errs = [cost[n].get(f"{key}_error") or 0.0 for n in tnames]
            ax.bar(tnames, [cost[n][key] for n in tnames], yerr=errs, capsize=4, color=[color[n] for n in tnames])
            ax.axhline(target, color="r", linestyle="--", label=f"target {target:g} us")
            ax.legend()
        cc = (doc.get("cost") or {}).get("config") or {}
        ax.set_title(f"cost phase: {cc.get('prompt_chars', '?')}-char prompts, max_tokens {cc.get('max_tokens')}, "
                     f"{cc.get('concurrency')} streams", fontsize=9)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    sat_levels = sorted(int(k) for k in sat)
    sat_names = list(dict.fromkeys(n for rows in sat.values() for n in rows))
    for key, label, line in (("chunks_per_s", "chunks/s at saturation (client)", CHUNKS_PER_S_TARGET),
                             ("proxy_cores", "proxy CPU at saturation (cores)", 1.0)):
        ax = next(ax_iter)
        for name in sat_names:
            pts = [(lv, (sat[str(lv)].get(name) or {}).get(key)) for lv in sat_levels]
            pts = [p for p in pts if p[1] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, color=color[name])
        if sat_levels:
            ax.axhline(line, color="r", linestyle="--", label="target" if key == "chunks_per_s" else "one core")
        _level_axis(ax, sat_levels, label)
    ax = next(ax_iter)
    hold = doc.get("hold") or {}
    if hold:
        hn = list(hold)
        ax.bar(hn, [hold[n].get("complete") or 0 for n in hn], color="tab:green", label="complete")
        ax.bar(hn, [(hold[n].get("streams") or 0) - (hold[n].get("complete") or 0) for n in hn],
               bottom=[hold[n].get("complete") or 0 for n in hn], color="tab:red", label="failed")
        ax.legend()
    ax.set_ylabel(f"held streams ({(doc.get('config') or {}).get('hold')} at once)")
    ax.grid(alpha=0.3, axis="y")
    ax = next(ax_iter)
    ax.axis("off")
    lines = ["issue targets (gateway)" + (f", {doc['summary']}" if doc.get("summary") else "")]
    for key, t in (doc.get("targets") or {}).items():
        met = {True: "met", False: "MISSED", None: "-"}[t.get("met")]
        lines.append(f"{key}: {_fmt_value(t.get('value'))} {t.get('op')} {t.get('target'):,g} {t.get('unit')}: {met}")
    tr = doc.get("translation")
    if tr:
        lines += ["", f"agent-API translation at {tr.get('concurrency')} streams, added TTFT p50:",
                  f"  native chat {_fmt_value(tr.get('native_added_ttft_ms_p50'))} ms, translated /v1/messages "
                  f"{_fmt_value(tr.get('translated_added_ttft_ms_p50'))} ms",
                  f"  translation adds {_fmt_value(tr.get('translation_ms_p50'))} ms "
                  f"({_fmt_value(tr.get('translated_over_native_x'))}x)"]
    ax.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=9)
    for rest in ax_iter:
        rest.axis("off")
    cfg = doc.get("config") or {}
    fig.suptitle(f"proxy overhead: {cfg.get('tokens')} tokens {cfg.get('gap_ms')} ms apart, raw asyncio backend"
                 + (f"; {doc['summary']}" if doc.get("summary") else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def _level_axis(ax: Any, levels: list[int], label: str) -> None:
    if levels:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def print_overhead(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    of = f" ({doc['summary']})" if doc.get("summary") else ""
    table = Table(title=f"added by each proxy, against the backend directly (ms; CPU from /proc){of}")
    for col in ("streams", "target", "ok", "TTFT p50", "TTFT p99", "added TTFT p50", "added TTFT p99",
                "x ref p50", "added gap p50", "added gap p99", "added gap mean", "chunks/s", "CPU ms/req",
                "CPU us/chunk"):
        table.add_column(col, justify="right")

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:,.{d}f}"

    ratios = (doc.get("vs_reference") or {}).get("levels") or {}
    for level, rows in doc["levels"].items():
        for name, r in rows.items():
            x = ((ratios.get(level) or {}).get(name) or {}).get("added_ttft_p50_x")
            table.add_row(level, name, f"{f(r['ok'], 0)}/{f(r['requests'], 0)}", f(r["ttft_ms_p50"]),
                          f(r["ttft_ms_p99"]), f(r.get("added_ttft_ms_p50")), f(r.get("added_ttft_ms_p99")), f(x),
                          f(r.get("added_itl_ms_p50"), 3), f(r.get("added_itl_ms_p99"), 3),
                          f(r.get("added_itl_ms_mean"), 3), f(r["chunks_per_s"], 0),
                          f(r["cpu_ms_per_request"] if name != "direct" else None, 3),
                          f(r["cpu_us_per_chunk"] if name != "direct" else None, 1))
    console.print(table)
    cost = doc.get("cost")
    if cost:
        cc = cost["config"]
        t = Table(title=f"cost phase: cpu = requests x R + chunks x C, solved from two runs (max_tokens "
                        f"{cc['max_tokens'][0]} and {cc['max_tokens'][1]}; {cc['prompt_chars']}-character prompts, "
                        f"{cc['concurrency']} streams; /proc ticks of {1000 * cc['tick_s']:g} ms){of}")
        for col in ("target", "R us/request", "+-", "C us/chunk", "+-", "1e6/C chunks/s",
                    *(f"max_tokens {k}: req, chunks, CPU s" for k in cc["max_tokens"])):
            t.add_column(col, justify="right")
        for name, c in cost["targets"].items():
            runs = [c["runs"].get(f"max_tokens_{k}") or {} for k in cc["max_tokens"]]
            t.add_row(name, f(c["cpu_us_per_request"], 0), f(c["cpu_us_per_request_error"], 0),
                      f(c["cpu_us_per_chunk"], 1), f(c["cpu_us_per_chunk_error"], 1),
                      f(c["capacity_chunks_per_s"], 0),
                      *(f"{f(r.get('requests'), 0)}, {f(r.get('chunks'), 0)}, {f(r.get('cpu_s'), 2)}" for r in runs))
        console.print(t)
    sat = doc.get("saturation")
    if sat:
        sc = sat["config"]
        t = Table(title=f"saturation: {sc['max_tokens']} chunks {sc['gap_ms']} ms apart; CPU in cores from /proc "
                        f"({sc['cores']} cores in all){of}")
        for col in ("streams", "target", "ok", "chunks/s", "proxy cores", "backend cores", "client cores",
                    "machine busy", "limit"):
            t.add_column(col, justify="right")
        for level, rows in sat["levels"].items():
            for name, r in rows.items():
                t.add_row(level, name, f"{f(r['ok'], 0)}/{f(r['requests'], 0)}", f(r["chunks_per_s"], 0),
                          f(r["proxy_cores"]), f(r["backend_cores"]), f(r["client_cores"]),
                          f(None if r["host_busy"] is None else 100 * r["host_busy"], 0) + "%", str(r["limit"]))
        console.print(t)
        for name, s in (sat.get("targets") or {}).items():
            console.print(f"saturation {name}: at most {f(s['max_chunks_per_s'], 0)} chunks/s (at {s['at_level']} "
                          f"streams, {f(s['proxy_cores'])} cores, limit {s['limit']}"
                          f"{', saturated' if s['saturated'] else ''}); 1e6/C: {f(s['capacity_chunks_per_s'], 0)}")
    if "hold" in doc:
        for name, h in doc["hold"].items():
            console.print(f"hold {name}: {f(h['complete'], 0)}/{f(h['streams'], 0)} complete, backend peak open "
                          f"{f(h['backend_peak_open'], 0)}" + (f"; e.g. {h['error_samples'][0]}"
                                                               if h.get("error_samples") else ""))
    tr = doc.get("translation")
    if tr:
        console.print(f"translation at {tr['concurrency']} streams: the gateway's added TTFT p50 "
                      f"{f(tr['native_added_ttft_ms_p50'])} ms for chat, "
                      f"{f(tr['translated_added_ttft_ms_p50'])} ms for a translated /v1/messages stream: "
                      f"translation adds {f(tr['translation_ms_p50'])} ms "
                      f"({f(tr['translated_over_native_x'])}x); p99 {f(tr['native_added_ttft_ms_p99'])} / "
                      f"{f(tr['translated_added_ttft_ms_p99'])} ms")
    if "tracing" in doc:
        print_tracing(console, doc["tracing"])
    for part, what in (("state", "shared state"), ("state_limited", "shared state with a requests/min key"),
                       ("state_tokens", "shared state with a tokens/min key")):
        against = doc.get(part, {}).get("against", "the plain gateway")
        for level, r in doc.get(part, {}).get("levels", {}).items():
            paired = r.get("ttft_us_p50_paired") or {}
            console.print(f"{what} at {level} streams adds (over {against}): TTFT p50 {f(r['ttft_us_p50'], 0)} us "
                          f"(round by round {f(paired.get('median'), 0)} us, 90% {f(paired.get('low'), 0)} to "
                          f"{f(paired.get('high'), 0)}), p99 {f(r['ttft_us_p99'], 0)} us, end to end p50 "
                          f"{f(r['e2e_us_p50'], 0)} us, CPU {f(r['cpu_us_per_request'], 0)} us per request")
        counts = doc.get(part, {}).get("admissions")
        if counts:
            total = sum(counts.values())
            refills = doc[part].get("lease_refills")
            console.print(f"{what}, admissions over the run: " + ", ".join(f"{k} {v}" for k, v in counts.items())
                          + (f" ({counts.get('redis', 0) / total:.1%} with a round trip)" if total else "")
                          + (f"; lease top-ups in the background {refills}" if refills else ""))
    for part, r in (doc.get("state_pairs") or {}).items():
        paired = r.get("ttft_us_p50_paired") or {}
        console.print(f"{part}, the pair alone ({r.get('rounds')} rounds at {r.get('level')} streams): {r.get('on')} "
                      f"over {r.get('off')}: TTFT p50 {f(paired.get('median'), 0)} us (90% {f(paired.get('low'), 0)} "
                      f"to {f(paired.get('high'), 0)})")
    if "workers" in doc:
        w = doc["workers"]
        for level, r in w["levels"].items():
            console.print(f"{w['count']} workers at {level} streams, against {w['against']}: TTFT p50 "
                          f"{f(r['ttft_us_p50'], 0)} us, p99 {f(r['ttft_us_p99'], 0)} us, CPU "
                          f"{f(r['cpu_us_per_request'], 0)} us per request")
        for level, rows in w["saturation"].items():
            console.print(f"saturation at {level} streams: " + ", ".join(
                f"{name} {f(r['chunks_per_s'], 0)} chunks/s on {f(r['proxy_cores'], 2)} cores ({r['limit']})"
                for name, r in rows.items()))
    if doc.get("targets"):
        t = Table(title=f"issue targets, gateway{of}")
        for col in ("target", "what", "value", "want", "met", "runs"):
            t.add_column(col, justify="right" if col not in ("target", "what") else "left")
        for key, e in doc["targets"].items():
            met = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "-"}[e["met"]]
            value = _fmt_value(e["value"]) + (f" +- {_fmt_value(e['error'])}" if e.get("error") is not None else "")
            if e.get("reference") is not None:
                value += f" (ref {_fmt_value(e['reference'])})"
            t.add_row(key, e["what"], value, f"{e['op']} {e['target']:,g} {e['unit']}", met,
                      ", ".join(_fmt_value(v) for v in e.get("runs") or []))
        console.print(t)
    spy = doc.get("py_spy")
    if spy and "top_self" in spy:
        t = Table(title=f"{spy.get('target', 'gateway')} hot path (py-spy, {spy['concurrency']} streams): "
                        "top self time")
        t.add_column("self %", justify="right")
        t.add_column("total %", justify="right")
        t.add_column("function")
        for fr in spy["top_self"][:15]:
            t.add_row(f"{100 * fr['self_share']:.1f}", f"{100 * fr['total_share']:.1f}", fr["frame"])
        console.print(t)
        if spy.get("top_areas"):
            console.print("self time by package: " + ", ".join(f"{a['area']} {100 * a['self_share']:.1f}%"
                                                               for a in spy["top_areas"][:10]))
    elif spy:
        console.print(f"py-spy: {spy.get('error')}")


def print_tracing(console: Any, tracing: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"what tracing adds per request ({tracing['exporter']}), against the same gateway untraced")
    for col in ("streams", "TTFT p50 us", "TTFT p99 us", "E2E p50 us", "TTFT p50 x", "added over direct x",
                "CPU us/req", "CPU/req x"):
        table.add_column(col, justify="right")

    def f(v: Any, d: int = 0) -> str:
        return "-" if v is None else f"{v:,.{d}f}"

    for level, r in tracing["levels"].items():
        table.add_row(level, f(r["ttft_us_p50"]), f(r["ttft_us_p99"]), f(r["e2e_us_p50"]), f(r["ttft_p50_x"], 3),
                      f(r["added_ttft_over_direct_x"], 2), f(r["cpu_us_per_request"]), f(r["cpu_per_request_x"], 3))
    console.print(table)
    sink = tracing.get("sink")
    if isinstance(sink, dict):
        console.print(f"OTLP sink received {sink.get('exports')} exports ({sink.get('bytes', 0):,} bytes)")
