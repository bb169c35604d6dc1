"""What shared state costs a request: ``gateway bench overhead --state`` adds a gateway whose limits and slots
live in a loopback ``redis-server`` (Debian's, started here; ports ``base + 6`` and ``base + 7``), interleaved
with the others in every phase. Its backend has a ``max_concurrency`` (as the plain gateway's), so every
request holds a slot: one taken with an admission's round trip, or from the slots the gateway keeps
(``SharedState``'s kept slots), given back (or kept) after its last byte. Two more (``base + 9`` and
``base + 10``, the same redis-server) serve one key each, with a limit too high to bite: a
``requests_per_minute`` key and a ``tokens_per_minute`` key, whose requests and tokens are leased a few
requests' worth at a time; and two without Redis (``base + 11`` and ``base + 12``) serve the same keys with the
same limits from their own memory.
The report gives, per level, what each adds over the same gateway without shared state (TTFT p50/p99 and
end-to-end p50 in microseconds, CPU per request: the slots-only gateway against the plain one, each limited
key's against the same key without Redis), and how each gateway's admissions were decided over the run
(``gateway_state_admissions_total``: local, waited for another's round trip, or a round trip of their own).
After the levels phase each comparison runs again with its two gateways alone (``state_pairs``,
``--state-rounds``): the figure the scale-out target is judged on (see ``overhead._state_pairs``).

``--workers N`` adds a gateway of N worker processes (``server.workers``, on ``base + 8``) sharing that
redis-server (started for it when ``--state`` is not given): what the processes add or take away at each
level and at saturation, against the one-process gateway with the same shared state (or, without
``--state``, against the plain one)."""

from __future__ import annotations

import hashlib
import shutil
import urllib.request
from pathlib import Path
from typing import Any, Literal

from gateway.bench.procs import ChildProcess

STATEFUL = "gateway+redis"
LIMITED = "gateway+redis, rpm key"
TOKENS = "gateway+redis, tpm key"
LIMITED_LOCAL = "gateway, rpm key"  # the same key and limit in the gateway's own memory: what Redis is measured against
TOKENS_LOCAL = "gateway, tpm key"
LIMITED_KEY = "bench-limited-key"  # (loopback only; the gateway stores its SHA-256)


def state_counts(url: str) -> dict[str, Any]:
    """As the gateway at ``url`` counts them now: ``admissions``, ``gateway_state_admissions_total`` by path;
    ``lease_refills``, its leases' top-ups in the background (round trips no request waited on)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    paths: dict[str, int] = {}
    refills = 0
    for line in text.splitlines():
        if line.startswith('gateway_state_admissions_total{path="'):
            paths[line.split('"', 2)[1]] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("gateway_state_lease_refills_total "):
            refills = int(float(line.rsplit(" ", 1)[1]))
    return {"admissions": paths, "lease_refills": refills}


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


def stateful_gateway(base_port: int, gateway_yaml: str, logs: Path, python: str) -> tuple[ChildProcess, ChildProcess,
                                                                                          str]:
    """(redis-server, the gateway on ``base_port + 7`` configured with it, the gateway's URL). ``gateway_yaml``:
    the plain gateway's configuration, for another port; the state section is added here."""
    redis_port, port = base_port + 6, base_port + 7
    redis = redis_child(redis_port, logs)
    config = logs / "gateway-redis.yaml"
    config.write_text(gateway_yaml + state_section(redis_port, "slots"))
    gateway = ChildProcess(STATEFUL, [python, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                      "warning"], logs / "gateway-redis.log")
    return redis, gateway, f"http://127.0.0.1:{port}"


def limited_gateway(base_port: int, gateway_yaml: str, logs: Path, python: str,
                    limit: Literal["requests_per_minute", "tokens_per_minute"] = "requests_per_minute",
                    shared: bool = True) -> tuple[ChildProcess, str]:
    """(a gateway whose one key has ``limit``, too high to bite; its URL). ``shared``: with the redis-server on
    ``base_port + 6``, ``requests_per_minute`` on ``base_port + 9`` and ``tokens_per_minute`` on ``base_port +
    10``; else the same key in the gateway's own memory (what shared state is measured against), on ``base_port
    + 11`` and ``base_port + 12``. ``gateway_yaml``: the plain gateway's configuration for that port (see
    :func:`limited_port`)."""
    tokens = limit == "tokens_per_minute"
    name = (TOKENS if tokens else LIMITED) if shared else (TOKENS_LOCAL if tokens else LIMITED_LOCAL)
    digest = hashlib.sha256(LIMITED_KEY.encode()).hexdigest()
    stem = f"gateway-{'redis-' if shared else ''}{limit}"
    config = logs / f"{stem}.yaml"
    state = state_section(base_port + 6, "tokens" if tokens else "requests") if shared else ""
    config.write_text(gateway_yaml + state + f"auth:\n  keys:\n    - name: bench\n      key_sha256: {digest}\n"
                      f"      {limit}: 1000000000\n")
    gateway = ChildProcess(name, [python, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                  "warning"], logs / f"{stem}.log")
    return gateway, f"http://127.0.0.1:{limited_port(base_port, limit, shared)}"


def state_section(redis_port: int, fleet: str) -> str:
    """The ``state`` section of one gateway under test: the shared redis-server, under a key prefix of its own.
    Each is a deployment of its own: with one prefix the bench's stateful gateways would count each other as
    replicas, and each would spend the shared cores on the others' peer messages (the prompt blocks they
    route) during their turns."""
    return f"state:\n  url: redis://127.0.0.1:{redis_port}/0\n  prefix: \"bench-{fleet}:\"\n"


def limited_port(base_port: int, limit: Literal["requests_per_minute", "tokens_per_minute"], shared: bool) -> int:
    """The port of :func:`limited_gateway`'s gateway (its ``gateway_yaml`` is made for it)."""
    return base_port + (9 if limit == "requests_per_minute" else 10) + (0 if shared else 2)


def redis_child(port: int, logs: Path) -> ChildProcess:
    return ChildProcess("redis", [str(shutil.which("redis-server")), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"], logs / "redis.log")


def workers_name(count: int) -> str:
    return f"gateway x{count}"


def workers_gateway(base_port: int, gateway_yaml: str, logs: Path, python: str, count: int) -> tuple[ChildProcess, str]:
    """(the gateway of ``count`` workers on ``base_port + 8``, sharing the redis-server on ``base_port + 6``; its
    URL). ``gateway_yaml``: the plain gateway's configuration for that port; workers and state are added."""
    port = base_port + 8
    config = logs / "gateway-workers.yaml"
    config.write_text(gateway_yaml.replace("server:\n", f"server:\n  workers: {count}\n", 1)
                      + state_section(base_port + 6, "workers"))
    gateway = ChildProcess(workers_name(count), [python, "-m", "gateway", "serve", "--config", str(config),
                                                 "--log-level", "warning"], logs / "gateway-workers.log")
    return gateway, f"http://127.0.0.1:{port}"
