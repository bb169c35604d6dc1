"""A constraint-validation worker process: ``python -m gateway.structured.worker`` (started by offload.py).

It says ``"ready"`` once its imports are done, then reads one job per line on standard input and writes one
answer per line on standard output, both JSON:

- a constraint's validation: ``[kind, payload, dialect, param, [max_nesting, max_bytes, max_rules]]`` in,
  ``[renderings, problem, code, fanout]`` out;
- an answer's check: ``["answer", route, kind, spec, answer, seconds]`` in (``spec``: the schema, the strict
  tools' schemas by name, or the regex), ``[problem, unchecked]`` out. The check stops at its own deadline
  (``seconds``, a timer signal: Python's ``re`` and ``jsonschema`` both see it) and answers unchecked, so the
  worker lives on; offload.py kills it only when even that does not come back.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, cast

import orjson

from gateway.structured.bounds import Bounds
from gateway.structured.check import CHECKABLE, Unchecked, answer_verdict
from gateway.structured.checks import Verdict, prepare_worker, run_check
from gateway.structured.constraint import Constraint, Kind


def _deadline(signum: int, frame: Any) -> None:
    raise Unchecked("the check ran past its deadline (limits.output_check_timeout)")


def check_answer(route: str, kind: str, spec: Any, answer: str, seconds: float) -> list[str | None]:
    """``[problem, unchecked]`` for one answer, within ``seconds``."""
    if kind not in CHECKABLE:
        raise ValueError(f"not a checkable kind: {kind!r}")
    constraint = Constraint(cast(Kind, kind), "answer", **({"pattern": spec} if kind == "regex" else {"schema": spec}))
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            problem, unchecked = answer_verdict(route, answer.encode(), constraint)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Unchecked as exc:  # (the deadline; or its signal came between the end of the check and the cancel)
        problem, unchecked = None, exc.reason
    return [problem, unchecked]


def main() -> None:
    prepare_worker()
    signal.signal(signal.SIGALRM, _deadline)
    # (what the first answer check builds lazily, jsonschema's validator classes and referencing, built now)
    warm = orjson.dumps({"choices": [{"message": {"content": '{"a": "b"}'}}]}).decode()
    check_answer("chat", "json_schema", {"type": "object", "properties": {"a": {"pattern": "^b$"}}}, warm, 10.0)
    out = sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        job = orjson.loads(line)
        if job[0] == "answer":
            try:
                reply: list[Any] = check_answer(*job[1:])
            except Exception as exc:  # (as below: the answer passes unchecked, and the worker lives on)
                reply = [None, f"the check failed ({type(exc).__name__})"]
        else:
            kind, payload, dialect, param, bounds = job
            try:
                verdict = run_check(kind, payload, dialect, param, Bounds(*bounds))
            except Exception as exc:  # a check that fails on a client's odd input must not end the worker (a
                # restart costs the next request of every key a second): the client hears it is not valid
                verdict = Verdict((), f"{param} could not be validated ({type(exc).__name__}); it is not a valid "
                                      "constraint", "invalid_constraint")
            reply = [verdict.renderings, verdict.problem, verdict.code, verdict.fanout]
        out.write(orjson.dumps(reply) + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
