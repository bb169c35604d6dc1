"""``server.workers: 2``: one port served by two worker processes (SO_REUSEPORT) under one supervisor, with a
real redis-server holding their shared state, in front of an emulated fleet.

What a user relies on: connections spread over both workers; any worker's /metrics is the whole gateway's;
the engines are scraped once per pod, not once per worker; a worker that dies is started again; SIGTERM lets
streams finish, stops every worker and exits 0; and a configuration that would give per-worker limits is
refused before anything starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway
from gateway.bench.procs import ChildProcess
from gateway.config import ConfigError, Settings, settings_from_mapping
from gateway.sim import FleetThread, SimSpec
from gateway.state.sealing import fleet_secret
from gateway.telemetry.merge import merge_expositions
from gateway.workers import WorkerIdentity
from tests.conftest import free_port_block
from tests.files import write_config
from tests.state.conftest import RedisServer
from tests.waiting import wait_until

pytestmark = pytest.mark.system

SCRAPE_INTERVAL = 0.2


@dataclass
class Pod:
    url: str
    port: int
    supervisor: ChildProcess
    fleet: FleetThread
    log: Path

    def workers(self) -> list[int]:
        """The supervisor's worker processes (its children but multiprocessing's resource tracker)."""
        children = Path(f"/proc/{self.supervisor.pid}/task/{self.supervisor.pid}/children").read_text().split()
        return [int(p) for p in children if b"spawn_main" in cmdline(int(p))]


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):  # (gone since the supervisor's children were listed)
        return b""


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def samples(url: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = httpx.get(url + "/metrics", headers={"connection": "close"}, timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def pod_config(fleet: FleetThread, redis: RedisServer, port: int, **server: object) -> dict[str, Any]:
    servers = {s.spec.name: s for s in fleet.fleet.servers}
    return {"server": {"host": "127.0.0.1", "port": port, "workers": 2, "shutdown_timeout": 10, **server},
              "backends": [{"name": n, "engine": "vllm", "url": servers[n].url} for n in ("a", "b")],
              # (a 5 s scrape timeout: under a loaded CI machine 1 s once took both backends for down: 503s)
              "scrape": {"interval": SCRAPE_INTERVAL, "timeout": 5.0},
              "state": {"url": redis.url, "heartbeat_seconds": 0.2, "replica_ttl_seconds": 3}}


def start_pod(tmp: Path, fleet: FleetThread, redis: RedisServer, port: int, config: dict[str, Any] | None = None,
              **server: object) -> Pod:
    config = config or pod_config(fleet, redis, port, **server)
    path = tmp / "gateway.yaml"
    write_config(path, yaml.safe_dump(config))
    log = tmp / "gateway.log"
    proc = ChildProcess("gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                    "--log-level", "warning"], log).start()
    pod = Pod(f"http://127.0.0.1:{port}", port, proc, fleet, log)
    proc.wait_http(pod.url + "/ready", timeout=60)
    logged_until(log, lambda: samples(pod.url, "gateway_workers") == {(): 2.0}, "both workers counted", 30)
    # (either worker may take a connection: the first answer, on a loaded machine, came from one not ready yet)
    ready_ten_in_a_row(pod)
    return pod


def logged_until(log: Path, condition: Callable[[], object], what: str, within: float) -> None:
    """``wait_until``, with the end of the gateway's log in its failure."""
    try:
        wait_until(condition, what, within)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text()[-3000:]}") from None


def wait_restarted(pod: Pod, killed: list[int]) -> None:
    """Until both workers run again (none of ``killed`` among them), each answers the others and /ready holds on
    ten fresh connections in a row (either worker), as a load balancer's check would."""
    wait_until(lambda: len(now := pod.workers()) == 2 and not set(now) & set(killed),
               f"two workers, none of {killed}", within=60)
    ready_ten_in_a_row(pod)


def ready_ten_in_a_row(pod: Pod) -> None:
    passed = 0

    def ten_in_a_row() -> bool:
        nonlocal passed
        try:  # (with both killed, nothing listens until one has started)
            ready = (samples(pod.url, "gateway_workers") == {(): 2.0} and httpx.get(
                pod.url + "/ready", headers={"connection": "close"}, timeout=10).status_code == 200)
        except httpx.TransportError:
            ready = False
        passed = passed + 1 if ready else 0
        return passed >= 10

    wait_until(ten_in_a_row, "both workers counted and /ready on ten fresh connections in a row", within=60)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    tmp = tmp_path_factory.mktemp("workers")
    base = free_port_block(3)
    redis = RedisServer(base, tmp).start()
    specs = [SimSpec(engine="vllm", model="m", name=n, time_scale=20) for n in ("a", "b")]
    try:
        with FleetThread(specs) as fleet:
            pod = start_pod(tmp, fleet, redis, base + 1, admin_port=base + 2)
            try:
                yield pod
            finally:
                pod.supervisor.stop()
    finally:
        redis.kill()


