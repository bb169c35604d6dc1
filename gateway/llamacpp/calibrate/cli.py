"""Calibrate the llama.cpp emulator against a real ``llama-server`` on this CPU (issue 4, item 4).

    python -m gateway.llamacpp.calibrate [--out reports/calibration] [--rounds 3]

One small workload, sent with plain aiohttp streaming (not through the gateway) to a real llama-server
(the generated "large" model, 2 slots, 1 thread, no host-RAM prompt cache) and to the llama.cpp emulator:

* TTFT against prompt length (uncached prompts of exact token counts, built with each server's ``/tokenize``),
* TTFT of a prompt whose first N tokens are cached in a slot (same prefix, different tail) against uncached,
* decode speed: one stream at a short and at long contexts, two streams at once,
* slot queueing: 4 concurrent requests (sent 5 ms apart) on 2 slots, TTFT of the later two against the first two.

A probe round on the real server gives the emulator's profile (:func:`derive_overrides`: prefill tok/s, its
growth with context, fixed prefill cost, decode step time, its growth with batch and context, slots); a probe
of the emulator corrects what its own HTTP path adds (:func:`refine`). Then ``--rounds`` rounds run the workload
on both, interleaved; each measurement's best round is kept (load from other processes only adds time; ratios
from medians are in the JSON too), and the report compares shape ratios (:func:`shape_ratios`, :func:`compare`), real
against emulated, in ``calibration.json`` and ``calibration.png`` under ``--out``, and prints a table.
It is a report, not a test: absolute figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gateway.llamacpp.calibrate.common import (
    ADJUSTMENTS,
    CACHED_PREFIXES,
    CTX_PER_SLOT,
    DECODE_TOKENS,
    FLOOR_LENGTH,
    LENGTHS,
    MODEL_NAME,
    PROBE_ROUNDS,
    QUEUE_PROMPT,
    QUEUE_REQUESTS,
    QUEUE_TOKENS,
    SLOTS,
    SWEEP_TOKENS,
    TOLERANCE,
    Summary,
    Workload,
)
from gateway.llamacpp.calibrate.fit import (
    Row,
    compare,
    derive_overrides,
    refine,
    shape_ratios,
    summarize,
)
from gateway.llamacpp.calibrate.measure import (
    Client,
    run_workload,
)
from gateway.llamacpp.calibrate.report import (
    chart,
    measured_figures,
    table,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gateway llamacpp calibrate",
                                     description="compare the llama.cpp emulator with a real llama-server")
    parser.add_argument("--out", type=Path, default=Path("reports/calibration"), help="report directory")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds, real then emulated")
    parser.add_argument("--threads", type=int, default=1, help="llama-server CPU threads")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    from gateway.llamacpp.build import BuildError, build
    from gateway.llamacpp.model import model_path
    from gateway.llamacpp.server import LlamaServer
    from gateway.sim import FleetThread

    try:
        binary = build()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = model_path("large")

    def say(msg: str) -> None:
        print(f"[calibrate] {msg}", file=sys.stderr, flush=True)

    server = LlamaServer(binary, model, free_port(), slots=SLOTS, ctx=CTX_PER_SLOT, threads=args.threads,
                         cache_ram_mib=0)
    with server:
        say(f"real llama-server at {server.url} ({model.name}, {SLOTS} slots, {args.threads} thread(s))")
        report = asyncio.run(_calibrate(server.url, args.rounds, say, FleetThread))
    report["setup"].update({"model": str(model), "binary": str(binary), "threads": args.threads})
    args.out.mkdir(parents=True, exist_ok=True)
    real = Summary(**report.pop("_real"))
    emu = Summary(**report.pop("_emulated"))
    (args.out / "calibration.json").write_text(json.dumps(no_nan(report), indent=2) + "\n")
    chart(args.out / "calibration.png", real, emu)
    rows = [Row(**r) for r in report["ratios"]]
    print(table(rows))
    agree = sum(r.ok() for r in rows)
    print(f"\n{agree}/{len(rows)} shapes agree within {TOLERANCE:.0%}; report: {args.out / 'calibration.json'}, "
          f"chart: {args.out / 'calibration.png'}")
    return 0


def no_nan(obj: Any) -> Any:
    """JSON has no NaN: missing figures become null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: no_nan(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [no_nan(v) for v in obj]
    return obj


async def _calibrate(real_url: str, rounds: int, say: Any, fleet_thread: Any) -> dict[str, Any]:
    from gateway.sim import SimSpec

    real_client = Client(real_url)
    try:
        say(f"probe: {PROBE_ROUNDS} rounds on the real server")
        probe = summarize([await run_workload(real_client, -1 - i) for i in range(PROBE_ROUNDS)])
        derived = derive_overrides(probe)
        say("derived: " + ", ".join(f"{k}={v:.6g}" for k, v in derived.items()))
        spec = SimSpec(engine="llamacpp", model=MODEL_NAME, overrides=derived, time_scale=1.0)
        with fleet_thread([spec]) as ft:
            emu_client = Client(ft.fleet.servers[0].url)
            try:
                say(f"probe: {PROBE_ROUNDS} rounds on the emulator")
                emu_probe = summarize([await run_workload(emu_client, -1 - i) for i in range(PROBE_ROUNDS)])
                refined = refine(derived, probe, emu_probe)
                say("refined: " + ", ".join(f"{k}={v:.6g}" for k, v in refined.items() if refined[k] != derived[k]))
            finally:
                await emu_client.close()
        spec = SimSpec(engine="llamacpp", model=MODEL_NAME, overrides=refined, time_scale=1.0)
        real_rounds: list[Workload] = []
        emu_rounds: list[Workload] = []
        with fleet_thread([spec]) as ft:
            emu_client = Client(ft.fleet.servers[0].url)
            try:
                for i in range(1, rounds + 1):
                    say(f"round {i}/{rounds}: real")
                    real_rounds.append(await run_workload(real_client, i))
                    say(f"round {i}/{rounds}: emulated")
                    emu_rounds.append(await run_workload(emu_client, i))
            finally:
                await emu_client.close()
    finally:
        await real_client.close()
    real = summarize(real_rounds)
    emu = summarize(emu_rounds)
    rows = compare(shape_ratios(real), shape_ratios(emu))
    median_rows = compare(shape_ratios(summarize(real_rounds, stat="median")),
                          shape_ratios(summarize(emu_rounds, stat="median")))
    per_round = [
        {"round": i + 1, "real": shape_ratios(summarize([r])), "emulated": shape_ratios(summarize([e]))}
        for i, (r, e) in enumerate(zip(real_rounds, emu_rounds, strict=True))
    ]
    return {
        "setup": {"lengths": list(LENGTHS), "floor_length": FLOOR_LENGTH, "cached_prefixes": list(CACHED_PREFIXES),
                  "sweep_tokens": SWEEP_TOKENS, "decode_tokens": DECODE_TOKENS, "queue_prompt": QUEUE_PROMPT,
                  "queue_tokens": QUEUE_TOKENS, "queue_requests": QUEUE_REQUESTS, "slots": SLOTS,
                  "ctx_per_slot": CTX_PER_SLOT, "rounds": rounds, "tolerance": TOLERANCE,
                  "loadavg_at_end": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "derived_overrides": derived,
        "refined_overrides": refined,
        "emulator_adjustments": ADJUSTMENTS,
        "real": measured_figures(real),
        "emulated": measured_figures(emu),
        "ratios": [{"name": r.name, "real": r.real, "emulated": r.emulated} for r in rows],
        "agreement": {r.name: {"emu/real": r.agreement, "ok": r.ok()} for r in rows},
        "ratios_from_medians": [{"name": r.name, "real": r.real, "emulated": r.emulated,
                                 "emu/real": r.agreement} for r in median_rows],
        "all_agree": all(r.ok() for r in rows),
        "per_round_ratios": per_round,
        "probe": {"real": asdict(probe), "emulated": asdict(emu_probe)},
        "rounds_raw": {"real": [asdict(w) for w in real_rounds], "emulated": [asdict(w) for w in emu_rounds]},
        "_real": asdict(real),
        "_emulated": asdict(emu),
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
