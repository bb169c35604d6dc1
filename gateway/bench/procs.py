"""Child processes for benchmarks: start, wait until they answer, stop (by their own pid only)."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType


class ChildProcess:
    """A command run with its output in ``log``; ``wait_http`` polls a URL until it answers 200."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ChildProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as fh:
            self.proc = subprocess.Popen(self.cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait_http(self, url: str, timeout: float = 60.0, method: str = "GET", body: bytes | None = None,
                  headers: dict[str, str] | None = None) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}; see {self.log}")
            try:
                req = urllib.request.Request(url, data=body, method=method,
                                             headers={"Content-Type": "application/json", **(headers or {})})
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        resp.read()
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} did not answer {url} within {timeout:.0f} s ({last}); see {self.log}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def __enter__(self) -> ChildProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def get_json(url: str, method: str = "GET") -> object:
    import json

    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())
