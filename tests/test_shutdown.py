"""Graceful shutdown: on SIGTERM the gateway stops accepting, lets a stream in flight finish, then exits."""

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
    base = free_port_block(2)
    fleet = subprocess.Popen([sys.executable, "-m", "gateway.sim", "serve", "--engine", "vllm", "--model", "m",
                              "--port", str(base)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"server": {"port": base + 1, "shutdown_timeout": 20},
                                      "backends": [{"name": "v", "engine": "vllm", "url": f"http://127.0.0.1:{base}"}]}))
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--log-level",
                                "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_up(f"http://127.0.0.1:{base}/health", fleet)
        url = f"http://127.0.0.1:{base + 1}"
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
            received.extend(chunks)
        text = b"".join(received)
        assert text.rstrip().endswith(b"data: [DONE]") and b'"finish_reason":"length"' in text
        assert refused, "no new connections once shutting down"
        assert gateway.wait(timeout=20) == 0
    finally:
        for proc in (gateway, fleet):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
