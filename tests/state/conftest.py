"""A real redis-server (Debian's package; scripts/test installs it), started by the tests on a free loopback
port, without persistence; it can be killed and started again on the same port."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port


class RedisServer:
    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed (Debian: apt-get install redis-server; scripts/test does it)")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._workdir), "--logfile", str(self._workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start:\n{(self._workdir / 'redis.log').read_text()}")
            time.sleep(0.05)

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