async def _chats(url: str, count: int, concurrency: int, *, fresh_connections: bool = True) -> list[int]:
    limits = httpx.Limits(max_keepalive_connections=0 if fresh_connections else concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:
        async def one() -> int:
            async with gate:
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
                return r.status_code
        return await asyncio.gather(*(one() for _ in range(count)))


def access_lines(pod: Pod) -> int:
    return sum(1 for line in pod.log.read_text().splitlines() if line.startswith('{"ts":') and '"route":"chat"' in line)


def requests_total(url: str) -> float:
    return sum(samples(url, "gateway_requests_total").values())


def test_connections_spread_over_both_workers_and_any_metrics_scrape_counts_them_all(pod: Pod) -> None:
    workers = pod.workers()
    assert len(workers) == 2
    before_cpu = {p: cpu_ticks(p) for p in workers}
    before = requests_total(pod.url)
    logged = access_lines(pod)
    codes = asyncio.run(_chats(pod.url, 300, 16))
    assert codes == [200] * 300
    # each worker writes its access log (spawned workers inherited no logging: not a line was written)
    try:
        wait_until(lambda: access_lines(pod) >= logged + 300, "an access-log line for each of 300 requests")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {access_lines(pod) - logged} lines") from None
    spent = {p: cpu_ticks(p) - before_cpu[p] for p in workers}
    # the kernel hashes each new connection to one of the two listening sockets: both took a real share
    assert min(spent.values()) >= 0.2 * sum(spent.values()), spent
    # every scrape, whichever worker answers it (a fresh connection each), reports both workers' requests
    for _ in range(6):
        assert requests_total(pod.url) == before + 300
        assert samples(pod.url, "gateway_workers") == {(): 2.0}
    # a backend's state is a shared fact, not added up once per worker
    assert set(samples(pod.url, "gateway_backend_up").values()) == {1.0}


def recent_requests(admin: str) -> int:
    """The requests in the admin status's sparklines: their whole ring (two minutes), every worker's."""
    status = httpx.get(admin + "/admin/status", headers={"connection": "close"}, timeout=10).json()
    assert status["workers"] == 2
    return sum(sum(b["series"]["requests"]) for b in status["backends"])


def test_the_admin_listeners_recent_figures_are_every_workers(pod: Pod) -> None:
    admin = f"http://127.0.0.1:{pod.port + 1}"
    before = recent_requests(admin)  # (the module's earlier requests: within the ring's two minutes throughout)
    assert asyncio.run(_chats(pod.url, 60, 8)) == [200] * 60
    for _ in range(6):  # whichever worker answers (a fresh connection each), it counts both workers' requests
        assert recent_requests(admin) == before + 60


def test_the_engines_are_scraped_once_per_pod_not_once_per_worker(pod: Pod) -> None:
    server = next(s for s in pod.fleet.fleet.servers if s.spec.name == "a")

    def probes() -> int:
        return sum(1 for r in list(server.received) if r.path == "/health")

    start, probed = time.monotonic(), probes()
    wait_until(lambda: probes() - probed >= 15, "15 probes of backend a")
    seen, elapsed = probes() - probed, time.monotonic() - start
    one_set = elapsed / SCRAPE_INTERVAL
    # one worker scraping: about one probe per interval (a loop sleeps the interval after each probe); two
    # workers scraping each would make it about two
    assert 0.5 * one_set <= seen <= 1.25 * one_set, (seen, one_set)  # real time: the scrape interval's pace


def test_a_worker_that_dies_is_started_again_and_the_port_keeps_serving(pod: Pod) -> None:
    first = pod.workers()
    os.kill(first[0], signal.SIGKILL)
    # (a worker that has just started may find a backend slow to answer its first probe, here where the test,
    # the emulators and both workers share two cores: wait_restarted waits for ten /ready in a row)
    wait_restarted(pod, first[:1])
    assert asyncio.run(_chats(pod.url, 60, 8)) == [200] * 60
    assert first[1] in pod.workers()  # the other worker was left alone


def test_sigterm_lets_streams_finish_stops_every_worker_and_exits_0(tmp_path: Path) -> None:
    base = free_port_block(2)
    redis = RedisServer(base, tmp_path).start()
    try:
        # slow enough that the stream is still going when the signal comes
        with FleetThread([SimSpec(engine="vllm", model="m", name=n, time_scale=2) for n in ("a", "b")]) as fleet:
            pod = start_pod(tmp_path, fleet, redis, base + 1)
            workers = pod.workers()
            assert pod.supervisor.proc is not None

            async def stream() -> list[str]:
                async with httpx.AsyncClient(timeout=60) as client, client.stream(
                        "POST", pod.url + "/v1/chat/completions", json={
                            "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                            "stream": True, "ignore_eos": True}) as r:
                    lines: list[str] = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                os.kill(pod.supervisor.pid, signal.SIGTERM)
                    return lines

            lines = asyncio.run(stream())
            assert lines[-1] == "data: [DONE]" and len(lines) > 10, lines[-3:]
            assert pod.supervisor.proc.wait(timeout=30) == 0
            assert not any(Path(f"/proc/{p}").exists() for p in workers)
            with pytest.raises(OSError):
                socket.create_connection(("127.0.0.1", pod.port), timeout=1).close()
    finally:
        redis.kill()


def test_several_workers_without_shared_state_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"server\.workers: more than one worker needs state\.url"):
        settings_from_mapping({"server": {"workers": 2}})
    with pytest.raises(ConfigError, match=r"fixed server\.port"):
        settings_from_mapping({"server": {"workers": 2, "port": 0}, "state": {"url": "redis://127.0.0.1:1/0"}})
    assert settings_from_mapping({"server": {"workers": 1}}).server.worker_count() == 1
    auto = settings_from_mapping({"server": {"workers": "auto"}, "state": {"url": "redis://127.0.0.1:1/0"}})
    assert auto.server.worker_count() == len(os.sched_getaffinity(0))


def _worker_exposition(requests: int, in_flight: int, up: float, state_up: float, ttft: list[float]) -> str:
    r = CollectorRegistry()
    Counter("gateway_requests", "Requests.", ["route"], registry=r).labels("chat").inc(requests)
    Gauge("gateway_requests_in_flight", "In flight.", registry=r).set(in_flight)
    Gauge("gateway_backend_up", "Up.", ["backend"], registry=r).labels("a").set(up)
    Gauge("gateway_state_up", "Redis.", registry=r).set(state_up)
    h = Histogram("gateway_time_to_first_token_seconds", "TTFT.", buckets=(0.1, 1.0), registry=r)
    for v in ttft:
        h.observe(v)
    return generate_latest(r).decode()


def test_the_merge_adds_counts_and_histograms_and_takes_shared_facts_once() -> None:
    merged = merge_expositions([_worker_exposition(3, 2, 1.0, 1.0, [0.05, 0.5]),
                                _worker_exposition(4, 1, 1.0, 0.0, [2.0])], workers=2).decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(merged) for s in f.samples}
    assert got[("gateway_requests_total", (("route", "chat"),))] == 7
    assert got[("gateway_requests_in_flight", ())] == 3
    assert got[("gateway_backend_up", (("backend", "a"),))] == 1.0  # not 2: both read the same backend
    assert got[("gateway_state_up", ())] == 0.0  # one worker cut off from Redis shows
    assert got[("gateway_time_to_first_token_seconds_bucket", (("le", "0.1"),))] == 1
    assert got[("gateway_time_to_first_token_seconds_bucket", (("le", "1.0"),))] == 2
    assert got[("gateway_time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 3
    assert got[("gateway_time_to_first_token_seconds_count", ())] == 3
    assert got[("gateway_time_to_first_token_seconds_sum", ())] == pytest.approx(2.55)
    assert got[("gateway_workers", ())] == 2
    assert "# TYPE gateway_time_to_first_token_seconds histogram" in merged


@pytest.mark.slow
def test_a_worker_started_again_runs_the_configuration_in_force_not_the_one_the_gateway_started_with(
        tmp_path: Path) -> None:
    """A key revoked by a reload worked again on a restarted worker (6 of 6 requests after both were killed):
    the supervisor started it with the configuration the gateway started with, and its file watch took the
    file for already applied."""
    base = free_port_block(2)
    redis = RedisServer(base, tmp_path).start()
    ops, team = "sk-ops-0123", "sk-team-4567"

    def key(name: str, secret: str, scopes: list[str]) -> dict[str, Any]:
        return {"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(), "scopes": scopes}

    def statuses(secret: str, path: str = "/v1/models", count: int = 30) -> set[int]:
        # fresh connections, which the kernel spreads over both workers
        return {httpx.get(pod.url + path, headers={"authorization": f"Bearer {secret}", "connection": "close"},
                          timeout=10).status_code for _ in range(count)}

    try:
        with FleetThread([SimSpec(engine="vllm", model="m", name=n, time_scale=20) for n in ("a", "b")]) as fleet:
            config = pod_config(fleet, redis, base + 1)
            config["auth"] = {"keys": [key("ops", ops, ["admin"]), key("team", team, ["inference"])]}
            pod = start_pod(tmp_path, fleet, redis, base + 1, config)
            try:
                assert statuses(team) == {200}
                config["auth"]["keys"] = config["auth"]["keys"][:1]  # team revoked
                (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
                reply = httpx.post(pod.url + "/admin/reload", headers={"authorization": f"Bearer {ops}"}, timeout=10)
                assert reply.status_code == 200, reply.text
                # (the other worker reloads on the shared state's word)
                wait_until(lambda: statuses(team, count=10) == {401}, "the reload reached both workers", within=30)
                for how_many in (1, 2):  # one worker, then both
                    killed = pod.workers()[:how_many]
                    for pid in killed:
                        os.kill(pid, signal.SIGKILL)
                    wait_restarted(pod, killed)
                    assert statuses(team) == {401}, f"the revoked key works again after {len(killed)} restarted"
                    assert statuses(ops, "/admin/config") == {200}
            finally:
                pod.supervisor.stop()
    finally:
        redis.kill()


def test_an_admin_reload_reaches_every_worker_while_redis_does_not_answer(tmp_path: Path) -> None:
    """Sweep 20: a key revoked through POST /admin/reload while Redis did not answer was revoked in the worker that
    took the request only: the others heard of reloads over Redis alone and kept serving the key (200 on about
    half the connections, a minute later too). The supervisor now passes what one worker applied to the others.
    Sweep 22: so it did only when the file had changed; a reload of the same file, which takes away a backend the
    admin API added, left it served by the other worker."""
    base = free_port_block(2)
    redis = RedisServer(base, tmp_path).start()
    ops, team = "sk-ops-0123", "sk-team-4567"

    def key(name: str, secret: str, scopes: list[str]) -> dict[str, Any]:
        return {"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(), "scopes": scopes}

    def statuses(secret: str, count: int = 30) -> set[int]:
        # fresh connections, which the kernel spreads over both workers
        return {httpx.get(pod.url + "/v1/models", headers={"authorization": f"Bearer {secret}",
                                                           "connection": "close"}, timeout=10).status_code
                for _ in range(count)}

    def served(model: str, count: int = 30) -> set[bool]:
        return {model in {m["id"] for m in httpx.get(pod.url + "/v1/models", timeout=10, headers={
            "authorization": f"Bearer {team}", "connection": "close"}).json()["data"]} for _ in range(count)}

    try:
        specs = [SimSpec(engine="vllm", model="mx" if n == "x" else "m", name=n, time_scale=20) for n in "abx"]
        with FleetThread(specs) as fleet:
            config = pod_config(fleet, redis, base + 1)
            config["auth"] = {"keys": [key("ops", ops, ["admin"]), key("team", team, ["inference"])]}
            pod = start_pod(tmp_path, fleet, redis, base + 1, config)
            assert redis.proc is not None
            admin = {"authorization": f"Bearer {ops}"}
            try:
                assert statuses(team) == {200}
                def add() -> int:
                    return httpx.post(pod.url + "/admin/backends", headers={**admin, "connection": "close"},
                                      timeout=30, json={"name": "x", "engine": "vllm",
                                                        "url": fleet.fleet["x"].url}).status_code

                def on_both() -> bool:
                    if served("mx", 20) == {True}:
                        return True
                    # (a worker whose subscription was not up yet when the other added it never hears of it
                    # over Redis: asked on a fresh connection, the one without it adds it itself)
                    add()
                    return False

                assert add() == 200
                logged_until(pod.log, on_both, "the added backend on both workers", 30)
                redis.proc.send_signal(signal.SIGSTOP)  # (Redis takes connections and answers nothing)
                try:
                    reply = httpx.post(pod.url + "/admin/reload", headers=admin, timeout=30)  # (the same file)
                    assert reply.status_code == 200 and reply.json()["removed"] == ["x"], reply.text
                    logged_until(pod.log, lambda: served("mx", 10) == {False},
                                 "the reload of the same file reached both workers with Redis stopped", 30)
                    config["auth"]["keys"] = config["auth"]["keys"][:1]  # team revoked
                    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
                    # (with changes of the routing made at once on both workers: sweep 21's passed the settings
                    # of each change to the others, an older one brought the key back, or went round for good)
                    with ThreadPoolExecutor(4) as pool:
                        routing = [pool.submit(httpx.put, pod.url + "/admin/routing", headers=admin, timeout=30,
                                               json={"policy": policy})
                                   for policy in ("round-robin", "default", "round-robin")]
                        reply = httpx.post(pod.url + "/admin/reload", headers=admin, timeout=30)
                        assert all(r.result().status_code == 200 for r in routing)
                    assert reply.status_code == 200, reply.text
                    logged_until(pod.log, lambda: statuses(team, count=10) == {401},
                                 "the reload reached both workers with Redis stopped", 30)
                    assert statuses(team) == {401}
                finally:
                    redis.proc.send_signal(signal.SIGCONT)
                assert statuses(team) == {401}  # (and once the routing changes came over Redis)
            finally:
                pod.supervisor.stop()
    finally:
        redis.kill()


def test_a_worker_started_again_remembers_a_removed_keys_limits(tmp_path: Path) -> None:
    """A reload that brings a removed key back leaving out its limits is refused (the key would come back without
    them). Sweep 20: a worker started again after the removal knew nothing of the key, and took it back bare:
    the key ran past its limits, on models it was never allowed, there (and, once the other worker was started
    again from what it reported, everywhere). The keys a worker has had in force travel with what it reports."""
    base = free_port_block(2)
    redis = RedisServer(base, tmp_path).start()
    ops, team = "sk-ops-0123", "sk-team-4567"

    def key(name: str, secret: str, **extra: Any) -> dict[str, Any]:
        return {"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(), **extra}

    def statuses(secret: str, count: int = 30) -> set[int]:
        return {httpx.get(pod.url + "/v1/models", headers={"authorization": f"Bearer {secret}",
                                                           "connection": "close"}, timeout=10).status_code
                for _ in range(count)}

    def write(keys: list[dict[str, Any]]) -> None:
        config["auth"] = {"keys": keys}
        (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))

    try:
        with FleetThread([SimSpec(engine="vllm", model="m", name=n, time_scale=20) for n in ("a", "b")]) as fleet:
            config = pod_config(fleet, redis, base + 1)
            admin, limited = key("ops", ops, scopes=["admin"]), key("team", team, models=["m"], requests_per_minute=5)
            write([admin, limited])
            pod = start_pod(tmp_path, fleet, redis, base + 1, config)
            try:
                write([admin])  # team removed
                reply = httpx.post(pod.url + "/admin/reload", headers={"authorization": f"Bearer {ops}"}, timeout=10)
                assert reply.status_code == 200, reply.text
                logged_until(pod.log, lambda: statuses(team, count=10) == {401}, "team removed everywhere", 30)
                killed = pod.workers()[:1]
                os.kill(killed[0], signal.SIGKILL)
                wait_restarted(pod, killed)
                write([admin, key("team", team)])  # back, its limits left out
                os.kill(pod.supervisor.pid, signal.SIGHUP)  # (every worker reads the file)
                logged_until(pod.log, lambda: pod.log.read_text().count("reload (SIGHUP) rejected") >= 2,
                             "both workers refused the file", 30)
                assert statuses(team) == {401}
            finally:
                pod.supervisor.stop()
    finally:
        redis.kill()


def test_sighups_while_workers_start_kill_none_and_the_file_is_reloaded(tmp_path: Path) -> None:
    """A SIGHUP sent to the process group (``kill -HUP`` under systemd or Kubernetes), or forwarded while a worker
    started again, reached a worker before it had installed its handler, and SIGHUP's default action ended it.
    Here every process of the gateway gets a SIGHUP every few ms (each look of the wait) from the supervisor's
    first worker until both serve, and again while one is started again: none dies of it, and the file changed
    meanwhile is reloaded."""
    base = free_port_block(2)
    redis = RedisServer(base, tmp_path).start()
    ops, team = "sk-ops-0123", "sk-team-4567"

    def key(name: str, secret: str, scopes: list[str]) -> dict[str, Any]:
        return {"name": name, "key_sha256": hashlib.sha256(secret.encode()).hexdigest(), "scopes": scopes}

    try:
        with FleetThread([SimSpec(engine="vllm", model="m", name=n, time_scale=20) for n in ("a", "b")]) as fleet:
            config = pod_config(fleet, redis, base + 1)
            config["auth"] = {"keys": [key("ops", ops, ["admin"]), key("team", team, ["inference"])]}
            path = tmp_path / "gateway.yaml"
            write_config(path, yaml.safe_dump(config))
            log = tmp_path / "gateway.log"
            supervisor = ChildProcess("gateway", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                                  "--log-level", "warning"], log).start()
            pod = Pod(f"http://127.0.0.1:{base + 1}", base + 1, supervisor, fleet, log)
            sent = 0

            def hangup_all() -> None:
                nonlocal sent
                children = Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children").read_text().split()
                for pid in [supervisor.pid, *map(int, children)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGHUP)
                        sent += 1

            def serving() -> bool:
                try:
                    return samples(pod.url, "gateway_workers") == {(): 2.0}
                except httpx.TransportError:
                    return False

            def first_worker() -> bool:
                assert supervisor.proc is not None and supervisor.proc.poll() is None, log.read_text()[-3000:]
                return bool(pod.workers())

            try:
                # (the supervisor's own handler is in place before its first worker)
                logged_until(log, first_worker, "the supervisor's first worker", 60)
                config["auth"]["keys"] = config["auth"]["keys"][:1]  # team revoked, the workers starting
                path.write_text(yaml.safe_dump(config))
                # a SIGHUP to all at each look
                logged_until(log, lambda: hangup_all() or serving(), "both workers serving", 60)
                killed = pod.workers()[:1]
                os.kill(killed[0], signal.SIGKILL)
                logged_until(log, lambda: hangup_all() or (
                    len(now := pod.workers()) == 2 and not set(now) & set(killed) and serving()),
                    "a worker started again, both serving", 60)
                assert sent > 20
                assert "exited with status" not in log.read_text().replace(f"(pid {killed[0]}) exited", ""), \
                    log.read_text()[-3000:]
                wait_restarted(pod, killed)
                statuses = {httpx.get(pod.url + "/v1/models", headers={"authorization": f"Bearer {team}",
                                                                       "connection": "close"}, timeout=10).status_code
                            for _ in range(20)}
                assert statuses == {401}, "a worker did not reload the file it was sent a SIGHUP for"
            finally:
                supervisor.stop()
    finally:
        redis.kill()


def test_every_worker_seals_with_the_supervisors_secret_whatever_the_keys_it_runs() -> None:
    """The seal's secret was derived by each worker from the keys it started with: a worker started again after
    a reload that revoked a key derived another, and it and the others dropped each other's messages (drains,
    reloads, sessions, freed slots). Now the supervisor derives it once and hands it to every worker."""

    def settings(keys: int) -> Settings:
        return settings_from_mapping({
            "server": {"workers": 2}, "state": {"url": "redis://127.0.0.1:1"},
            "backends": [{"name": "a", "engine": "vllm", "url": "http://127.0.0.1:9", "models": ["m"]}],
            "auth": {"keys": [{"name": f"k{n}", "key_sha256": hashlib.sha256(b"%d" % n).hexdigest()}
                              for n in range(keys)]}})

    started, reloaded = settings(2), settings(1)  # (a reload revoked one key; then worker 1 was started again)
    assert fleet_secret(started.state, [k.digest() for k in started.auth.keys]) != fleet_secret(
        reloaded.state, [k.digest() for k in reloaded.auth.keys])  # (what each derived before)
    secret = fleet_secret(started.state, [k.digest() for k in started.auth.keys])
    first, again = (Gateway(s, worker=WorkerIdentity(i, 2, "/nonexistent", secret))
                    for i, s in enumerate((started, reloaded)))
    assert first.shared is not None and again.shared is not None
    for sender, receiver in ((first.shared, again.shared), (again.shared, first.shared)):
        sealed = sender._seal.seal(b"peers", b"drain a")
        assert receiver._seal.open(b"peers", sealed).body == b"drain a"
