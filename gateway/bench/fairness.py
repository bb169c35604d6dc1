"""``gateway bench fairness``: flow control under contention, on an emulated fleet through a gateway process.

The fleet (emulated vLLM servers in a child process, the gateway as users run it, ``python -m gateway serve``)
has ``--backends`` backends of ``--slots`` slots each (their ``max_concurrency``): every request beyond those
waits in the gateway's queue. Requests are streamed chats of ``--tokens`` tokens on average (``ignore_eos``,
uniform over half to one and a half times that). The
fleet's capacity is measured first (a closed loop of twice the slots: requests completed per second), never
taken from the emulator's settings; every rate below is a share of that measurement.

Scenarios, each ``--seconds`` long, open loop (Poisson arrivals) unless said:

* ``alone``: key B at 20% of capacity, nothing else: B's time to first token on its own.
* ``noisy``: key A at 500% (ignoring its 429s and their Retry-After, the worst neighbour) and, once A's flood
  is under way (a quarter of the scenario, at most 5 s: its first burst takes every slot at once, and no
  scheduler that does not preempt frees one before the first answers end), B at 20%: B's TTFT p99 against
  ``alone`` (target: within 1.5x), B's 429s (target: none), A's 429s and whether each carried Retry-After.
  Beside it, the engines' own mean TTFT (``vllm:time_to_first_token_seconds``, every admitted request's) while
  B ran over alone's, against B's mean TTFT over alone's at the client: how much of B's slower first token
  the engines' fuller batches explain, which no admission order can take away.
* ``priority``: ``critical`` traffic (key ops, x-gateway-priority: critical) at 30% and ``sheddable`` traffic
  (key batch, whose band it is) at 200%: critical's wait for admission, p99 (target: under 50 ms), from the
  gateway's ``gateway_admission_wait_seconds`` histogram; sheddable's completions (target: some). The
  sheddable band's ``max_saturation`` (``--sheddable-share``, 0.7: the rest beside critical's 30%; the
  gateway's default is 0.9) keeps the other slots for the bands above it.
* ``weights``: keys W3 and W1 (weights 3 and 1), each a closed loop of twice as many users as the fleet has
  slots (so both stay queued: a key with too few users cannot fill its share): requests admitted per second after
  the first quarter (the start, when whoever came first took every slot, is left out), from the gateway's
  ``gateway_admissions_total``, W3 over W1 (target: 3 within 10%).

Between scenarios the benchmark waits until the gateway holds nothing (a flood's backlog waits up to its 30 s
deadline), so one scenario's leftovers are not the next one's load.

Writes ``fairness.json`` (every figure) and ``fairness.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.bench.client import SSEEvents, has_content
from gateway.bench.faults.fakes import free_ports
from gateway.bench.procs import ChildProcess

MODEL = "fair"
KEYS = {"A": "sk-bench-a", "B": "sk-bench-b", "ops": "sk-bench-ops", "batch": "sk-bench-batch",
        "W3": "sk-bench-w3", "W1": "sk-bench-w1"}


@dataclass
class Outcome:
    key: str
    start: float
    status: int = 0
    ttft: float = math.nan
    e2e: float = math.nan
    retry_after: str | None = None
    error: str | None = None


@dataclass
class Config:
    backends: int = 2
    slots: int = 32
    tokens: int = 64
    time_scale: float = 0.25
    sheddable_share: float = 0.7
    seconds: float = 20.0
    out: Path = field(default_factory=lambda: Path("reports/fairness"))


def fleet_yaml(ports: list[int], cfg: Config) -> str:
    servers = "".join(f"  - {{engine: vllm, model: {MODEL}, name: v{i}, port: {port}}}\n"
                      for i, port in enumerate(ports))
    return f"defaults: {{time_scale: {cfg.time_scale}}}\nservers:\n{servers}"


def gateway_yaml(ports: list[int], gport: int, cfg: Config) -> str:
    backends = "".join(f"  - {{name: v{i}, engine: vllm, url: 'http://127.0.0.1:{port}', models: [{MODEL}], "
                       f"max_concurrency: {cfg.slots}}}\n" for i, port in enumerate(ports))
    keys = {"A": "", "B": "", "ops": ", max_priority: critical", "batch": ", priority: sheddable",
            "W3": ", weight: 3", "W1": ", weight: 1"}
    # the sheddable band may fill 70% of the slots: it "saturates the rest" beside critical traffic at 30%
    bands = ("  bands: {critical: {priority: 100}, standard: {priority: 0}, "
             f"sheddable: {{priority: -100, max_saturation: {cfg.sheddable_share}}}}}\n")
    auth = "".join(f"    - {{name: {name}, key_sha256: {hashlib.sha256(KEYS[name].encode()).hexdigest()}{extra}}}\n"
                   for name, extra in keys.items())
    return (f"server: {{port: {gport}}}\nbackends:\n{backends}"
            f"auth:\n  keys:\n{auth}"
            f"admission:\n  queue_size: 4096\n  max_wait_seconds: 30\n{bands}"
            "scrape: {interval: 0.5}\naccess_log: {enabled: false}\n")


async def one(session: aiohttp.ClientSession, url: str, key: str, cfg: Config, started: float,
              headers: dict[str, str] | None = None) -> Outcome:
    out = Outcome(key, time.monotonic() - started)
    # lengths vary (uniform over half to one and a half --tokens): answers of one length started together would
    # end together, and slots would free in bursts a whole answer apart
    tokens = random.randint(max(1, cfg.tokens // 2), max(1, cfg.tokens * 3 // 2))
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{key} {random.random()}"}],
                         "max_tokens": tokens, "ignore_eos": True, "stream": True})
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", data=body,
                                headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key]}",
                                         **(headers or {})},
                                timeout=aiohttp.ClientTimeout(total=120)) as resp:
            out.status = resp.status
            out.retry_after = resp.headers.get("retry-after")
            if resp.status != 200:
                await resp.read()
                out.e2e = time.perf_counter() - t0
                return out
            events = SSEEvents()
            async for data in resp.content.iter_any():
                for payload in events.feed(data):
                    if payload != b"[DONE]" and math.isnan(out.ttft) and has_content(orjson.loads(payload)):
                        out.ttft = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.e2e = time.perf_counter() - t0
    return out


async def open_loop(session: aiohttp.ClientSession, url: str, key: str, rate: float, seconds: float, cfg: Config,
                    started: float, headers: dict[str, str] | None = None) -> list[Outcome]:
    rng = random.Random(key)
    tasks: list[asyncio.Task[Outcome]] = []
    end = time.monotonic() + seconds
    at = time.monotonic()
    while True:
        at += rng.expovariate(rate)
        if at >= end:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        tasks.append(asyncio.create_task(one(session, url, key, cfg, started, headers)))
    return list(await asyncio.gather(*tasks))


async def closed_loop(session: aiohttp.ClientSession, url: str, key: str, users: int, seconds: float, cfg: Config,
                      started: float) -> list[Outcome]:
    end = time.monotonic() + seconds
    outcomes: list[Outcome] = []

    async def user() -> None:
        while time.monotonic() < end:
            outcomes.append(await one(session, url, key, cfg, started))

    await asyncio.gather(*(user() for _ in range(users)))
    return outcomes


def quantile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if math.isfinite(v))
    if not values:
        return None
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


def summary(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and math.isfinite(o.ttft)]
    refused = [o for o in outcomes if o.status == 429]
    ttft = [o.ttft for o in ok]
    return {"sent": len(outcomes), "completed": len(ok), "refused_429": len(refused),
            "refused_with_retry_after": sum(1 for o in refused if o.retry_after),
            "other_errors": len(outcomes) - len(ok) - len(refused),
            "sent_per_s": round(len(outcomes) / seconds, 2), "completed_per_s": round(len(ok) / seconds, 2),
            "ttft_ms_p50": _ms(quantile(ttft, 0.5)), "ttft_ms_p99": _ms(quantile(ttft, 0.99)),
            "ttft_ms_mean": _ms(sum(ttft) / len(ttft)) if ttft else None}


def _over(a: float | None, b: float | None) -> float | None:
    """``a / b`` to two places; None when either is unknown (or zero)."""
    return round(a / b, 2) if a and b else None


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000 * v, 1)


def wait_histogram(metrics: str, band: str) -> dict[float, float]:
    """gateway_admission_wait_seconds buckets of ``band`` (upper bound -> cumulative count)."""
    buckets: dict[float, float] = {}
    for line in metrics.splitlines():
        if line.startswith("gateway_admission_wait_seconds_bucket{") and f'band="{band}"' in line:
            labels, value = line.rsplit(" ", 1)
            le = labels.split('le="', 1)[1].split('"', 1)[0]
            buckets[math.inf if le == "+Inf" else float(le)] = float(value)
    return buckets


def share_within(buckets: dict[float, float], before: dict[float, float], bound: float) -> float | None:
    """Of the admissions between two scrapes, the share that waited at most ``bound`` seconds."""
    total = buckets.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    if total <= 0:
        return None
    return (buckets.get(bound, 0.0) - before.get(bound, 0.0)) / total


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


def total(metrics: str, family: str, **labels: str) -> float:
    """The sum of ``family``'s samples whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    out = 0.0
    for line in metrics.splitlines():
        if line.startswith(family + "{") and all(w in line for w in wanted):
            out += float(line.rsplit(" ", 1)[1])
    return out


