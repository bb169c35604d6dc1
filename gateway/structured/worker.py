"""A constraint-validation worker process: ``python -m gateway.structured.worker`` (started by offload.py).

It says ``"ready"`` once its imports are done, then reads one job per line on standard input and writes one
verdict per line on standard output, both JSON: ``[kind, payload, dialect, param, [max_nesting, max_bytes,
max_rules]]`` in, ``[renderings, problem, code]`` out.
"""

from __future__ import annotations

import sys

import orjson

from gateway.structured.bounds import Bounds
from gateway.structured.checks import prepare_worker, run_check


def main() -> None:
    prepare_worker()
    out = sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        kind, payload, dialect, param, bounds = orjson.loads(line)
        verdict = run_check(kind, payload, dialect, param, Bounds(*bounds))
        out.write(orjson.dumps([verdict.renderings, verdict.problem, verdict.code]) + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
