"""``gateway bench faults``: the gateway under backend and client faults, on loopback, bounded in time.

Scenarios (each one a fresh emulated fleet and a fresh gateway):

* ``kill``: a backend killed while 200 streams run (two emulated vLLM servers, arrivals spread so that
  some streams are mid-flight on the victim and others have not started): those not yet streaming must fail
  over and complete; those streaming from the victim must end with a well-formed OpenAI error event.
* ``hang``: a backend that never sends a byte: a request costs at most the first-byte timeout, then fails
  over (and is a 504 when the hanging backend is alone).
* ``garbage``: a backend answering ``200 text/event-stream`` with bytes that are not SSE, not JSON, or JSON cut
  off: the client must get a well-formed stream or a well-formed error, never a hang or a broken event.
* ``flap``: a backend stopped and started again and again under load: no request fails while another
  backend is healthy.
* ``loading``: a llama.cpp backend stuck loading is never sent a generation request.
* ``slow``: clients reading long streams slowly hold back no one, and the gateway's memory stays bounded.
* ``huge_header``: while clients stream, others send ``GET /health`` with a 64 MiB header: each gets a 431
  at once, the streams' TTFT p99 rises by no more than 2x, no backend is marked down.
* ``idle_flood``: while clients stream, 3,000 connections open and stay silent, against a cap of 2,000:
  those past the cap are refused at once (503), the streams' TTFT p99 rises by no more than 2x, no backend
  is marked down.

For every scenario the report gives requests, requests lost (failed without being owed an error event,
hung, or malformed), error events (well-formed / total) and the longest stall a client saw (largest gap
between two reads, or before the first one). Writes ``faults.json`` under ``--out`` (``reports/faults``).

The tests in ``tests/faults`` run the same scenarios (imported from here) and assert on them.
"""


from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.faults.front_door import huge_header, idle_flood
from gateway.bench.faults.harness import (
    ScenarioReport,
)
from gateway.bench.faults.scenarios import (
    flapping_backend,
    garbage_backend,
    hanging_backend,
    kill_while_streaming,
    loading_backend,
    slow_client,
)

# -- the command ---------------------------------------------------------------------------------------------
SCENARIOS: dict[str, Callable[[], ScenarioReport]] = {
    "kill": lambda: kill_while_streaming().report,
    "hang": hanging_backend,
    "garbage": lambda: garbage_backend()[0],
    "flap": flapping_backend,
    "loading": loading_backend,
    "slow": slow_client,
    "huge_header": huge_header,
    "idle_flood": idle_flood,
}


def run_faults(names: Sequence[str], out: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    import logging

    logging.getLogger("gateway").setLevel(logging.CRITICAL)  # expected failures: keep the console readable
    doc: dict[str, Any] = {"schema": "gateway-bench-faults/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "scenarios": {}}
    for name in names:
        log(f"{name} ...")
        report = SCENARIOS[name]()
        doc["scenarios"][name] = report.as_dict()
        log(f"  {report.requests} requests, lost {report.lost}, error events well-formed "
            f"{report.error_events_well_formed}/{report.error_events}, max stall {report.max_stall_s:.2f} s, "
            f"{'ok' if report.ok else 'FAILED'} ({report.seconds:.1f} s)")
    doc["requests_lost"] = sum(s["lost"] for s in doc["scenarios"].values())
    doc["ok"] = all(s["ok"] for s in doc["scenarios"].values())
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return doc


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                   help="run only these (repeatable; default: all)")
    p.add_argument("--out", type=Path, default=Path("reports/faults"))
    a = p.parse_args(argv)
    doc = run_faults(a.scenario or list(SCENARIOS), a.out)
    print(f"requests lost: {doc['requests_lost']}; wrote {a.out / 'faults.json'}")
    return 0 if doc["ok"] else 1