async def engine_ttft(session: aiohttp.ClientSession, engines: list[str]) -> tuple[float, float]:
    """(sum, count) of the engines' own ``vllm:time_to_first_token_seconds`` histograms, all added up."""
    texts = [await scrape(session, engine) for engine in engines]
    return (sum(total(t, "vllm:time_to_first_token_seconds_sum") for t in texts),
            sum(total(t, "vllm:time_to_first_token_seconds_count") for t in texts))


def engine_mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The engines' mean TTFT between two :func:`engine_ttft` readings, in ms (what the engines' batches cost a
    request's first token, without the gateway's queue and the loopback hops)."""
    count = after[1] - before[1]
    return _ms((after[0] - before[0]) / count) if count > 0 else None


async def drain(session: aiohttp.ClientSession, url: str, log: Any, limit: float = 90.0) -> float:
    """Until the gateway holds nothing (queue and backends idle), so one scenario's backlog is not the next
    one's load; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        metrics = await scrape(session, url)
        if total(metrics, "gateway_queue_depth") == 0 and total(metrics, "gateway_backend_in_flight_requests") == 0:
            return time.monotonic() - started
        await asyncio.sleep(0.5)
    log(f"  (the gateway still held requests after {limit:g} s)")
    return time.monotonic() - started


async def scenarios(url: str, engines: list[str], cfg: Config, log: Any) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        slots = cfg.backends * cfg.slots
        log(f"capacity: a closed loop of {2 * slots} users for {cfg.seconds / 2:g} s")
        calib = await closed_loop(session, url, "B", 2 * slots, cfg.seconds / 2, cfg, started)
        capacity = summary(calib, cfg.seconds / 2)["completed_per_s"]
        if capacity <= 0:
            raise RuntimeError("the fleet completed nothing: see the logs")
        log(f"  {capacity:.1f} requests/s")
        doc: dict[str, Any] = {"capacity_per_s": capacity}
        seconds = cfg.seconds

        await drain(session, url, log)
        log(f"alone: B at 20% ({0.2 * capacity:.1f}/s)")
        at_start = await engine_ttft(session, engines)
        alone = await open_loop(session, url, "B", 0.2 * capacity, seconds, cfg, started)
        doc["alone"] = {"B": summary(alone, seconds),
                        "engine_ttft_ms_mean": engine_mean_ms(at_start, await engine_ttft(session, engines))}

        warm = min(5.0, seconds / 4)
        log(f"noisy: A at 500% ({5 * capacity:.1f}/s), and after {warm:g} s B at 20% beside it")

        beside: list[tuple[float, float]] = []

        async def b_later() -> list[Outcome]:
            await asyncio.sleep(warm)  # (beside a flood under way: its first seconds took every slot at once)
            beside.append(await engine_ttft(session, engines))
            outcomes = await open_loop(session, url, "B", 0.2 * capacity, seconds, cfg, started)
            beside.append(await engine_ttft(session, engines))
            return outcomes

        a, b = await asyncio.gather(open_loop(session, url, "A", 5 * capacity, seconds + warm, cfg, started),
                                    b_later())
        # (the engines' TTFT while B ran: A's and B's requests alike, once admitted; against alone's, what the
        # fuller batches cost every first token whatever the gateway does)
        doc["noisy"] = {"A": summary(a, seconds + warm), "B": summary(b, seconds), "B_starts_after_s": warm,
                        "engine_ttft_ms_mean": engine_mean_ms(beside[0], beside[1])}
        solo, noisy = doc["alone"], doc["noisy"]  # (not ``alone``: those outcomes make the timeline below)
        noisy["B_ttft_p99_over_alone_x"] = _over(noisy["B"]["ttft_ms_p99"], solo["B"]["ttft_ms_p99"])
        # how much of B's slower first token the engines' fuller batches explain: their mean TTFT (on their own,
        # simulated clock: a ratio is what compares) beside the flood over alone, against B's at the client
        noisy["engine_ttft_mean_over_alone_x"] = _over(noisy["engine_ttft_ms_mean"], solo["engine_ttft_ms_mean"])
        noisy["B_ttft_mean_over_alone_x"] = _over(noisy["B"]["ttft_ms_mean"], solo["B"]["ttft_ms_mean"])
        doc["noisy"]["drain_s"] = round(await drain(session, url, log), 1)  # (A's backlog: up to its 30 s wait)

        log(f"priority: critical at 30% ({0.3 * capacity:.1f}/s) and sheddable at 200%")
        before = wait_histogram(await scrape(session, url), "critical")
        crit, shed = await asyncio.gather(
            open_loop(session, url, "ops", 0.3 * capacity, seconds, cfg, started, {"x-gateway-priority": "critical"}),
            open_loop(session, url, "batch", 2 * capacity, seconds, cfg, started))
        after = wait_histogram(await scrape(session, url), "critical")
        doc["priority"] = {"critical": summary(crit, seconds), "sheddable": summary(shed, seconds),
                           "critical_admitted_within_50ms": share_within(after, before, 0.05),
                           "critical_admitted_within_25ms": share_within(after, before, 0.025),
                           "critical_wait_buckets": {str(k): after.get(k, 0.0) - before.get(k, 0.0)
                                                     for k in sorted(after)}}
        doc["priority"]["drain_s"] = round(await drain(session, url, log), 1)

        log(f"weights: W3 and W1, {2 * slots} users each, closed loop; admissions counted after the first quarter")

        async def counted(start: float) -> tuple[str, str]:
            """The gateway's counts at ``start`` and at the end of the loops' time (not after: their last
            requests, sent before the end and admitted after it, are the backlog draining, not the shares)."""
            await asyncio.sleep(start)
            early = await scrape(session, url)
            await asyncio.sleep(seconds - start)
            return early, await scrape(session, url)

        w3, w1, (early, late) = await asyncio.gather(
            closed_loop(session, url, "W3", 2 * slots, seconds, cfg, started),
            closed_loop(session, url, "W1", 2 * slots, seconds, cfg, started), counted(seconds / 4))
        window = seconds - seconds / 4
        admitted = {key: (total(late, "gateway_admissions_total", key=key)
                          - total(early, "gateway_admissions_total", key=key)) / window for key in ("W3", "W1")}
        doc["weights"] = {"W3": summary(w3, seconds), "W1": summary(w1, seconds),
                          "admitted_per_s": {k: round(v, 2) for k, v in admitted.items()},
                          "window_s": window}
        doc["weights"]["ratio"] = round(admitted["W3"] / admitted["W1"], 3) if admitted["W1"] else None
        doc["timeline"] = {name: [(round(o.start, 3), o.status, _ms(o.ttft if math.isfinite(o.ttft) else None))
                                  for o in outcomes]
                           for name, outcomes in (("alone_B", alone), ("noisy_A", a), ("noisy_B", b),
                                                  ("critical", crit), ("sheddable", shed))}
        return doc


