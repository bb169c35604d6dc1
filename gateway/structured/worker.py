"""A constraint-validation worker process: ``python -m gateway.structured.worker`` (started by offload.py).

It says ``"ready"`` once its imports are done, then reads one job per line on standard input and writes one
verdict per line on standard output, both JSON: ``[kind, payload, dialect, param, [max_nesting, max_bytes,
max_rules]]`` in, ``[renderings, problem, code]`` out.
"""

from __future__ import annotations

import sys

import orjson

from gateway.structured.bounds import Bounds
from gateway.structured.checks import Verdict, prepare_worker, run_check


def main() -> None:
    prepare_worker()
    out = sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        kind, payload, dialect, param, bounds = orjson.loads(line)
        try:
            verdict = run_check(kind, payload, dialect, param, Bounds(*bounds))
        except Exception as exc:  # a check that fails on a client's odd input must not end the worker (a restart
            # costs the next request of every key a second): the client hears its constraint is not valid
            verdict = Verdict((), f"{param} could not be validated ({type(exc).__name__}); it is not a valid "
                                  "constraint", "invalid_constraint")
        out.write(orjson.dumps([verdict.renderings, verdict.problem, verdict.code]) + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
