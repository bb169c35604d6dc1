"""``gateway bench soak``: many short requests through a gateway process, its memory sampled on the way.

Processes (all on this machine): the raw backend (:mod:`gateway.bench.rawbackend`, ``--tokens`` events with no
gap: almost no CPU), the gateway as users run it (``python -m gateway serve --config FILE``) and the load
generator (this process: aiohttp, closed loop at ``--concurrency``). Every ``--sample-every`` requests the
gateway's resident set size (VmRSS from /proc) is sampled. A request counts as complete when it answers 200
and its stream ends with ``data: [DONE]``; ``lost`` counts requests sent that never completed (errors,
timeouts, cut streams).

Report (``soak.json`` and ``soak.png`` under ``--out``, default ``reports/soak``): RSS before the first
request, after the warm-up (``--warmup`` share of the requests) and at the end, the slope of RSS against
requests after the warm-up (least squares, KiB per 1,000 requests), requests lost, errors, throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.bench.faults import free_ports, rss_bytes
from gateway.bench.overhead import MODEL, gateway_yaml
from gateway.bench.procs import ChildProcess


@dataclass
class SoakConfig:
    requests: int = 100_000
    concurrency: int = 32
    tokens: int = 4
    stream: bool = True
    sample_every: int = 1000
    warmup: float = 0.1  # share of the requests before memory is expected flat
    timeout: float = 30.0
    out: Path = Path("reports/soak")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) against requests; 0 with fewer than two points."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in points) / den


async def _load(cfg: SoakConfig, url: str, pid: int, log: Any) -> dict[str, Any]:
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": cfg.tokens, "stream": cfg.stream})
    headers = {"Content-Type": "application/json"}
    samples: list[tuple[int, int, float]] = [(0, rss_bytes(pid), 0.0)]
    counts = {"sent": 0, "complete": 0, "errors": 0, "timeouts": 0}
    errors: dict[str, int] = {}
    started = time.monotonic()
    next_sample = cfg.sample_every
    report_every = max(cfg.requests // 10, 1)

    async def one(session: aiohttp.ClientSession) -> None:
        try:
            async with asyncio.timeout(cfg.timeout):
                async with session.post(url, data=body, headers=headers) as resp:
                    raw = await resp.read()
            ok = resp.status == 200 and (raw.endswith(b"data: [DONE]\n\n") if cfg.stream else raw.startswith(b"{"))
            if ok:
                counts["complete"] += 1
                return
            key = f"HTTP {resp.status}: {raw[-120:].decode('utf-8', 'replace')}"
        except TimeoutError:
            counts["timeouts"] += 1
            key = "timeout"
        except aiohttp.ClientError as exc:
            key = f"{type(exc).__name__}: {exc}"
        counts["errors"] += 1
        errors[key] = errors.get(key, 0) + 1

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_sample
        while counts["sent"] < cfg.requests:
            counts["sent"] += 1
            await one(session)
            done = counts["complete"] + counts["errors"]
            if done >= next_sample:
                next_sample += cfg.sample_every
                samples.append((done, rss_bytes(pid), time.monotonic() - started))
                if done % report_every < cfg.sample_every:
                    log(f"  {done:>7} requests  RSS {samples[-1][1] / 2**20:6.1f} MiB  "
                        f"{done / (time.monotonic() - started):6.0f} req/s  errors {counts['errors']}")

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session) for _ in range(cfg.concurrency)))
    wall = time.monotonic() - started
    await asyncio.sleep(1.0)  # let the gateway settle, then one last sample
    done = counts["complete"] + counts["errors"]
    samples.append((done, rss_bytes(pid), time.monotonic() - started))
    return {"counts": counts, "errors": errors, "samples": samples, "wall_s": wall}


def run_soak(cfg: SoakConfig, log: Any = print) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    bport, gport = free_ports(2)
    backend_url, gateway_url = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{gport}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "gateway.yaml"
        config.write_text(gateway_yaml(backend_url, gport) + "access_log:\n  enabled: false\n")
        backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(bport),
                                               "--tokens", str(cfg.tokens), "--gap-ms", "0", "--model", MODEL],
                               cfg.out / "backend.log")
        gateway = ChildProcess("gateway", [py, "-m", "gateway", "serve", "--config", str(config),
                                           "--log-level", "warning"], cfg.out / "gateway.log")
        with backend, gateway:
            backend.wait_http(backend_url + "/health")
            gateway.wait_http(gateway_url + "/health")
            log(f"soak: {cfg.requests:,} requests at concurrency {cfg.concurrency} through the gateway "
                f"(pid {gateway.pid}), RSS sampled every {cfg.sample_every:,}")
            result = asyncio.run(_load(cfg, gateway_url + "/v1/chat/completions", gateway.pid, log))
    samples: list[tuple[int, int, float]] = result["samples"]
    warm_at = int(cfg.requests * cfg.warmup)
    after = [(n, rss) for n, rss, _ in samples if n >= warm_at]
    warm_rss = after[0][1] if after else samples[-1][1]
    counts = result["counts"]
    lost = counts["sent"] - counts["complete"]
    mib = 2**20
    doc: dict[str, Any] = {
        "schema": "gateway-bench-soak/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "requests": counts["sent"], "complete": counts["complete"], "requests_lost": lost,
        "errors": counts["errors"], "timeouts": counts["timeouts"], "error_samples": dict(list(
            sorted(result["errors"].items(), key=lambda kv: -kv[1]))[:5]),
        "wall_s": round(result["wall_s"], 1), "requests_per_s": round(counts["sent"] / result["wall_s"], 1),
        "rss_mib": {"before": round(samples[0][1] / mib, 2), "after_warmup": round(warm_rss / mib, 2),
                    "end": round(samples[-1][1] / mib, 2), "max": round(max(s[1] for s in samples) / mib, 2)},
        "warmup_requests": warm_at,
        "slope_kib_per_1k_requests_after_warmup": round(slope(after) * 1000 / 1024, 3),
        "slope_kib_per_1k_requests_last_half": round(slope(after[len(after) // 2:]) * 1000 / 1024, 3),
        "growth_after_warmup_mib": round((samples[-1][1] - warm_rss) / mib, 2),
        "samples": [{"requests": n, "rss_mib": round(r / mib, 2), "t_s": round(t, 2)} for n, r, t in samples],
    }
    (cfg.out / "soak.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plot_soak(doc, cfg.out / "soak.png")
    return doc


def plot_soak(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["requests"] for s in doc["samples"]]
    ys = [s["rss_mib"] for s in doc["samples"]]
    fig, ax = plt.subplots(figsize=(10, 5))
    ax.plot(xs, ys, marker=".", label="gateway RSS")
    ax.axvline(doc["warmup_requests"], color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("requests completed")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(0, max(ys) * 1.2)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"soak: {doc['requests']:,} requests, lost {doc['requests_lost']}, slope after warm-up "
                 f"{doc['slope_kib_per_1k_requests_after_warmup']:.1f} KiB / 1k requests")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4, help="events per streamed answer")
    p.add_argument("--no-stream", action="store_true", help="non-streamed requests")
    p.add_argument("--sample-every", type=int, default=1000, help="requests between RSS samples")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the requests counted as warm-up")
    p.add_argument("--out", type=Path, default=Path("reports/soak"))
    a = p.parse_args(argv)
    cfg = SoakConfig(requests=a.requests, concurrency=a.concurrency, tokens=a.tokens, stream=not a.no_stream,
                     sample_every=a.sample_every, warmup=a.warmup, out=a.out)
    doc = run_soak(cfg)
    r = doc["rss_mib"]
    print(f"requests {doc['requests']:,}, lost {doc['requests_lost']}, errors {doc['errors']}, "
          f"{doc['requests_per_s']:.0f} req/s; RSS MiB before {r['before']}, after warm-up {r['after_warmup']}, "
          f"end {r['end']}; slope after warm-up {doc['slope_kib_per_1k_requests_after_warmup']} KiB/1k requests")
    print(f"wrote {cfg.out / 'soak.json'} and {cfg.out / 'soak.png'}")
    return 0 if doc["requests_lost"] == 0 else 1
