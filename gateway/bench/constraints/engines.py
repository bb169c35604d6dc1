"""The validators compared, each run in a worker process of its own (``--worker ENGINE``): a segfault is
recorded as a crash of that input, and the worker replaced."""

from __future__ import annotations

import functools
import importlib
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.constraints.corpus import A, Case, R, smoke_corpus

Outcome = tuple[str, str | None, str]  # verdict ("accept" | "reject"), code, message
ENGINES = {
    "ours": "gateway.bench.constraints.engines:validate_ours",
    "ours-unlimited": "gateway.bench.constraints.engines:validate_ours_unlimited",
    "llguidance": "gateway.bench.constraints.engines:validate_llguidance",
}


def _ours(kind: str, dialect: str, text: str, bounds: Any) -> Outcome:
    from gateway.structured.bounds import ConstraintInvalid
    from gateway.structured.checks import parse_schema, run_check

    if kind == "json_schema":
        try:  # what the event loop does first: parse, and measure the nesting orjson allows
            parse_schema(text, "constraint", bounds)
        except ConstraintInvalid as exc:
            return R, exc.code, str(exc)
    verdict = run_check(kind, text, dialect, "constraint", bounds)  # type: ignore[arg-type]
    return (A, None, "") if verdict.problem is None else (R, verdict.code, verdict.problem)


def validate_ours(kind: str, dialect: str, text: str) -> Outcome:
    from gateway.structured.bounds import Bounds

    return _ours(kind, dialect, text, Bounds())


def validate_ours_unlimited(kind: str, dialect: str, text: str) -> Outcome:
    from gateway.structured.bounds import Bounds

    return _ours(kind, dialect, text, Bounds(max_nesting=200, max_bytes=1 << 30, max_rules=1 << 30))


def validate_llguidance(kind: str, dialect: str, text: str) -> Outcome:
    """llguidance's own path: ``grammar_from`` (its GBNF-to-Lark converter for gbnf and ebnf) and
    ``LLMatcher.validate_grammar`` without a tokenizer."""
    from llguidance import LLMatcher, grammar_from

    try:
        grammar = grammar_from(dialect if kind == "grammar" else kind, text)  # type: ignore[arg-type]
    except (ValueError, RecursionError) as exc:
        return R, type(exc).__name__, str(exc)
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return (R, "invalid", messages[0]) if failed else (A, None, "")


def _resolve(spec: str) -> Callable[[str, str, str], Outcome]:
    module, _, name = ENGINES.get(spec, spec).partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


def _in_thread(stack_kib: int, call: Callable[[], Outcome]) -> Outcome:
    box: list[Outcome] = []
    threading.stack_size(stack_kib * 1024)
    try:
        worker = threading.Thread(target=lambda: box.append(call()))
        worker.start()
        worker.join()
    finally:
        threading.stack_size(0)
    return box[0]


def worker_main(engine: str) -> None:
    """Answer one JSON line per job read from stdin: the verdict and the time of each repeat."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 6000))  # as gateway.structured.checks.prepare_worker
    validate = _resolve(engine)
    for case in smoke_corpus():  # imports and first-use caches out of the measured calls
        validate(case.kind, case.dialect, case.text)
    for line in sys.stdin:
        job = orjson.loads(line)
        times: list[float] = []
        outcome: Outcome = ("error", None, "")
        call = functools.partial(validate, job["kind"], job["dialect"], job["text"])
        while not times or (len(times) < job["repeats"] and sum(times) < job["budget_s"]):
            start = time.perf_counter()
            try:
                outcome = _in_thread(job["stack_kib"], call) if job.get("stack_kib") else call()
            except Exception as exc:  # a validator that raises is a finding, not the end of the run
                outcome = ("error", type(exc).__name__, str(exc))
            times.append(time.perf_counter() - start)
        verdict, code, message = outcome
        sys.stdout.write(orjson.dumps({"verdict": verdict, "code": code, "message": message[:300],
                                       "times": times}).decode() + "\n")
        sys.stdout.flush()


class Worker:
    """One engine's worker process; a crashed or stuck one is recorded and replaced."""

    def __init__(self, engine: str, timeout: float) -> None:
        self.engine, self.timeout = engine, timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen([sys.executable, "-m", "gateway.bench.constraints", "--worker", self.engine],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)

    def run(self, case: Case, repeats: int, budget_s: float) -> dict[str, Any]:
        proc = self.proc = self.proc or self._start()
        assert proc.stdin is not None and proc.stdout is not None
        job = {"kind": case.kind, "dialect": case.dialect, "text": case.text, "repeats": repeats,
               "budget_s": budget_s, "stack_kib": case.stack_kib}
        try:
            proc.stdin.write(orjson.dumps(job) + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready, _, _ = select.select([proc.stdout], [], [], self.timeout + 60)  # + start-up and warm-up
        line = proc.stdout.readline() if ready else b""
        if line:
            answer: dict[str, Any] = orjson.loads(line)
            answer["median_s"] = statistics.median(answer["times"])
            return answer
        self.proc = None
        if not ready:
            proc.kill()
            proc.wait()
            return {"verdict": "timeout", "code": None, "message": f"no answer in {self.timeout + 60:.0f} s",
                    "times": [], "median_s": None}
        rc = proc.wait()
        name = signal.Signals(-rc).name if rc < 0 else f"exit {rc}"
        return {"verdict": "crash", "code": name, "message": f"the worker died ({name})", "times": [], "median_s": None}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
