"""``gateway bench instructions``: the gateway's own work per request and per streamed chunk, counted in
instructions instead of timed, so that two versions of the code compare to about a percent on a machine whose
speed drifts from hour to hour (the overhead benchmark's CPU figures move by 10% between runs here).

The gateway runs as users run it (``python -m gateway serve``, one ``openai`` backend, the default policy; only its
backend is scraped every 30 s rather than every second) under valgrind's callgrind, which counts the instructions
the process executes in user space (the kernel's share of each system call is not in it). Counting is switched on
after a warm-up and off after the measured requests, so start-up and warm-up are left out. As in the overhead
benchmark's cost phase, a closed loop of ``--concurrency`` streams sends ``--requests`` requests with distinct
~2,000-token prompts to a raw backend twice, streaming ``--tokens`` A and B chunks, and ``instructions = requests *
R + chunks * C`` gives R (per request, excluding its chunks) and C (per chunk). The backend's chunks come 100 ms
apart (``--gap-ms``): the slowed process then still reads a stream's chunks one at a time, as the cost phase's does
at full speed 2 ms apart; closer together they pile up between reads and are handled several at once, for less.
What the process runs while idle (timers and threads, ~1M instructions a second under callgrind) is counted first
for ``idle_s`` and taken from each run for its length: it grows with a run's wall time, and the longer run, with
more chunks, would otherwise charge it to C (~7k a chunk at 100 ms apart).

Where they go: each checkout's entry also lists the functions with the most instructions per request and per chunk
(``functions``), solved the same way from each function's own count in the two runs (callgrind_annotate's
self cost; C functions: the interpreter, the regular-expression engine, orjson, uvloop, httptools, the C library).
A Python function's work shows as the interpreter's, so this says what kind of work grew, not which line.

``--code DIR`` (repeatable) measures another checkout of the gateway with the same interpreter and packages, so a
change is judged by running the same command on both (e.g. a ``git worktree`` of the commit before it). Slow: a
process under callgrind runs ~50 times slower; 100 requests per run take about a minute.

    gateway bench instructions [--code DIR ...] [--requests 100] [--concurrency 16] [--tokens 4,64]
                               [--policy default] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gateway.bench.client import Target
from gateway.bench.overhead import MODEL, CostRun, cost_requests_for, gateway_yaml, solve_cost
from gateway.bench.procs import ChildProcess
from gateway.bench.report import write_json
from gateway.bench.runner import Arrival, run, run_sync

SCHEMA = "gateway-bench-instructions/1"
# The backend's scrape every 30 s, with a 30 s timeout: under callgrind a 1 s scrape would be counted with the
# requests (work that grows with the run's wall time, not with its requests), and its 2 s timeout would mark the
# backend down when the slowed process answers late.
SCRAPE = "scrape:\n  interval: 30\n  timeout: 30\n  stale_after: 120\n"
HERE = "."  # --code for this checkout
T = TypeVar("T")
TOP_FUNCTIONS = 15  # per request and per chunk, in each checkout's entry


@dataclass
class InstructionsConfig:
    code: list[str] = field(default_factory=lambda: [HERE])  # checkouts to measure, in order
    requests: int = 100  # per run (two runs per checkout)
    concurrency: int = 16
    tokens: tuple[int, int] = (4, 64)
    prompt_chars: int = 8000
    warmup: int = 48
    # the cost phase's 2 ms between a stream's chunks, times callgrind's ~50x slowdown: at 2 ms the slowed process
    # fell behind and read ~16 of a stream's chunks at once, which it handles as one piece (the busy case), where
    # the cost phase at full speed reads them one by one
    gap_ms: float = 100.0
    # counted with no request first: what the idle process runs per second (its timers and threads: uvicorn's tick,
    # the access log's writer), taken from each run for the run's length, as it does not scale with requests
    idle_s: float = 5.0
    policy: str = "default"  # the gateway's routing policy
    base_port: int = 18640
    out: Path = Path("reports/instructions")


def valgrind_available() -> bool:
    return all(shutil.which(tool) is not None for tool in ("valgrind", "callgrind_control", "callgrind_annotate"))


def counted(dump: Path) -> int:
    """The instructions one callgrind dump counted: its ``totals:`` line (with counting switched on and off by
    callgrind_control, its ``summary:`` line stays 0)."""
    fields = dict(line.split(":", 1) for line in dump.read_text(errors="replace").splitlines()
                  if line.startswith(("totals:", "summary:")))
    value = fields.get("totals") or fields.get("summary")
    if value is None:
        raise ValueError(f"{dump}: no totals line (not a callgrind dump?)")
    return int(value.split()[0])


# a line of callgrind_annotate's function table: "28,391,678 (24.76%)  /path/ceval.c:_PyEval_EvalFrameDefault'2 [lib]"
_ANNOTATED = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*?)(?:\s+\[([^\]]+)\])?\s*$")


def functions(annotated: str) -> dict[str, int]:
    """Instructions per function from callgrind_annotate's table (self cost): ``file:function`` reduced to the
    function, its recursion levels (``'2``) merged, and code without symbols counted as ``???@library``."""
    totals: dict[str, int] = {}
    table = False
    for line in annotated.splitlines():
        if not table:
            table = line.rstrip().endswith("file:function")
            continue
        found = _ANNOTATED.match(line)
        if found is None:
            continue
        where, library = found[2], found[3]
        name = where.rsplit(":", 1)[-1]
        if where.startswith("???"):
            name = f"???@{Path(library).name}" if library else "???"
        name = re.sub(r"'\d+$", "", name)
        totals[name] = totals.get(name, 0) + int(found[1].replace(",", ""))
    return totals


def _annotate(dump: Path) -> dict[str, int]:
    shown = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dump)],
                           capture_output=True, text=True, check=True, timeout=300).stdout
    return functions(shown)


