"""``gateway bench overhead``: what the gateway adds to a stream, against the backend directly and against a
Rust router in front of the same backend, in the same run: SMG (Shepherd Model Gateway, PyPI ``smg``, the
SGLang router's successor) when installed, else the SGLang model gateway (PyPI ``sglang-router``).

Processes (all on this machine): the raw backend (:mod:`gateway.bench.rawbackend`: 16 tokens 5 ms apart,
almost no CPU per token), the gateway as users run it (``python -m gateway serve --config FILE``), the
Rust router (``python -m smg.launch_router`` or ``python -m sglang_router.launch_router``, ``--worker-urls URL
--policy round_robin``) when installed, and the load
generator (this process: aiohttp on uvloop). At each concurrency level (closed loop; default 1, 16, 64, 256)
the targets are interleaved round by round. Measured at the client: added TTFT p50/p99 and added mean
inter-chunk gap against direct, streamed chunks/s; from /proc: the gateway's (and router's) CPU time per
request and per chunk. Then ``hold`` streams (default 1,000) are opened at once through each proxy and held
for a few seconds; the backend reports how many it had open at once. Optionally py-spy samples the gateway
under load (``--py-spy SECONDS``) and the report ranks its hottest functions.

``--tracing`` adds a second gateway process with OpenTelemetry tracing on (``OTEL_EXPORTER_OTLP_ENDPOINT``
pointing at a loopback OTLP/HTTP sink in its own process that answers 200 and discards every export; never a
remote collector), interleaved with the others at the same levels, and reports what tracing adds per request:
TTFT p50/p99 and end-to-end p50 against the untraced gateway (microseconds, and the gateway's added TTFT over
direct with tracing / without) and CPU per request from /proc. The untraced gateway then runs with
``OTEL_SDK_DISABLED=true``, so an ``OTEL_*`` variable in the caller's environment cannot turn it on.

Writes ``overhead.json`` and ``overhead.png`` (and the processes' logs) under ``--out`` (``reports/overhead``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.bench.client import Target
from gateway.bench.procs import ChildProcess, get_json
from gateway.bench.pyspy import start_record, top_frames
from gateway.bench.report import build_report, write_json
from gateway.bench.runner import Arrival, run, run_sync
from gateway.bench.workload import BenchRequest

MODEL = "bench-model"
TRACED = "gateway+tracing"


@dataclass
class OverheadConfig:
    levels: list[int] = field(default_factory=lambda: [1, 16, 64, 256])
    rounds: int = 3
    min_round: int = 24  # requests per target per round, at least (and at least 2x the level)
    tokens: int = 16
    gap_ms: float = 5.0
    hold: int = 1000
    hold_seconds: float = 3.0
    rust: bool = True
    reference: str = "auto"  # the Rust router: "smg", "sglang-router", or "auto" (smg when installed)
    py_spy_seconds: float = 0.0
    py_spy_concurrency: int = 64
    tracing: bool = False
    base_port: int = 18500
    out: Path = Path("reports/overhead")


def requests_for(n: int, tokens: int, extra: dict[str, Any] | None = None) -> list[BenchRequest]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Say something short."}], "max_tokens": tokens,
                            **(extra or {})}
    return [BenchRequest(index=i, body=body, prompt_words=3, output_len=tokens) for i in range(n)]


def gateway_yaml(backend_url: str, port: int) -> str:
    return (f"server:\n  host: 127.0.0.1\n  port: {port}\n"
            f"backends:\n  - name: raw\n    engine: openai\n    url: {backend_url}\n"
            f"    models: [{MODEL}]\n    max_concurrency: 4096\n"
            "routing:\n  policy: least-load\n")


def level_row(doc: dict[str, Any], direct: str) -> dict[str, Any]:
    """The figures of one level: per target, absolute and added against ``direct``."""
    out: dict[str, Any] = {}
    ref = doc["targets"][direct]
    for name, t in doc["targets"].items():
        m = t["metrics"]
        row = {
            "ok": t["ok"], "requests": t["requests"], "errors": t["errors"],
            "ttfb_ms_p50": _ms(m["ttfb_s"]["p50"]), "ttft_ms_p50": _ms(m["ttft_s"]["p50"]),
            "ttft_ms_p99": _ms(m["ttft_s"]["p99"]), "e2e_ms_p50": _ms(m.get("e2e_s", {}).get("p50")),
            "itl_ms_mean": _ms(m["itl_s"]["mean"]), "itl_ms_p99": _ms(m["itl_s"]["p99"]),
            "chunks_per_s": t["chunks_per_s"], "cpu_ms_per_request": t["cpu_ms_per_request"],
            "cpu_us_per_chunk": t["cpu_us_per_chunk"],
        }
        if name != direct:
            rm = ref["metrics"]
            row["added_ttft_ms_p50"] = _diff(m["ttft_s"]["p50"], rm["ttft_s"]["p50"])
            row["added_ttft_ms_p99"] = _diff(m["ttft_s"]["p99"], rm["ttft_s"]["p99"])
            row["added_itl_ms_mean"] = _diff(m["itl_s"]["mean"], rm["itl_s"]["mean"])
        out[name] = row
    return out


def tracing_cost(levels: dict[str, Any], untraced: str = "gateway", traced: str = TRACED) -> dict[str, Any]:
    """Per level, what the traced gateway adds over the untraced one, per request: microseconds and ratios
    (above 1: tracing costs). ``added_ttft_over_direct_x``: the gateway's added TTFT p50 over direct, with
    tracing / without."""
    out: dict[str, Any] = {}
    for level, rows in levels.items():
        off, on = rows.get(untraced), rows.get(traced)
        if off is None or on is None:
            continue
        out[level] = {
            "ttft_us_p50": _us_diff(on["ttft_ms_p50"], off["ttft_ms_p50"]),
            "ttft_us_p99": _us_diff(on["ttft_ms_p99"], off["ttft_ms_p99"]),
            "e2e_us_p50": _us_diff(on.get("e2e_ms_p50"), off.get("e2e_ms_p50")),
            "ttft_p50_x": _ratio(on["ttft_ms_p50"], off["ttft_ms_p50"]),
            "e2e_p50_x": _ratio(on.get("e2e_ms_p50"), off.get("e2e_ms_p50")),
            "added_ttft_over_direct_x": _ratio(on.get("added_ttft_ms_p50"), off.get("added_ttft_ms_p50")),
            "cpu_us_per_request": _us_diff(on["cpu_ms_per_request"], off["cpu_ms_per_request"]),
            "cpu_per_request_x": _ratio(on["cpu_ms_per_request"], off["cpu_ms_per_request"]),
        }
    return out


def _us_diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 1000 * (a - b)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _ms(v: float | None) -> float | None:
    return None if v is None else 1000 * v


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else 1000 * (a - b)


async def _measure(targets: list[Target], cfg: OverheadConfig, log: Any) -> dict[str, Any]:
    levels: dict[str, Any] = {}
    for level in cfg.levels:
        per_round = max(cfg.min_round, 2 * level)
        reqs = requests_for(per_round * cfg.rounds, cfg.tokens)
        started = time.perf_counter()
        result = await run(targets, reqs, Arrival(concurrency=level), round_size=per_round, warmup=level,
                           request_timeout=120)
        doc = build_report(result, {"level": level}, include_requests=False)
        levels[str(level)] = level_row(doc, targets[0].name)
        log(f"  {level:>4} streams: {time.perf_counter() - started:5.1f} s  " + "  ".join(
            f"{n}: ttft p50 {r['ttft_ms_p50']:.2f} ms" for n, r in levels[str(level)].items()
            if r["ttft_ms_p50"] is not None))
    return levels


async def _hold(targets: list[Target], backend_url: str, cfg: OverheadConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gap = 1000 * cfg.hold_seconds / cfg.tokens
    reqs = requests_for(cfg.hold, cfg.tokens, {"bench_gap_ms": gap})
    for target in targets:
        get_json(backend_url + "/stats/reset", method="POST")
        result = await run([target], reqs, Arrival(concurrency=cfg.hold), request_timeout=120)
        stats = get_json(backend_url + "/stats")
        rs = result.results[target.name]
        ok = sum(1 for r in rs if r.ok and r.chunks == cfg.tokens)
        errors = sorted({r.error or "incomplete" for r in rs if not (r.ok and r.chunks == cfg.tokens)})[:3]
        out[target.name] = {"streams": len(rs), "complete": ok, "errors": len(rs) - ok, "error_samples": errors,
                            "backend_peak_open": stats["peak_streams"] if isinstance(stats, dict) else None,
                            "wall_s": result.wall(target.name)}
    return out


def _traced_gateway(cfg: OverheadConfig, backend_url: str) -> tuple[ChildProcess, ChildProcess, str]:
    """The gateway again, on ``base_port + 3``, with tracing exported to an OTLP sink on ``base_port + 4``."""
    py = sys.executable
    port, sink_port = cfg.base_port + 3, cfg.base_port + 4
    sink_url = f"http://127.0.0.1:{sink_port}"
    code = f"from gateway.bench.overhead import otlp_sink; otlp_sink({sink_port})"
    sink = ChildProcess("otlp sink", [py, "-c", code], cfg.out / "otlp-sink.log")
    config_file = cfg.out / "gateway-tracing.yaml"
    config_file.write_text(gateway_yaml(backend_url, port))
    env = ["env", "OTEL_SDK_DISABLED=false", "OTEL_TRACES_EXPORTER=otlp", f"OTEL_EXPORTER_OTLP_ENDPOINT={sink_url}",
           f"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT={sink_url}/v1/traces", "OTEL_SERVICE_NAME=llm-gateway-bench"]
    traced = ChildProcess(TRACED, [*env, py, "-m", "gateway", "serve", "--config", str(config_file),
                                   "--log-level", "warning"], cfg.out / "gateway-tracing.log")
    return traced, sink, sink_url


def otlp_sink(port: int) -> None:
    """An OTLP/HTTP endpoint on 127.0.0.1:``port`` that answers every POST with 200 and an empty body and
    keeps nothing; ``GET /stats`` says how many exports (and bytes) it received. Runs until killed."""
    import json

    counts = {"exports": 0, "bytes": 0}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                method, path = [*head[0].split(" "), "", ""][:2]
                length = next((int(v) for k, _, v in (h.partition(":") for h in head[1:])
                               if k.strip().lower() == "content-length"), 0)
                body = await reader.readexactly(length) if length else b""
                payload, kind = b"", b"application/x-protobuf"
                if method == "GET" and path == "/stats":
                    payload, kind = json.dumps(counts).encode(), b"application/json"
                else:
                    counts["exports"] += 1
                    counts["bytes"] += len(body)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (kind, len(payload), payload))
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def serve() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


async def _profile_gateway(target: Target, cfg: OverheadConfig) -> dict[str, Any]:
    out_file = cfg.out / "gateway-pyspy.txt"
    assert target.pid is not None
    proc = start_record(target.pid, cfg.py_spy_seconds, out_file)
    if proc is None:
        return {"error": "py-spy is not installed"}
    await asyncio.sleep(1.0)  # py-spy attaches
    reqs = requests_for(100_000, cfg.tokens)
    arrival = Arrival(concurrency=cfg.py_spy_concurrency, duration=cfg.py_spy_seconds)
    result = await run([target], reqs, arrival, request_timeout=120)
    _, err = await asyncio.to_thread(proc.communicate)
    if proc.returncode != 0 or not out_file.exists():
        return {"error": f"py-spy failed ({proc.returncode}): {err.decode(errors='replace')[-500:]}"}
    text = out_file.read_text()
    return {
        "file": str(out_file), "concurrency": cfg.py_spy_concurrency, "requests": len(result.results[target.name]),
        "top_self": [asdict(f) for f in top_frames(text, 25, by="self")],
        "top_total": [asdict(f) for f in top_frames(text, 40, by="total")],
    }


def plot_overhead(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(int(k) for k in doc["levels"])
    names = list(next(iter(doc["levels"].values())))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("added_ttft_ms_p50", "added TTFT p50 (ms)"), ("added_ttft_ms_p99", "added TTFT p99 (ms)"),
              ("chunks_per_s", "streamed chunks/s"), ("cpu_us_per_chunk", "proxy CPU per chunk (us)")]
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        for name in names:
            ys = [doc["levels"][str(lv)][name].get(key) for lv in levels]
            pts = [(lv, y) for lv, y in zip(levels, ys, strict=True) if y is not None and math.isfinite(y)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"proxy overhead: {doc['config']['tokens']} tokens {doc['config']['gap_ms']} ms apart, "
                 "raw asyncio backend")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


REFERENCES = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}


def rust_reference(py: str, wanted: str) -> tuple[str, str] | None:
    """(name, module) of the Rust router to measure against: ``wanted``, or with "auto" SMG when installed,
    else sglang-router; None when it is not installed."""
    bindir = Path(py).parent
    for name in (["smg", "sglang-router"] if wanted == "auto" else [wanted]):
        if shutil.which(name) is not None or (bindir / name).exists():
            return name, REFERENCES[name]
    return None


def run_overhead(cfg: OverheadConfig, log: Any = print) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    backend_port, gateway_port, router_port = cfg.base_port, cfg.base_port + 1, cfg.base_port + 2
    backend_url = f"http://127.0.0.1:{backend_port}"
    backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(backend_port),
                                           "--tokens", str(cfg.tokens), "--gap-ms", str(cfg.gap_ms),
                                           "--model", MODEL], cfg.out / "backend.log")
    config_file = cfg.out / "gateway.yaml"
    config_file.write_text(gateway_yaml(backend_url, gateway_port))
    # with --tracing, the untraced gateway is made sure to be untraced whatever OTEL_* the caller has set
    untraced_env = ["env", "OTEL_SDK_DISABLED=true"] if cfg.tracing else []
    gateway = ChildProcess("gateway", [*untraced_env, py, "-m", "gateway", "serve", "--config", str(config_file),
                                       "--log-level", "warning"], cfg.out / "gateway.log")
    traced, sink, sink_url = _traced_gateway(cfg, backend_url) if cfg.tracing else (None, None, "")
    router: ChildProcess | None = None
    reference = rust_reference(py, cfg.reference) if cfg.rust else None
    if cfg.rust and reference is None:
        log(f"no Rust router installed (pip install smg, or sglang-router) for --reference {cfg.reference}: "
            "running without the Rust reference")
    if reference is not None:
        name, module = reference
        router = ChildProcess(name, [py, "-m", module, "--host", "127.0.0.1", "--port", str(router_port),
                                     "--worker-urls", backend_url, "--policy", "round_robin", "--log-level", "warn"],
                              cfg.out / "router.log")
    probe = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' % MODEL.encode()
    try:
        backend.start().wait_http(backend_url + "/health")
        gateway.start().wait_http(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", method="POST", body=probe)
        targets = [Target("direct", backend_url, MODEL, pid=backend.pid),
                   Target("gateway", f"http://127.0.0.1:{gateway_port}", MODEL, pid=gateway.pid)]
        if traced is not None and sink is not None:
            sink.start().wait_http(sink_url + "/stats")
            traced_url = f"http://127.0.0.1:{cfg.base_port + 3}"
            traced.start().wait_http(traced_url + "/v1/chat/completions", method="POST", body=probe)
            targets.append(Target(TRACED, traced_url, MODEL, pid=traced.pid))
        if router is not None:
            router.start().wait_http(f"http://127.0.0.1:{router_port}/v1/chat/completions", method="POST",
                                     body=probe)
            targets.append(Target(router.name, f"http://127.0.0.1:{router_port}", MODEL, pid=router.pid))
        log(f"targets: {', '.join(t.name for t in targets)}; levels {cfg.levels}, {cfg.rounds} rounds")
        doc: dict[str, Any] = {"schema": "gateway-bench-overhead/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}}
        doc["levels"] = run_sync(_measure(targets, cfg, log))
        max_cps = {t.name: max((r[t.name]["chunks_per_s"] or 0) for r in doc["levels"].values()) for t in targets}
        doc["max_chunks_per_s"] = max_cps
        if cfg.hold:
            log(f"holding {cfg.hold} streams for ~{cfg.hold_seconds:.0f} s through each target")
            doc["hold"] = run_sync(_hold(targets, backend_url, cfg))
        if cfg.py_spy_seconds > 0:
            log(f"py-spy on the gateway for {cfg.py_spy_seconds:.0f} s at {cfg.py_spy_concurrency} streams")
            doc["py_spy"] = run_sync(_profile_gateway(targets[1], cfg))
        if traced is not None:
            doc["tracing"] = {"exporter": "OTLP/HTTP (protobuf) to a loopback sink that discards",
                              "levels": tracing_cost(doc["levels"]), "sink": get_json(sink_url + "/stats")}
    finally:
        for proc in (router, traced, sink, gateway, backend):
            if proc is not None:
                proc.stop()
    write_json(doc, cfg.out / "overhead.json")
    plot_overhead(doc, cfg.out / "overhead.png")
    return doc


def print_overhead(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    table = Table(title="added by each proxy, against the backend directly (ms; CPU from /proc)")
    for col in ("streams", "target", "ok", "TTFT p50", "TTFT p99", "added TTFT p50", "added TTFT p99",
                "added gap mean", "chunks/s", "CPU ms/req", "CPU us/chunk"):
        table.add_column(col, justify="right")

    def f(v: Any, d: int = 2) -> str:
        return "-" if v is None else f"{v:,.{d}f}"

    for level, rows in doc["levels"].items():
        for name, r in rows.items():
            table.add_row(level, name, f"{r['ok']}/{r['requests']}", f(r["ttft_ms_p50"]), f(r["ttft_ms_p99"]),
                          f(r.get("added_ttft_ms_p50")), f(r.get("added_ttft_ms_p99")),
                          f(r.get("added_itl_ms_mean"), 3), f(r["chunks_per_s"], 0),
                          f(r["cpu_ms_per_request"] if name != "direct" else None, 3),
                          f(r["cpu_us_per_chunk"] if name != "direct" else None, 1))
    console.print(table)
    if "hold" in doc:
        for name, h in doc["hold"].items():
            console.print(f"hold {name}: {h['complete']}/{h['streams']} complete, backend peak open "
                          f"{h['backend_peak_open']}" + (f"; e.g. {h['error_samples'][0]}" if h["error_samples"]
                                                         else ""))
    if "tracing" in doc:
        print_tracing(console, doc["tracing"])
    spy = doc.get("py_spy")
    if spy and "top_self" in spy:
        t = Table(title=f"gateway hot path (py-spy, {spy['concurrency']} streams): top self time")
        t.add_column("self %", justify="right")
        t.add_column("total %", justify="right")
        t.add_column("function")
        for fr in spy["top_self"][:15]:
            t.add_row(f"{100 * fr['self_share']:.1f}", f"{100 * fr['total_share']:.1f}", fr["frame"])
        console.print(t)
    elif spy:
        console.print(f"py-spy: {spy.get('error')}")


def print_tracing(console: Any, tracing: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"what tracing adds per request ({tracing['exporter']}), against the same gateway untraced")
    for col in ("streams", "TTFT p50 us", "TTFT p99 us", "E2E p50 us", "TTFT p50 x", "added over direct x",
                "CPU us/req", "CPU/req x"):
        table.add_column(col, justify="right")

    def f(v: Any, d: int = 0) -> str:
        return "-" if v is None else f"{v:,.{d}f}"

    for level, r in tracing["levels"].items():
        table.add_row(level, f(r["ttft_us_p50"]), f(r["ttft_us_p99"]), f(r["e2e_us_p50"]), f(r["ttft_p50_x"], 3),
                      f(r["added_ttft_over_direct_x"], 2), f(r["cpu_us_per_request"]), f(r["cpu_per_request_x"], 3))
    console.print(table)
    sink = tracing.get("sink")
    if isinstance(sink, dict):
        console.print(f"OTLP sink received {sink.get('exports')} exports ({sink.get('bytes', 0):,} bytes)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="1,16,64,256", help="concurrency levels (default 1,16,64,256)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-round", type=int, default=24, help="requests per target per round, at least")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--hold", type=int, default=1000, help="streams held at once at the end (0: skip)")
    p.add_argument("--hold-seconds", type=float, default=3.0)
    p.add_argument("--no-rust", action="store_true", help="without the Rust router reference")
    p.add_argument("--reference", choices=["auto", *REFERENCES], default="auto",
                   help="the Rust router to measure against (auto: smg when installed, else sglang-router)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS", help="profile the gateway under load")
    p.add_argument("--py-spy-concurrency", type=int, default=64)
    p.add_argument("--tracing", action="store_true",
                   help="also a gateway with OpenTelemetry tracing on, exporting to a loopback OTLP sink that "
                        "discards (ports base+3 and base+4); reports what tracing adds per request")
    p.add_argument("--base-port", type=int, default=18500, help="backend, gateway, router on 3 consecutive ports")
    p.add_argument("--out", type=Path, default=Path("reports/overhead"))
    a = p.parse_args(argv)
    cfg = OverheadConfig(levels=[int(x) for x in a.levels.split(",") if x], rounds=a.rounds, min_round=a.min_round,
                         tokens=a.tokens, gap_ms=a.gap_ms, hold=a.hold, hold_seconds=a.hold_seconds,
                         rust=not a.no_rust, reference=a.reference, py_spy_seconds=a.py_spy,
                         py_spy_concurrency=a.py_spy_concurrency,
                         tracing=a.tracing, base_port=a.base_port, out=a.out)
    doc = run_overhead(cfg)
    print_overhead(doc)
    print(f"wrote {cfg.out / 'overhead.json'} and {cfg.out / 'overhead.png'}")
    return 0
