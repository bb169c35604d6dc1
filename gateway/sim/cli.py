"""``python -m gateway.sim``: serve one emulated engine, a fleet, or run the emulator's own benchmark."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.sim.fleet import Fleet, agent_fleet_specs, default_fleet_specs
from gateway.sim.spec import ENGINES, SimSpec


def _parse_set(items: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        out[key.strip()] = float(value)
    return out


def load_fleet_yaml(path: Path) -> list[SimSpec]:
    """``servers: [{engine, model, port, name, profile, api_key, time_scale, metrics, load_seconds, set: {...}}]``
    plus optional top-level ``host``, ``base_port`` (ports default to consecutive) and ``defaults``."""
    import yaml

    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("servers"), list):
        raise SystemExit(f"{path}: expected a mapping with a 'servers' list")
    host = doc.get("host", "127.0.0.1")
    base = int(doc.get("base_port", 18001))
    defaults: dict[str, Any] = dict(doc.get("defaults") or {})
    specs = []
    for i, raw in enumerate(doc["servers"]):
        entry = {**defaults, **raw}
        overrides = entry.pop("set", None) or entry.pop("overrides", None) or {}
        entry.setdefault("host", host)
        entry.setdefault("port", base + i)
        try:
            specs.append(SimSpec(overrides=dict(overrides), **entry))
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"{path}: servers[{i}]: {exc}") from exc
    return specs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway sim", description="Emulated LLM engine servers (no GPU needed).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="one emulated engine server")
    s.add_argument("--engine", choices=ENGINES, required=True)
    s.add_argument("--model", default="sim-llama-2-7b")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--name")
    s.add_argument("--profile")
    s.add_argument("--api-key")
    s.add_argument("--time-scale", type=float, default=1.0)
    s.add_argument("--no-metrics", action="store_true")
    s.add_argument("--no-cache-report", action="store_true")
    s.add_argument("--load-seconds", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--engine-version", help="the release to behave as, where releases differ (SimSpec.version)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a profile parameter")
    s.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer directory (chat template + tokenizer)")
    s.add_argument("--kv-events", metavar="ENDPOINT",
                   help="vLLM/SGLang: publish KV events here (tcp://host:port; tcp://127.0.0.1:* an ephemeral port)")
    s.add_argument("--kv-replay", metavar="ENDPOINT", help="and serve replays here (default: an ephemeral port)")
    s.add_argument("--kv-topic", default="", help="the events' topic")
    t = sub.add_parser("tokenizer", help="write the generated tokenizer directory (a small byte-level BPE)")
    t.add_argument("--out", type=Path, required=True, help="the directory to write (if missing or outdated)")
    f = sub.add_parser("fleet", help="several emulated servers in one process")
    g = f.add_mutually_exclusive_group()
    g.add_argument("--config", type=Path, help="fleet YAML")
    g.add_argument("--default", action="store_true", help="one server per engine (the default)")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--base-port", type=int, default=18001)
    f.add_argument("--time-scale", type=float, default=1.0)
    f.add_argument("--agents", action="store_true",
                   help="with --default: also one server per engine serving sim-agent (128k context, tool calls)")
    b = sub.add_parser("bench", help="measure the emulator's own cost (tokens/s, streams, CPU per 1k tokens)")
    b.add_argument("--streams", type=int, default=500)
    b.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    b.add_argument("--step-ms", type=float, default=20.0, help="emulated decode step (flat) in ms")
    b.add_argument("--port", type=int, default=18100)
    return p


async def _serve(specs: list[SimSpec]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    fleet = Fleet(specs)
    await fleet.start()
    for server in fleet.servers:
        spec = server.spec
        events = ""
        if server.kv_events_endpoint:
            events = f" kv_events={server.kv_events_endpoint} kv_replay={server.kv_replay_endpoint}"
        print(f"EMULATED {spec.engine} engine (not a real model server): {server.url} model={spec.model} "
              f"name={spec.name} profile={spec.profile} time_scale={spec.time_scale}{events}", flush=True)
    try:
        await stop.wait()
    finally:
        await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "bench":
        from gateway.sim.bench import run_bench

        return run_bench(args.streams, args.tokens, args.step_ms, args.port)
    if args.cmd == "tokenizer":
        from gateway.sim.tokenizer_files import ensure_tokenizer

        print(ensure_tokenizer(args.out))
        return 0
    if args.cmd == "serve":
        kv = None
        if args.kv_events:
            kv = {"endpoint": args.kv_events, "topic": args.kv_topic,
                  **({"replay_endpoint": args.kv_replay} if args.kv_replay else {})}
        try:
            specs = [SimSpec(engine=args.engine, model=args.model, host=args.host, port=args.port, name=args.name,
                             profile=args.profile, api_key=args.api_key, time_scale=args.time_scale,
                             metrics=not args.no_metrics, cache_report=not args.no_cache_report,
                             load_seconds=args.load_seconds, seed=args.seed, overrides=_parse_set(args.set),
                             kv_events=kv, tokenizer=str(args.tokenizer) if args.tokenizer else None,
                             version=args.engine_version)]
        except ValueError as exc:
            raise SystemExit(f"gateway sim serve: {exc}") from None
    elif args.config is not None:
        if args.agents:
            raise SystemExit("gateway sim fleet: --agents goes with --default (a fleet file lists its own servers)")
        specs = load_fleet_yaml(args.config)
    else:
        specs = default_fleet_specs(args.host, args.base_port, time_scale=args.time_scale)
        if args.agents:
            specs += agent_fleet_specs(args.host, args.base_port, time_scale=args.time_scale)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is optional
        runner = asyncio.run
    try:
        runner(_serve(specs))
    except OSError as exc:
        print(f"gateway sim: {exc}", file=sys.stderr)
        return 1
    return 0
