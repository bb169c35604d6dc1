"""Run a real ``llama-server`` process on loopback (tests, calibration, local CPU backends)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import TracebackType

import httpx


class LlamaServer:
    """``with LlamaServer(binary, model, port) as server: server.url``.

    Started with ``--metrics``, ``slots`` parallel slots sharing ``ctx`` tokens of context, ``threads`` CPU
    threads, and no host-RAM prompt cache unless ``cache_ram_mib`` is given (so a prefix is cached in a slot
    or not at all, which makes prefix tests deterministic). Waits until ``/health`` answers 200.
    """

    def __init__(
        self,
        binary: Path,
        model: Path,
        port: int,
        *,
        slots: int = 2,
        ctx: int = 4096,
        threads: int = 1,
        cache_ram_mib: int = 0,
        api_key: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.api_key = api_key
        self.args = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(ctx * slots), "-t", str(threads), "-tb", str(threads),
            "--metrics", "--no-webui", "--cache-ram", str(cache_ram_mib), *extra,
        ]
        if api_key:
            self.args += ["--api-key", api_key]
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(f"/tmp/llama-server-{port}.log")

    def start(self, timeout: float = 60.0) -> LlamaServer:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text()[-3000:]
                raise RuntimeError(f"llama-server did not become healthy in {timeout} s:\n{tail}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> LlamaServer:
        try:
            return self.start()
        except BaseException:  # (interrupted while it starts: never leave it running)
            self.stop()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