def top_functions(runs: list[dict[str, Any]], limit: int = TOP_FUNCTIONS) -> dict[str, list[list[Any]]]:
    """The functions with the most instructions per request (excluding chunks) and per chunk, each solved from
    its counts in the two runs (``runs[i]["functions"]``) like the totals."""
    a, b = runs
    solved: list[tuple[str, float, float]] = []
    for name in a["functions"].keys() | b["functions"].keys():
        fit = solve_cost(CostRun(a["requests"], a["chunks"], float(a["functions"].get(name, 0))),
                         CostRun(b["requests"], b["chunks"], float(b["functions"].get(name, 0))))
        if fit["cpu_us_per_request"] is not None and fit["cpu_us_per_chunk"] is not None:
            solved.append((name, fit["cpu_us_per_request"] / 1e6, fit["cpu_us_per_chunk"] / 1e6))
    pairs = {"per_request": [(name, r) for name, r, _ in solved], "per_chunk": [(name, c) for name, _, c in solved]}
    return {key: [[name, round(value)] for name, value in sorted(found, key=lambda item: -item[1])[:limit]]
            for key, found in pairs.items()}


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=True, timeout=60)


async def _counting(pid: int, work: Awaitable[T]) -> tuple[T, float]:
    """``work``'s result, and the seconds it took, with callgrind counting only meanwhile (then dumped)."""
    _control(pid, "-i", "on")
    started = time.monotonic()
    result = await work
    wall = time.monotonic() - started
    _control(pid, "-i", "off")
    _control(pid, "-d")
    return result, wall


def _code_dir(code: str) -> Path:
    path = Path(code).resolve()
    if not (path / "gateway" / "__main__.py").is_file():
        raise SystemExit(f"--code {code}: no gateway package there (a checkout of this project's repository)")
    return path


