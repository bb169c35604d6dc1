"""A real redis-server (Debian's package; scripts/test installs it), started by the tests on a free loopback
port, without persistence; it can be killed and started again on the same port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.bench.procs import ChildProcess
from tests.conftest import free_port
from tests.files import write_config
from tests.waiting import wait_until


class RedisServer:
    """``password``: the server asks for it (``requirepass``); ``url`` then carries none."""

    def __init__(self, port: int, workdir: Path, password: str | None = None) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.password = password
        self._workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (Debian: apt-get install redis-server; scripts/test does it)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._workdir), "--logfile", str(self._workdir / "redis.log"),
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(self._answers, "redis-server answering PING")
        except AssertionError as exc:
            raise RuntimeError(f"{exc}:\n{(self._workdir / 'redis.log').read_text()}") from None
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError("redis-server exited")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path).start()
    yield server
    server.kill()


def start_replica(tmp: Path, i: int, port: int, redis: RedisServer, **config: Any) -> tuple[ChildProcess, str]:
    """Gateway replica ``i`` (a process) on ``port`` with the shared state in ``redis``, a 0.2 s heartbeat and
    scrape, a 60 s queue wait and ``config`` for the rest (backends, auth); its URL. Not waited for."""
    settings = {"server": {"host": "127.0.0.1", "port": port},
                # (a 5 s scrape timeout: a loaded CI machine once stalled the emulators' thread past 1 s, a
                # replica took both backends for down and answered 13 requests 503)
                "scrape": {"interval": 0.2, "timeout": 5.0},
                "state": {"url": redis.url, "heartbeat_seconds": 0.2, "replica_ttl_seconds": 3},
                "admission": {"max_wait_seconds": 60}, **config}
    path = tmp / f"gateway-{i}.yaml"
    write_config(path, yaml.safe_dump(settings))
    proc = ChildProcess(f"gateway-{i}", [sys.executable, "-m", "gateway", "serve", "--config", str(path),
                                         "--log-level", "warning"], tmp / f"gateway-{i}.log").start()
    return proc, f"http://127.0.0.1:{port}"
