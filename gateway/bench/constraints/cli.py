"""``gateway bench constraints`` (or ``python -m gateway.bench.constraints``): run the benchmark, write
``constraints.json`` and ``constraints.png``, print a line per input class."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.constraints.corpus import Case, full_corpus, smoke_corpus
from gateway.bench.constraints.engines import ENGINES, Worker, worker_main
from gateway.bench.constraints.llama_oracle import llama_cpp_verdicts
from gateway.bench.constraints.report import chart, judge, summarise
from gateway.bench.constraints.sampling import run_sampling, sampling_main

SCHEMA_ID = "gateway-bench-constraints/1"


@dataclass
class Options:
    out: Path
    corpus: str = "full"
    engines: list[str] = field(default_factory=lambda: ["ours", "llguidance", "ours-unlimited"])
    repeats: int = 7
    budget_s: float = 2.0
    timeout_s: float = 60.0
    llama_server: bool = True
    samples: int = 20  # 0: no sampling part


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except OSError:
        return None


def _llguidance_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("llguidance")
    except Exception:
        return None


def run(options: Options, cases: list[Case] | None = None, progress: bool = True,
        command: str = "gateway.bench.constraints.run()") -> dict[str, Any]:
    """Run every engine on ``cases`` (default: the corpus ``options`` names), judge, sum up; write the JSON
    (``command`` is recorded in it) and the chart under ``options.out``; return the JSON's content."""
    cases = cases if cases is not None else (smoke_corpus() if options.corpus == "smoke" else full_corpus())
    workers = {engine: Worker(engine, options.timeout_s) for engine in options.engines}
    rows: list[dict[str, Any]] = []
    try:
        for n, case in enumerate(cases, 1):
            results = {engine: worker.run(case, options.repeats, options.budget_s)
                       for engine, worker in workers.items()
                       if not (engine == "ours-unlimited" and not case.adversarial)}
            rows.append({"id": case.id, "class": case.cls, "kind": case.kind, "dialect": case.dialect,
                         "bytes": len(case.text.encode()), "stack_kib": case.stack_kib, "expect": case.expect,
                         "why": case.why, "engines": results})
            if progress:
                print(f"[{n}/{len(cases)}] {case.id}: " + ", ".join(
                    f"{e} {r['verdict']} {r['median_s'] * 1e3:.3f} ms" if r["median_s"] is not None
                    else f"{e} {r['verdict']}" for e, r in results.items()), file=sys.stderr, flush=True)
    finally:
        for worker in workers.values():
            worker.close()
    llama = llama_cpp_verdicts(cases) if options.llama_server else {}
    for row in rows:
        if row["id"] in llama:
            row["llama_cpp"] = llama[row["id"]]
        row.update(judge(next(c for c in cases if c.id == row["id"]), row["engines"], llama.get(row["id"])))
    doc: dict[str, Any] = {
        "schema": SCHEMA_ID, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": _git_commit(),
        "command": command,
        "llguidance_version": _llguidance_version(), "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "llama_server": bool(llama),
        "options": {**asdict(options), "out": str(options.out)}, "classes": summarise(rows, options.engines),
        "cases": rows,
    }
    if options.samples and "llguidance" in options.engines:
        doc["sampling"] = run_sampling(options.samples, options.timeout_s * 10)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "constraints.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    chart(doc, options.out / "constraints.png")
    return doc


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway bench constraints", description=(
        "The gateway's constraint validators against llguidance (and llama.cpp's own parser, where a llama-server "
        "is cached) on one corpus: verdicts, validation times, and constrained sampling."))
    p.add_argument("--out", type=Path, default=Path("reports/constraints"), help="writes constraints.json and .png")
    p.add_argument("--corpus", choices=("full", "smoke"), default="full")
    p.add_argument("--engines", default="ours,llguidance,ours-unlimited",
                   help=f"comma-separated: {', '.join(ENGINES)}, or module:function")
    p.add_argument("--repeats", type=int, default=7, help="timed calls per input (fewer past --budget seconds)")
    p.add_argument("--budget", type=float, default=2.0, help="seconds of repeats per input and engine")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds an engine gets per input before it is killed")
    p.add_argument("--no-llama-server", action="store_true", help="skip llama.cpp's own verdicts")
    p.add_argument("--samples", type=int, default=20, help="samples per constraint in the sampling part (0: skip)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--sampling-worker", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    if args.sampling_worker:
        sys.stdout.write(orjson.dumps(sampling_main(args.sampling_worker)).decode())
        return 0
    options = Options(out=args.out, corpus=args.corpus, engines=args.engines.split(","), repeats=args.repeats,
                      budget_s=args.budget, timeout_s=args.timeout, llama_server=not args.no_llama_server,
                      samples=args.samples)
    doc = run(options, command=" ".join(["gateway bench constraints", *(sys.argv[1:] if argv is None else argv)]))
    for cls, entry in doc["classes"].items():
        cells = [f"{e} {entry[e]['median_s'] * 1e3:.3f} ms" if entry.get(e, {}).get("median_s") is not None
                 else f"{e} -" for e in options.engines if e in entry]
        print(f"{cls:26} n={entry['inputs']:3} " + "  ".join(cells) + f"  {entry['agreement']}")
    print(f"wrote {options.out / 'constraints.json'} and {options.out / 'constraints.png'}")
    return 0
