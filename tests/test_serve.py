"""``gateway serve`` with no configuration: a working gateway in front of an emulated fleet, in one command."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import free_port_block


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_without_config_runs_the_emulated_fleet_and_shuts_down_cleanly(stop_signal: signal.Signals) -> None:
    port = free_port_block(5)
    base = port + 1
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--sim-base-port", str(base)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"gateway did not become ready:\n{proc.communicate()[0]}")
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["sim-llama-2-7b"]
        backends = set()
        for _ in range(12):
            raw = client.chat.completions.with_raw_response.create(
                model="sim-llama-2-7b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            backends.add(raw.headers["x-gateway-backend"])
        assert len(backends) >= 2, "least-load spreads requests over the emulated fleet"
    finally:
        proc.send_signal(stop_signal)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "EMULATED" in output
    access = [line for line in output.splitlines() if line.startswith('{"ts":')]
    assert len(access) >= 12 and all('"outcome":"success"' in line for line in access[:12]), output[-2000:]
    for p in range(base, base + 4):  # the fleet went with it
        try:
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=1)
            raise AssertionError(f"emulated server on {p} still answers")
        except httpx.TransportError:
            pass