def _processes(code: str, cfg: InstructionsConfig, logs: Path) -> tuple[ChildProcess, ChildProcess, Path]:
    """The raw backend, the checkout's gateway under callgrind (counting off), and callgrind's output file."""
    py = sys.executable
    backend_port, gateway_port = cfg.base_port, cfg.base_port + 1
    backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(backend_port),
                                           "--gap-ms", str(cfg.gap_ms), "--model", MODEL], logs / "backend.log")
    config = logs / "gateway.yaml"
    config.write_text(gateway_yaml(f"http://127.0.0.1:{backend_port}", gateway_port, cfg.policy) + SCRAPE)
    out_file = logs / "callgrind.out"
    for old in [out_file, *logs.glob(out_file.name + ".*")]:
        old.unlink(missing_ok=True)
    where = _code_dir(code)
    # (env -C: the checkout's own gateway package is imported first; valgrind then runs Python in this process,
    # so the pid stays the one callgrind_control is given)
    gateway = ChildProcess("gateway", ["env", "-C", str(where), f"PYTHONPATH={where}", "valgrind", "--tool=callgrind",
                                       "--instr-atstart=no", f"--callgrind-out-file={out_file}", py, "-m", "gateway",
                                       "serve", "--config", str(config), "--log-level", "warning"],
                           logs / "gateway.log")
    return backend, gateway, out_file


async def _measure_code(code: str, cfg: InstructionsConfig, logs: Path) -> dict[str, Any]:
    """One checkout: one gateway process under callgrind, idle for ``idle_s``, then a run per chunk count (the raw
    backend streams as many chunks as a request's max_tokens), each counted on its own (a dump per run: a dump
    zeroes the counts), less the idle rate for the run's length."""
    backend, gateway, out_file = _processes(code, cfg, logs)
    backend_port, gateway_port = cfg.base_port, cfg.base_port + 1
    runs: list[dict[str, Any]] = []
    dumps = (logs / f"{out_file.name}.{n}" for n in itertools.count(1))  # (callgrind numbers its dumps)
    try:
        backend.start().wait_http(f"http://127.0.0.1:{backend_port}/health")
        gateway.start().wait_http(f"http://127.0.0.1:{gateway_port}/v1/models", timeout=300)
        target = Target("gateway", f"http://127.0.0.1:{gateway_port}", MODEL)
        arrival = Arrival(concurrency=cfg.concurrency)
        seed = 0  # (the same prompts for every checkout)
        for tokens in cfg.tokens:
            await run([target], cost_requests_for(cfg.warmup, tokens, cfg.prompt_chars, 10**9), arrival,
                      request_timeout=300)
            if not runs:  # first, the warmed process idle
                _, idle_wall = await _counting(gateway.pid, asyncio.sleep(cfg.idle_s))
                dump = next(dumps)
                idle_rate = counted(dump) / idle_wall
                idle_functions = {name: n / idle_wall for name, n in _annotate(dump).items()}
            result, wall = await _counting(gateway.pid, run(
                [target], cost_requests_for(cfg.requests, tokens, cfg.prompt_chars, seed), arrival,
                request_timeout=300))
            seed += cfg.requests
            results = result.results["gateway"]
            failed = sum(1 for r in results if not r.ok)
            if failed:
                raise RuntimeError(f"{failed} of {len(results)} requests failed under callgrind (see {logs})")
            dump = next(dumps)
            total, idle = counted(dump), round(idle_rate * wall)
            runs.append({"max_tokens": tokens, "requests": len(results), "chunks": sum(r.chunks for r in results),
                         "wall_s": wall, "counted": total, "idle": idle, "instructions": total - idle,
                         "functions": {name: n - idle_functions.get(name, 0.0) * wall
                                       for name, n in _annotate(dump).items()}})
    finally:
        gateway.stop()
        backend.stop()
    return {"idle_per_second": idle_rate, "idle_seconds": idle_wall, "runs": runs}


