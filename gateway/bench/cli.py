"""``gateway bench ...`` and ``gateway profile ...``: parse the command line and hand over.

    gateway bench --target NAME=URL [--target NAME=URL ...] [--compare] [workload] [arrival] [--out PREFIX]
    gateway bench overhead [--levels 1,16,64,256] [--py-spy SECONDS] [--out DIR]
    gateway bench routing {prefix,shape,real-prefix} [options] [--out DIR]
    gateway bench soak [--requests 100000] [--concurrency 32] [--out DIR]
    gateway bench faults [--scenario NAME ...] [--out DIR]
    gateway bench constraints [--corpus full|smoke] [--out DIR]
    gateway bench fairness [--backends 2] [--slots 16] [--seconds 20] [--out DIR]
    gateway bench instructions [--code DIR ...] [--requests 100] [--out DIR]
    gateway profile (--backend NAME=URL ... | --config FILE) [--time-scale S] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway import gcpolicy
from gateway.bench.client import Target, parse_target
from gateway.bench.workload import KINDS, WorkloadConfig, build_workload

# `gateway bench NAME ...`: the module whose main(argv) runs NAME (imported only when asked for) and its line in
# `gateway bench --help`. A new benchmark is a module with a main() and one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "overhead": ("gateway.bench.overhead", "what the gateway adds to a stream, against the backend directly"),
    "routing": ("gateway.bench.routing", "the routing policies against each other: prefix, shape, real-prefix"),
    "soak": ("gateway.bench.soak", "many short requests through a gateway process, its memory sampled"),
    "faults": ("gateway.bench.faults", "the gateway under backend and client faults, bounded in time"),
    "constraints": ("gateway.bench.constraints", "the constraint validators against llguidance and llama.cpp"),
    "fairness": ("gateway.bench.fairness", "flow control under contention: noisy neighbour, priorities, weights"),
    "instructions": ("gateway.bench.instructions", "instructions per request and per chunk (callgrind), to compare "
                                                   "two versions of the code"),
}


def _subcommands_help() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return ("benchmarks (gateway bench NAME --help for each):\n" + "\n".join(lines)
            + "\n\nalso: gateway profile --help (each backend's speed curve over concurrency)")


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gateway bench",
        usage=f"%(prog)s {{{','.join(SUBCOMMANDS)}}} ...\n"
              "       %(prog)s --target NAME=URL [--target NAME=URL ...] [--compare] [options]",
        description="Streamed load against OpenAI-compatible endpoints: one target, or several compared side by\n"
                    "side (interleaved round by round). The other benchmarks are the subcommands listed below.",
        epilog=_subcommands_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t = p.add_argument_group("targets")
    t.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="an OpenAI-compatible base URL (with or without /v1); repeat to compare")
    t.add_argument("--compare", action="store_true", help="report ratios against the first target (needs 2+)")
    t.add_argument("--model", help="model to request (default: the first each target lists)")
    t.add_argument("--api-key", help="sent as a bearer token to every target")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=KINDS, default="shared-prefix")
    w.add_argument("--count", type=int, help="requests per target (default: one pass over the workload)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--output-len", type=int, default=64, help="max_tokens")
    w.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM, SGLang, "
                                                             "llama.cpp, the emulators)")
    w.add_argument("--structured-fraction", type=float, default=0.0,
                   help="share of requests with response_format json_schema")
    w.add_argument("--groups", type=int, default=8)
    w.add_argument("--prompts-per-group", type=int, default=4)
    w.add_argument("--system-len", type=int, default=512)
    w.add_argument("--question-len", type=int, default=64)
    w.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    w.add_argument("--zipf-s", type=float, default=1.1)
    w.add_argument("--conversations", type=int, default=8)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--input-min", type=int, default=32)
    w.add_argument("--input-max", type=int, default=512)
    w.add_argument("--output-min", type=int, default=16)
    w.add_argument("--output-max", type=int, default=128)
    a = p.add_argument_group("arrival")
    a.add_argument("--concurrency", type=int, default=8, help="closed loop: users (open loop: in-flight cap)")
    a.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    a.add_argument("--duration", type=float, help="stop issuing after this many seconds")
    a.add_argument("--round-size", type=int, help="requests per target per round when comparing "
                                                  "(default 4x concurrency, at least 16)")
    a.add_argument("--warmup", type=int, default=0, help="unrecorded requests per target first")
    a.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="report prefix: writes PREFIX.json and PREFIX.png "
                                            "(default reports/bench-<time>)")
    o.add_argument("--no-chart", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-requests", action="store_true", help="leave per-request records out of the JSON")
    return p


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        kind=args.workload, count=args.count, seed=args.seed, output_len=args.output_len, ignore_eos=args.ignore_eos,
        structured_fraction=args.structured_fraction, groups=args.groups, prompts_per_group=args.prompts_per_group,
        system_len=args.system_len, question_len=args.question_len, popularity=args.popularity, zipf_s=args.zipf_s,
        conversations=args.conversations, turns=args.turns, input_min=args.input_min, input_max=args.input_max,
        output_min=args.output_min, output_max=args.output_max)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=True)


def bench_main(argv: list[str]) -> int:
    from gateway.bench.report import build_report, plot_run, print_table, write_json
    from gateway.bench.runner import Arrival, run, run_sync

    parser = bench_parser()
    args = parser.parse_args(argv)
    if not args.target:
        parser.error("give at least one --target NAME=URL")
    if args.compare and len(args.target) < 2:
        parser.error("--compare needs two or more --target")
    try:
        targets = [parse_target(s) for s in args.target]
        cfg = workload_from_args(args)
        arrival = Arrival(concurrency=args.concurrency, rate=args.rate, duration=args.duration, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    targets = [Target(t.name, t.url, args.model, args.api_key) for t in targets]
    requests = build_workload(cfg)
    round_size = None
    if len(targets) > 1:
        round_size = args.round_size or max(16, 4 * (args.concurrency or 4))
    progress = _progress(len(requests) * len(targets), not args.no_progress and sys.stderr.isatty())
    on_done = None
    if progress is not None:
        task = progress.add_task("requests", total=len(requests) * len(targets))

        def on_done(_: object) -> None:
            progress.advance(task)

        progress.start()
    try:
        result = run_sync(run(targets, requests, arrival, round_size=round_size, on_done=on_done,
                              request_timeout=args.timeout, warmup=args.warmup))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if progress is not None:
            progress.stop()
    config = {"targets": {t.name: t.url for t in targets}, "workload": cfg.__dict__,
              "arrival": arrival.__dict__, "round_size": round_size, "warmup": args.warmup}
    doc = build_report(result, config, include_requests=not args.no_requests)
    prefix = args.out or Path("reports") / time.strftime("bench-%Y%m%d-%H%M%S")
    json_path = write_json(doc, prefix.with_suffix(".json"))
    print_table(doc)
    written = [str(json_path)]
    if not args.no_chart:
        written.append(str(plot_run(result, prefix.with_suffix(".png"), f"{cfg.kind}, {len(requests)} requests")))
    print("wrote " + " and ".join(written))
    failed = sum(t["errors"] for t in doc["targets"].values())
    return 1 if failed and failed == sum(t["requests"] for t in doc["targets"].values()) else 0


def main(argv: list[str]) -> int:
    """``argv[0]`` is ``"bench"`` or ``"profile"``."""
    command, rest = argv[0], argv[1:]
    entry: Callable[[list[str]], int]
    if command == "profile":
        from gateway.bench.profile import main as entry
    elif rest and rest[0] in SUBCOMMANDS:
        entry, rest = importlib.import_module(SUBCOMMANDS[rest[0]][0]).main, rest[1:]
    else:
        entry = bench_main
    # The load generator times every request: its own collector's pauses (a full collection held it 119 ms in
    # a fairness run) would be counted as the targets' latency. Frozen once the benchmark's code is imported, and
    # given back after (the test suite runs benchmarks in its own process).
    with gcpolicy.quieted():
        return entry(rest)
