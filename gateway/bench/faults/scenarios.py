"""The fault scenarios, each bounded in requests and time, each returning a judged report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.bench.faults.fakes import (
    GARBAGE,
    AsyncThread,
    GarbageBackend,
    SlowReader,
    free_ports,
    rss_bytes,
)
from gateway.bench.faults.harness import (
    GatewayThread,
    Outcome,
    ScenarioReport,
    chat_body,
    client_session,
    fleet_and_gateway,
    generations,
    never_failed,
    request,
    settings_for,
    wait_until,
)
from gateway.sim import FleetThread, SimSpec


# -- kill a backend while streams run ------------------------------------------------------------------------
@dataclass
class KillResult:
    report: ScenarioReport
    outcomes: list[Outcome]
    killed_at: float
    victim: str


def kill_while_streaming(streams: int = 200, max_tokens: int = 120, time_scale: float = 1.0,
                         spread_s: float = 1.0, kill_after_s: float = 0.6, timeout: float = 30.0) -> KillResult:
    """``streams`` streams arriving evenly over ``spread_s`` onto two emulated vLLM servers; ``v0`` is killed
    ``kill_after_s`` after the first arrival. Streams due at or after ``kill_after_s`` wait until the kill is
    done (stopping a server takes a variable while), so that they certainly arrive after it. Lost: anything
    but a complete stream, except a stream that was mid-flight on the killed backend and ended with a
    well-formed error event."""
    specs = [SimSpec(engine="vllm", model="m", name=f"v{i}", time_scale=time_scale) for i in range(2)]
    report = ScenarioReport("kill_while_streaming")
    t0 = time.monotonic()
    # an idle limit well under the client's patience: a stream whose backend went silent ends with an error
    # event within it (the gateway's guarantee), whatever the dead backend's sockets do
    with fleet_and_gateway(specs, routing={"policy": "round-robin"}, timeouts={"idle": 5.0}) as (fleet, gw):
        victim = fleet.fleet["v0"]
        url = gw.url + "/v1/chat/completions"
        killed: dict[str, float] = {}

        async def drive() -> list[Outcome]:
            done = asyncio.Event()
            async with client_session() as session:
                async def one(i: int) -> Outcome:
                    due = spread_s * i / streams
                    await asyncio.sleep(due)
                    if due >= kill_after_s:
                        await done.wait()
                    return await request(session, url, chat_body(max_tokens), i, timeout)

                async def kill() -> None:
                    await asyncio.sleep(kill_after_s)
                    killed["began"] = time.monotonic()
                    await asyncio.to_thread(fleet.call, victim.stop())
                    killed["at"] = time.monotonic()
                    done.set()

                killer = asyncio.create_task(kill())
                results = await asyncio.gather(*(one(i) for i in range(streams)))
                await killer
                return list(results)

        outcomes = asyncio.run(drive())
        killed_at = killed["at"]

        def lost(o: Outcome) -> bool:
            if o.kind == "complete":
                return False
            # owed only to streams that were already streaming from the victim
            return not (o.kind == "error_event" and o.backend == victim.spec.name and o.streamed)

        report.add(outcomes, lost)
        drained = wait_until(lambda: gw.in_flight() == 0, 10.0)
        report.checks["in_flight_back_to_zero"] = drained
        report.checks["interrupted_mid_stream"] = sum(o.kind == "error_event" for o in outcomes)
        report.checks["served_after_failover_or_by_survivor"] = sum(
            o.kind == "complete" and o.backend == "v1" for o in outcomes)
        report.checks["started_after_kill"] = sum(o.started >= killed_at for o in outcomes)
        report.checks["kill_took_s"] = round(killed_at - killed["began"], 3)
        report.checks["hung"] = sum(o.kind == "hung" for o in outcomes)
        report.checks["longest_stream_s"] = round(max(o.duration for o in outcomes), 3)
    report.seconds = time.monotonic() - t0
    return KillResult(report, outcomes, killed_at, "v0")


# -- a backend that hangs before its first byte --------------------------------------------------------------
def hanging_backend(requests: int = 6, first_byte: float = 0.5, timeout: float = 20.0) -> ScenarioReport:
    """Round-robin over a hanging and a healthy vLLM emulator: each request costs at most the first-byte
    timeout (plus slack) and then completes on the healthy one; alone, the hanging one gives a 504."""
    report = ScenarioReport("hanging_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="vllm", model="m", name=n, time_scale=50.0) for n in ("hangs", "ok")]
    # no health checks after discovery (they would hang too, and take it out of rotation before any request)
    with fleet_and_gateway(specs, routing={"policy": "round-robin"}, scrape={"interval": 60},
                           timeouts={"first_byte": first_byte},
                           breaker={"consecutive_failures": 1000, "failure_ratio": 1.0}) as (fleet, gw):
        fleet.fleet["hangs"].faults.update({"hang_before_first_byte": True})

        async def drive(url: str, n: int) -> list[Outcome]:
            async with client_session() as session:
                return [await request(session, url, chat_body(8), i, timeout) for i in range(n)]

        outcomes = asyncio.run(drive(gw.url + "/v1/chat/completions", requests))
        report.add(outcomes, never_failed)
        report.checks["slowest_request_s"] = round(max(o.duration for o in outcomes), 3)
        report.checks["hit_the_hanging_backend"] = generations(fleet.fleet["hangs"])
        report.checks["within_first_byte_timeout_plus_1s"] = all(o.duration < first_byte + 1.0 for o in outcomes)
    specs = [SimSpec(engine="vllm", model="m", name="hangs", time_scale=50.0)]
    with fleet_and_gateway(specs, scrape={"interval": 60}, timeouts={"first_byte": first_byte}) as (fleet, gw):
        fleet.fleet["hangs"].faults.update({"hang_before_first_byte": True})
        alone = asyncio.run(drive(gw.url + "/v1/chat/completions", 2))
        report.add(alone, lambda o: o.kind != "http_error" or o.status != 504)
        report.checks["alone_504_within_s"] = round(max(o.duration for o in alone), 3)
        report.checks["alone_within_first_byte_timeout_plus_1s"] = all(o.duration < first_byte + 1.0 for o in alone)
    report.seconds = time.monotonic() - t0
    return report


def garbage_backend(modes: Sequence[str] = tuple(GARBAGE), per_mode: int = 2,
                    timeout: float = 10.0) -> tuple[ScenarioReport, dict[str, list[Outcome]]]:
    """Each garbage mode, streamed and not: the gateway must answer a well-formed stream or error."""
    report = ScenarioReport("garbage_sse")
    t0 = time.monotonic()
    by_mode: dict[str, list[Outcome]] = {}
    with AsyncThread() as thread:
        fake = GarbageBackend()
        thread.call(fake.start())
        backend = {"name": "garbage", "engine": "openai", "url": fake.url, "models": ["m"]}
        settings = settings_for([], [backend], timeouts={"first_byte": 5, "idle": 5})
        with GatewayThread(settings) as gw:
            async def drive(n: int) -> list[Outcome]:
                async with client_session() as session:
                    out = []
                    for i in range(n):
                        out.append(await request(session, gw.url + "/v1/chat/completions",
                                                 chat_body(8, stream=i % 2 == 0), i, timeout))
                    return out

            for mode in modes:
                fake.mode = mode
                by_mode[mode] = asyncio.run(drive(per_mode))
                report.add(by_mode[mode], lambda o: o.kind not in ("complete", "error_event", "http_error"))
            report.checks["modes"] = {m: sorted({o.kind for o in outs}) for m, outs in by_mode.items()}
            report.checks["in_flight_back_to_zero"] = wait_until(lambda: gw.in_flight() == 0, 5.0)
        thread.call(fake.stop())
    report.seconds = time.monotonic() - t0
    return report, by_mode


# -- a flapping backend --------------------------------------------------------------------------------------
def flapping_backend(seconds: float = 3.0, concurrency: int = 8, period_s: float = 0.25,
                     timeout: float = 20.0) -> ScenarioReport:
    """Two vLLM emulators; ``v0`` is stopped and started every ``period_s`` while ``concurrency`` clients send
    short non-streamed requests for ``seconds``: every one must succeed (failover before any byte)."""
    report = ScenarioReport("flapping_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="vllm", model="m", name=f"v{i}", time_scale=20.0) for i in range(2)]
    with fleet_and_gateway(specs, routing={"policy": "round-robin"},
                           breaker={"cooldown_seconds": 0.2}) as (fleet, gw):
        flapper = fleet.fleet["v0"]
        flips = 0

        async def drive() -> list[Outcome]:
            nonlocal flips
            end = time.monotonic() + seconds
            async with client_session() as session:
                async def worker(w: int) -> list[Outcome]:
                    out = []
                    i = 0
                    while time.monotonic() < end:
                        out.append(await request(session, gw.url + "/v1/chat/completions",
                                                 chat_body(6, stream=False), w * 100_000 + i, timeout))
                        i += 1
                    return out

                async def flap() -> None:
                    nonlocal flips
                    while time.monotonic() < end:
                        await asyncio.sleep(period_s)
                        await asyncio.to_thread(fleet.call, flapper.stop() if flapper.running else flapper.start())
                        flips += 1

                tasks = [asyncio.create_task(worker(w)) for w in range(concurrency)]
                await flap()
                return [o for t in tasks for o in await t]

        outcomes = asyncio.run(drive())
        if not flapper.running:
            fleet.call(flapper.start())
        report.add(outcomes, never_failed)
        report.checks["flips"] = flips
        report.checks["served_by_flapper"] = sum(o.backend == "v0" for o in outcomes)
        report.checks["in_flight_back_to_zero"] = wait_until(lambda: gw.in_flight() == 0, 5.0)
    report.seconds = time.monotonic() - t0
    return report


# -- a backend stuck loading ---------------------------------------------------------------------------------
def loading_backend(requests: int = 24, concurrency: int = 8, timeout: float = 20.0) -> ScenarioReport:
    report = ScenarioReport("loading_backend")
    t0 = time.monotonic()
    specs = [SimSpec(engine="llamacpp", model="m", name=n, time_scale=20.0) for n in ("loading", "ready")]

    def stuck(fleet: FleetThread) -> None:
        fleet.fleet["loading"].faults.update({"loading": True})

    with fleet_and_gateway(specs, before=stuck, routing={"policy": "round-robin"}) as (fleet, gw):
        async def drive() -> list[Outcome]:
            sem = asyncio.Semaphore(concurrency)
            async with client_session() as session:
                async def one(i: int) -> Outcome:
                    async with sem:
                        return await request(session, gw.url + "/v1/chat/completions",
                                             chat_body(6, stream=i % 2 == 0), i, timeout)

                return list(await asyncio.gather(*(one(i) for i in range(requests))))

        outcomes = asyncio.run(drive())
        report.add(outcomes, never_failed)
        report.checks["generation_requests_to_loading_backend"] = generations(fleet.fleet["loading"])
        report.checks["never_routed_to_loading"] = generations(fleet.fleet["loading"]) == 0
        report.checks["health_of_loading_backend"] = gw.gateway.pool.get("loading").health.value
    report.seconds = time.monotonic() - t0
    return report


def slow_client(slow_readers: int = 4, normal: int = 16, normal_tokens: int = 40, normal_gap_ms: float = 10.0,
                rounds: int = 3, slow_seconds: float = 8.0, slow_gap_ms: float = 0.5,
                out: Path | None = None, timeout: float = 30.0) -> ScenarioReport:
    """The gateway as its own process (``python -m gateway serve``) in front of the raw backend (its own
    process). Normal streams run ``rounds`` times alone, then ``rounds`` times while ``slow_readers`` clients
    read long fast streams at ~2.5 KB/s. Checks: the normal streams' rounds beside the slow readers all ran
    while they were still reading, their median duration with the slow readers over without (one run: a figure
    for the report), and the gateway's RSS while the slow readers hold their streams."""
    import statistics
    import sys
    import tempfile

    from gateway.bench.overhead import MODEL, gateway_yaml
    from gateway.bench.procs import ChildProcess, get_json

    report = ScenarioReport("slow_client")
    t0 = time.monotonic()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        logs = out or Path(tmp)
        bport, gport = free_ports(2)
        backend_url, gateway_url = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{gport}"
        config = Path(tmp) / "gateway.yaml"
        config.write_text(gateway_yaml(backend_url, gport))
        backend = ChildProcess("raw backend", [py, "-m", "gateway.bench.rawbackend", "--port", str(bport),
                                               "--model", MODEL], logs / "slow-backend.log")
        gateway = ChildProcess("gateway", [py, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                           "error"], logs / "slow-gateway.log")
        probe = b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' % MODEL.encode()
        with backend, gateway:
            backend.wait_http(backend_url + "/health")
            gateway.wait_http(gateway_url + "/v1/chat/completions", method="POST", body=probe)
            body = chat_body(normal_tokens, model=MODEL, bench_gap_ms=normal_gap_ms)
            slow_body = chat_body(100_000, model=MODEL, bench_gap_ms=slow_gap_ms)
            rss: list[tuple[float, int]] = []

            async def normal_round(session: aiohttp.ClientSession, r: int) -> list[Outcome]:
                return list(await asyncio.gather(*(
                    request(session, gateway_url + "/v1/chat/completions", body, r * 1000 + i, timeout)
                    for i in range(normal))))

            async def drive() -> tuple[list[Outcome], list[Outcome], list[SlowReader]]:
                async with client_session() as session:
                    await normal_round(session, 99)  # warm-up
                    alone = [o for r in range(rounds) for o in await normal_round(session, r)]
                    rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    readers = [SlowReader("127.0.0.1", gport, slow_body) for _ in range(slow_readers)]
                    tasks = [asyncio.create_task(s.run(slow_seconds)) for s in readers]
                    await asyncio.sleep(1.0)
                    rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    beside: list[Outcome] = []
                    r = rounds
                    while not all(t.done() for t in tasks):
                        if r < 2 * rounds:
                            beside += await normal_round(session, r)
                            r += 1
                            if r == 2 * rounds:  # (the slow readers still reading now: the rounds ran beside them)
                                report.checks["slow_readers_reading_after_the_rounds"] = sum(
                                    not t.done() for t in tasks)
                        else:
                            await asyncio.sleep(0.5)
                        rss.append((time.monotonic(), rss_bytes(gateway.pid)))
                    await asyncio.gather(*tasks)
                    return alone, beside, readers

            chunks_before = get_json(backend_url + "/stats")
            alone, beside, readers = asyncio.run(drive())
            chunks_after = get_json(backend_url + "/stats")
            report.add([*alone, *beside], never_failed)
            assert isinstance(chunks_before, dict) and isinstance(chunks_after, dict)
            a = statistics.median(o.duration for o in alone)
            b = statistics.median(o.duration for o in beside) if beside else float("nan")
            report.checks["normal_median_alone_s"] = round(a, 3)
            report.checks["normal_median_beside_slow_s"] = round(b, 3)
            report.checks["slowdown_ratio"] = round(b / a, 3)
            report.checks["normal_streams_beside_slow"] = len(beside)
            report.checks["slow_reader_bytes_read"] = [s.read for s in readers]
            report.checks["slow_reader_status"] = sorted({s.status_line.decode("latin-1") for s in readers})
            report.checks["backend_chunks_written_meanwhile"] = chunks_after["chunks"] - chunks_before["chunks"]
            base = rss[1][1]
            report.checks["gateway_rss_mb_before_slow"] = round(rss[0][1] / 2**20, 1)
            report.checks["gateway_rss_mb_slow_start"] = round(base / 2**20, 1)
            report.checks["gateway_rss_mb_max"] = round(max(v for _, v in rss) / 2**20, 1)
            report.checks["gateway_rss_mb_end"] = round(rss[-1][1] / 2**20, 1)
            report.checks["gateway_rss_growth_mb"] = round((max(v for _, v in rss) - base) / 2**20, 1)
            report.checks["rss_samples"] = len(rss)
    report.seconds = time.monotonic() - t0
    return report
