"""Graceful shutdown: on SIGTERM the gateway stops accepting, lets a stream in flight finish, then exits; its
admin listener still shows the state meanwhile but takes no change."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from tests.conftest import free_port_block


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_lets_the_stream_in_flight_finish(tmp_path: Path) -> None:
    base = free_port_block(3)
    fleet = subprocess.Popen([sys.executable, "-m", "gateway.sim", "serve", "--engine", "vllm", "--model", "m",
                              "--port", str(base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": base + 1, "admin_port": base + 2,
                                                 "shutdown_timeout": 20},
                                      "backends": [{"name": "v", "engine": "vllm", "url": f"http://127.0.0.1:{base}"}]}))
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(f"http://127.0.0.1:{base}/health", fleet)
        url = f"http://127.0.0.1:{base + 1}"
        admin = f"http://127.0.0.1:{base + 2}/admin"
        wait_up(url + "/ready", gateway)
        body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "max_tokens": 300,
                "ignore_eos": True, "stream": True}  # ~1.7 s at the emulated 175 tok/s
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as response:
            chunks = response.iter_bytes()
            received = [next(chunks)]
            gateway.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            try:
                httpx.get(url + "/health", timeout=1)
                refused = False
            except httpx.TransportError:
                refused = True
            # (before the fix a drain and a reload were applied here, 3 s into a shutdown)
            changes = [httpx.post(admin + "/backends/v/drain", timeout=5), httpx.post(admin + "/reload", timeout=5)]
            status = httpx.get(admin + "/status", timeout=5)
            received.extend(chunks)
        text = b"".join(received)
        assert text.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in text
        assert refused, "no new connections once shutting down"
        for change in changes:
            assert change.status_code == 503 and change.json()["error"]["code"] == "shutting_down", change.text
        assert status.status_code == 200 and "v" in status.text
        assert gateway.wait(timeout=20) == 0
    finally:
        for proc in (gateway, fleet):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
