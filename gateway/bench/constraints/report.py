"""Judging the verdicts against the authorities, the per-class summary, and the chart."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gateway.bench.constraints.corpus import LARK_AUTHORITY, A, Case, R

LIMIT_CODES = ("constraint_too_large", "constraint_too_deep", "constraint_too_complex")


def judge(case: Case, results: dict[str, dict[str, Any]], llama: dict[str, Any] | None) -> dict[str, Any]:
    """Whether ``ours`` and ``llguidance`` agree and, where they do not, which one the authority backs."""
    ours, llg = results.get("ours"), results.get("llguidance")
    truth, source = case.expect, case.why or "expected"
    if case.dialect == "gbnf" and llama is not None and llama["verdict"] in (A, R):
        truth, source = llama["verdict"], "llama-server (measured)"
    elif case.dialect == "lark" and truth is None and llg is not None and llg["verdict"] in (A, R):
        truth, source = llg["verdict"], LARK_AUTHORITY
    out: dict[str, Any] = {"truth": truth, "truth_source": source if truth else None}
    if ours is None or llg is None:
        return out
    if truth is not None:  # which engines say otherwise than the authority (the gateway's limits aside)
        out["wrong"] = [e for e, r in results.items() if r["verdict"] != truth
                        and not (r["verdict"] == R and r["code"] in LIMIT_CODES)]
    if llg["verdict"] in ("crash", "timeout", "error"):
        out["agreement"] = f"llguidance {llg['verdict']}"
    elif ours["verdict"] == llg["verdict"]:
        out["agreement"] = "agree"
    elif ours["verdict"] == R and ours["code"] in LIMIT_CODES:
        out["agreement"] = "gateway limit"  # the gateway refuses it by a limit of its own, by design
    else:
        out["agreement"] = "disagree"
        out["right"] = ("ours" if ours["verdict"] == truth else "llguidance" if llg["verdict"] == truth
                        else "unknown")
    return out


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(rows: list[dict[str, Any]], engines: list[str]) -> dict[str, Any]:
    """Per input class: the median of the per-input median times, per engine, and the verdict tallies."""
    classes: dict[str, Any] = {}
    for cls in dict.fromkeys(r["class"] for r in rows):
        mine = [r for r in rows if r["class"] == cls]
        entry: dict[str, Any] = {"inputs": len(mine)}
        for engine in engines:
            timed = [r["engines"][engine] for r in mine if engine in r["engines"]]
            if not timed:
                continue
            entry[engine] = {
                "median_s": _median(t["median_s"] for t in timed),
                "max_s": max((t["median_s"] for t in timed if t["median_s"] is not None), default=None),
                "accepted": sum(t["verdict"] == A for t in timed), "rejected": sum(t["verdict"] == R for t in timed),
                "crashes": sum(t["verdict"] == "crash" for t in timed),
                "timeouts": sum(t["verdict"] == "timeout" for t in timed),
                "errors": sum(t["verdict"] == "error" for t in timed),
                "limit_refusals": sum(t["verdict"] == R and t["code"] in LIMIT_CODES for t in timed),
            }
            judged = [(r["truth"], r["engines"][engine]["verdict"]) for r in mine if engine in r["engines"]
                      and r["truth"] is not None and r["engines"][engine]["code"] not in LIMIT_CODES]
            entry[engine]["judged"] = len(judged)  # inputs with a known answer, the engine's limit refusals apart
            entry[engine]["right"] = sum(truth == verdict for truth, verdict in judged)
        tally: dict[str, int] = {}
        for r in mine:
            if "agreement" in r:
                tally[r["agreement"]] = tally.get(r["agreement"], 0) + 1
        entry["agreement"] = tally
        classes[cls] = entry
    return classes


def chart(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = [c for c, e in doc["classes"].items() if "ours" in e and "llguidance" in e]
    fig, (bars, dots) = plt.subplots(1, 2, figsize=(15, 6))
    width = 0.4
    for offset, engine, colour in ((-width / 2, "ours", "tab:blue"), (width / 2, "llguidance", "tab:orange")):
        values = [doc["classes"][c][engine]["median_s"] or 0 for c in classes]
        bars.bar([i + offset for i in range(len(classes))], [v * 1e3 for v in values], width, label=engine,
                 color=colour)
    for i, c in enumerate(classes):
        failed = doc["classes"][c]["llguidance"]["crashes"] + doc["classes"][c]["llguidance"]["timeouts"]
        if failed:
            height = (doc["classes"][c]["llguidance"]["median_s"] or 0) * 1e3
            bars.annotate(f"{failed} crashed", (i + width / 2, height), fontsize=8, color="red", xytext=(0, 3),
                          textcoords="offset points", ha="center")
    bars.set_yscale("log")
    bars.set_xticks(range(len(classes)), classes, rotation=30, ha="right")
    bars.set_ylabel("median validation time per input (ms, log)")
    bars.set_title("validation time by input class")
    bars.legend()
    top = max((r["engines"][e]["median_s"] or 0 for r in doc["cases"] for e in ("ours", "llguidance")
               if e in r["engines"]), default=1.0) * 3e3
    for cls in classes:
        pts = [(r["engines"]["ours"]["median_s"], r["engines"]["llguidance"]["median_s"]) for r in doc["cases"]
               if r["class"] == cls and "llguidance" in r["engines"] and r["engines"]["ours"]["median_s"]]
        dots.scatter([x * 1e3 for x, _ in pts], [(y * 1e3 if y else top) for _, y in pts], s=14, label=cls,
                     marker="o")
    dots.axhline(top, color="red", lw=0.5, ls=":")
    dots.text(1e-3, top, "crash / timeout", color="red", fontsize=8, va="bottom")
    dots.plot([1e-3, top], [1e-3, top], color="grey", lw=0.6)
    dots.set_xscale("log")
    dots.set_yscale("log")
    dots.set_xlabel("ours (ms)")
    dots.set_ylabel("llguidance (ms)")
    dots.set_title("per input (above the line: llguidance slower)")
    dots.legend(fontsize=7)
    fig.suptitle(f"constraint validation: gateway vs llguidance {doc['llguidance_version']} ({doc['created']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