async def measure(cfg: InstructionsConfig, log: Any = print) -> dict[str, Any]:
    doc: dict[str, Any] = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
                           "counter": "valgrind --tool=callgrind: instructions executed in user space",
                           "model": "instructions - idle_per_second * wall_s = requests * R + chunks * C", "code": {}}
    for i, code in enumerate(cfg.code):
        logs = cfg.out / f"code-{i + 1}"
        logs.mkdir(parents=True, exist_ok=True)
        measured = await _measure_code(code, cfg, logs)
        runs = measured["runs"]
        a, b = (CostRun(r["requests"], r["chunks"], float(r["instructions"])) for r in runs)
        fit = solve_cost(a, b)  # (in units of 1e-6 "seconds": read as instructions / 1e6)
        per_request = fit["cpu_us_per_request"]
        per_chunk = fit["cpu_us_per_chunk"]
        r = None if per_request is None else per_request / 1e6
        c = None if per_chunk is None else per_chunk / 1e6
        top = top_functions(runs)
        for each in runs:
            del each["functions"]  # (hundreds of names per run: the JSON keeps the solved top ones)
        doc["code"][code] = {"dir": str(_code_dir(code)), "runs": runs, "per_request": r, "per_chunk": c,
                             "functions": top, "idle_per_second": measured["idle_per_second"],
                             "idle_seconds": measured["idle_seconds"]}
        log(f"{code}: {_k(r)} instructions per request, {_k(c)} per chunk")
        for key in ("per_request", "per_chunk"):
            log(f"  most {key.replace('_', ' ')}: " + ", ".join(f"{n} {_k(v)}" for n, v in top[key][:6]))
    first = next(iter(doc["code"].values()))
    for entry in doc["code"].values():
        entry["vs_first"] = {key: (entry[key] / first[key] if entry[key] and first[key] else None)
                             for key in ("per_request", "per_chunk")}
    return doc


def _k(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:,.1f}k"


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["code"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "per_request", "per request (excluding chunks)"),
                           (axes[1], "per_chunk", "per streamed chunk")):
        values = [(doc["code"][n][key] or 0) / 1000 for n in names]
        ax.bar(range(len(names)), values, color="#4477aa")
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
        ax.set_ylabel("thousand instructions")
        ax.set_title(title)
        for x, v in enumerate(values):
            ax.annotate(f"{v:,.1f}k", (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle("gateway instructions (callgrind, user space)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench instructions", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", default=[], metavar="DIR",
                   help="a checkout of the gateway to measure (repeat to compare; default: this one, '.')")
    p.add_argument("--requests", type=int, default=100, help="requests per run, two runs per checkout")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--tokens", default="4,64", help="chunks per answer in the two runs, A,B (default 4,64)")
    p.add_argument("--prompt-chars", type=int, default=8000)
    p.add_argument("--policy", default="default", help="the gateway's routing policy (default: default)")
    p.add_argument("--base-port", type=int, default=18640, help="the raw backend; the gateway on the next port")
    p.add_argument("--out", type=Path, default=Path("reports/instructions"))
    a = p.parse_args(argv)
    tokens = [int(x) for x in a.tokens.split(",") if x.strip()]
    if len(tokens) != 2 or tokens[0] == tokens[1] or min(tokens) < 1:
        p.error("--tokens: two different chunk counts, A,B")
    if a.requests < 1 or a.concurrency < 1:
        p.error("--requests and --concurrency must be at least 1")
    if not valgrind_available():
        p.error("needs valgrind, callgrind_control and callgrind_annotate (Debian: apt-get install valgrind)")
    cfg = InstructionsConfig(code=a.code or [HERE], requests=a.requests, concurrency=a.concurrency,
                             tokens=(tokens[0], tokens[1]), prompt_chars=a.prompt_chars, policy=a.policy,
                             base_port=a.base_port, out=a.out)
    for code in cfg.code:
        _code_dir(code)
    doc = run_sync(measure(cfg))
    path = write_json(doc, cfg.out / "instructions.json")
    chart = plot(doc, cfg.out / "instructions.png")
    for code, entry in doc["code"].items():
        vs = entry["vs_first"]
        print(f"{code}: R {_k(entry['per_request'])}, C {_k(entry['per_chunk'])} instructions"
              + (f" ({vs['per_request']:.3f}x, {vs['per_chunk']:.3f}x the first)"
                 if vs["per_request"] and code != cfg.code[0] else ""))
    print(f"wrote {path} and {chart}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