def targets(doc: dict[str, Any]) -> dict[str, Any]:
    """Each target of the issue, with the figure and whether it is met."""
    noisy, prio, weights = doc["noisy"], doc["priority"], doc["weights"]
    x = noisy["B_ttft_p99_over_alone_x"]
    within = prio["critical_admitted_within_50ms"]
    ratio = weights["ratio"]
    return {
        "noisy_B_ttft_p99_within_1.5x_of_alone": {"value": x, "met": x is not None and x <= 1.5},
        "noisy_B_no_429": {"value": noisy["B"]["refused_429"], "met": noisy["B"]["refused_429"] == 0},
        "noisy_A_429_with_retry_after": {
            "value": f"{noisy['A']['refused_with_retry_after']}/{noisy['A']['refused_429']}",
            "met": noisy["A"]["refused_429"] > 0
            and noisy["A"]["refused_with_retry_after"] == noisy["A"]["refused_429"]},
        "critical_wait_p99_under_50ms": {"value": within, "met": within is not None and within >= 0.99},
        "sheddable_completes": {"value": prio["sheddable"]["completed"], "met": prio["sheddable"]["completed"] > 0},
        "weights_3_to_1_within_10pct": {"value": ratio, "met": ratio is not None and abs(ratio / 3 - 1) <= 0.10},
    }


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for name, color in (("alone_B", "tab:green"), ("noisy_B", "tab:blue")):
        points = [(t, ttft) for t, status, ttft in doc["timeline"][name] if ttft is not None]
        ax.scatter([p[0] for p in points], [p[1] for p in points], s=6, color=color, label=name.replace("_", " "))
    ax.set(title=f"key B's TTFT, alone and beside a 5x flood (p99 x{doc['noisy']['B_ttft_p99_over_alone_x']})",
           xlabel="s since start", ylabel="TTFT ms")
    ax.legend()
    ax = axes[1]
    buckets = doc["priority"]["critical_wait_buckets"]
    bounds = [k for k in buckets if k != "inf"]
    total = buckets.get("inf", 0.0) or 1.0
    ax.plot([float(b) * 1000 for b in bounds], [buckets[b] / total for b in bounds], marker="o")
    ax.axvline(50, color="grey", linestyle=":")
    ax.set(xscale="log", title="critical: share admitted within (beside 2x sheddable)", xlabel="wait ms",
           ylabel="cumulative share", ylim=(0, 1.02))
    ax = axes[2]
    w = doc["weights"]
    ax.bar(["W3", "W1"], [w["admitted_per_s"]["W3"], w["admitted_per_s"]["W1"]], color=["tab:blue", "tab:orange"])
    ax.set(title=f"admitted per second, weights 3:1 (ratio {w['ratio']})", ylabel="requests/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_fairness(cfg: Config, log: Any = print) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    *ports, gport = free_ports(cfg.backends + 1)
    with tempfile.TemporaryDirectory() as tmp:
        fleet_file, gateway_file = Path(tmp) / "fleet.yaml", Path(tmp) / "gateway.yaml"
        fleet_file.write_text(fleet_yaml(ports, cfg))
        gateway_file.write_text(gateway_yaml(ports, gport, cfg))
        fleet = ChildProcess("fleet", [py, "-m", "gateway.sim", "fleet", "--config", str(fleet_file)],
                             cfg.out / "fleet.log")
        gateway = ChildProcess("gateway", [py, "-m", "gateway", "serve", "--config", str(gateway_file),
                                           "--log-level", "warning"], cfg.out / "gateway.log")
        url = f"http://127.0.0.1:{gport}"
        with fleet, gateway:
            for port in ports:
                fleet.wait_http(f"http://127.0.0.1:{port}/health")
            gateway.wait_http(url + "/ready")
            started = time.perf_counter()
            doc = asyncio.run(scenarios(url, [f"http://127.0.0.1:{port}" for port in ports], cfg, log))
    doc = {"schema": "gateway-bench-fairness/1", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()},
           "wall_s": round(time.perf_counter() - started, 1), **doc}
    doc["targets"] = targets(doc)
    (cfg.out / "fairness.json").write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    plot(doc, cfg.out / "fairness.png")
    return doc


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gateway bench fairness", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", type=int, default=2, help="emulated vLLM backends")
    p.add_argument("--slots", type=int, default=32, help="each backend's max_concurrency in the gateway")
    p.add_argument("--tokens", type=int, default=64, help="tokens per answer, on average")
    p.add_argument("--time-scale", type=float, default=0.25,
                   help="the emulators' speed (below 1: slower, which keeps the request and chunk rates within what "
                        "one 2-core machine sends and serves; far below it, the engines' steps get so long that "
                        "slots free in bursts a step apart)")
    p.add_argument("--sheddable-share", type=float, default=0.7,
                   help="the sheddable band's max_saturation in the gateway under test")
    p.add_argument("--seconds", type=float, default=20.0, help="each scenario's length")
    p.add_argument("--out", type=Path, default=Path("reports/fairness"))
    a = p.parse_args(argv)
    cfg = Config(backends=a.backends, slots=a.slots, tokens=a.tokens, time_scale=a.time_scale, seconds=a.seconds,
                 sheddable_share=a.sheddable_share, out=a.out)
    doc = run_fairness(cfg)
    for name, target in doc["targets"].items():
        print(f"  {'met   ' if target['met'] else 'MISSED'}  {name}: {target['value']}")
    print(f"wrote {cfg.out / 'fairness.json'} and {cfg.out / 'fairness.png'}")
    return 0
