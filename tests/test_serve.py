"""``gateway serve`` with no configuration: a working gateway in front of an emulated fleet, in one command."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from gateway.config import settings_from_mapping
from gateway.serve import warn_if_open
from gateway.sim import FleetThread, SimSpec
from tests.conftest import free_port_block
from tests.files import write_config
from tests.test_admin_listener import wait_ready
from tests.waiting import wait_until

pytestmark = pytest.mark.system


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_serve_without_config_runs_the_emulated_fleet_and_shuts_down_cleanly(stop_signal: signal.Signals) -> None:
    port = free_port_block(10)
    base, admin = port + 1, port + 9  # (the fleet: 4 servers of sim-llama-2-7b, 4 of sim-agent)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--sim-base-port", str(base),
         "--admin-port", str(admin)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    def ready() -> bool:
        assert proc.poll() is None, "gateway exited"
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200
        except httpx.TransportError:
            return False

    try:
        try:
            wait_until(ready, "gateway ready", within=30)
        except AssertionError as exc:
            proc.kill()
            raise AssertionError(f"{exc}:\n{proc.communicate()[0]}") from None
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["sim-agent", "sim-llama-2-7b"]
        backends = set()
        for _ in range(12):
            raw = client.chat.completions.with_raw_response.create(
                model="sim-llama-2-7b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            backends.add(raw.headers["x-gateway-backend"])
        assert len(backends) >= 2, "least-load spreads requests over the emulated fleet"
        # the admin listener and its status page, for a look at the fleet
        assert "<title>LLM gateway: status</title>" in httpx.get(f"http://127.0.0.1:{admin}/ui").text
        status = httpx.get(f"http://127.0.0.1:{admin}/admin/status").json()
        assert len(status["backends"]) == 8 and sum(b["recent"]["requests"] for b in status["backends"]) >= 12
        # an agent-sized request (Claude Code's first: ~12k tokens of prompt, max_tokens 32,000) fits sim-agent
        agent = client.chat.completions.create(
            model="sim-agent", max_tokens=32_000,
            messages=[{"role": "system", "content": "word " * 12_000}, {"role": "user", "content": "Hi"}])
        assert agent.choices[0].message.content
    finally:
        proc.send_signal(stop_signal)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "EMULATED" in output and f"Status page: http://127.0.0.1:{admin}/ui" in output
    access = [line for line in output.splitlines() if line.startswith('{"ts":')]
    assert len(access) >= 12 and all('"outcome":"success"' in line for line in access[:12]), output[-2000:]
    for p in range(base, base + 4):  # the fleet went with it
        try:
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=1)
            raise AssertionError(f"emulated server on {p} still answers")
        except httpx.TransportError:
            pass


def test_a_standard_error_nobody_reads_never_stalls_the_gateway(tmp_path: Path) -> None:
    """Diagnostic logs go through a thread of their own: with stderr a pipe nobody reads (a stalled log
    collector), debug logging of every request fills the pipe and the gateway keeps serving."""
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=50.0)]) as fleet:
        port = free_port_block(1)
        config = tmp_path / "gateway.yaml"
        write_config(config, yaml.safe_dump({"server": {"port": port}, "access_log": {"enabled": False},
                                          "backends": [{"name": "v", "engine": "vllm",
                                                        "url": fleet.fleet.servers[0].url}]}))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config),
                                 "--log-level", "debug"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            with httpx.Client(base_url=url, timeout=10) as client:
                # ~600 debug lines, several times what a pipe holds
                codes = [client.post("/v1/chat/completions", json=body).status_code for _ in range(600)]
            assert codes == [200] * 600
            assert proc.stderr is not None
            os.set_blocking(proc.stderr.fileno(), False)
            assert len(proc.stderr.read(1 << 20) or b"") >= 60_000  # (the pipe did fill)
        finally:
            proc.kill()
            proc.communicate(timeout=30)


def test_a_gateway_without_keys_says_once_that_it_is_open(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It served everyone without a word; on a non-loopback address it now says so loudly, and how to add keys."""
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=50.0)]) as fleet:
        port = free_port_block(1)
        config = tmp_path / "gateway.yaml"
        write_config(config, yaml.safe_dump({"server": {"host": "0.0.0.0", "port": port},
                                          "backends": [{"name": "v", "engine": "vllm",
                                                        "url": fleet.fleet.servers[0].url}]}))
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}")
        finally:
            proc.send_signal(signal.SIGTERM)
            _, errors = proc.communicate(timeout=30)
    warnings = [line for line in errors.splitlines() if "API KEYS" in line.upper()]
    assert len(warnings) == 1 and " WARNING " in warnings[0], errors[-3000:]
    assert f"NO API KEYS, AND 0.0.0.0:{port} CAN BE REACHED FROM OTHER MACHINES" in warnings[0]
    assert "list them under auth.keys" in warnings[0]
    # on loopback it is said too, plainly; with keys, nothing
    open_here = settings_from_mapping({"server": {"port": 8000}})
    keyed = settings_from_mapping({"auth": {"keys": [{"name": "a", "key_sha256": "a" * 64}]}})
    with caplog.at_level(logging.WARNING, logger="gateway.serve"):
        warn_if_open(open_here)
        warn_if_open(keyed)
    assert [r.getMessage()[:58] for r in caplog.records] == [
        "no API keys: the gateway on 127.0.0.1:8000 serves anyone w"]



def test_a_gateway_started_while_its_file_is_rewritten_in_place_starts_from_the_whole_file(tmp_path: Path) -> None:
    """Sweep 27: a gateway started while its file was rewritten in place (tee, scp, a template) read a prefix, and
    cut before ``auth:`` it started open. A file written within the last 2 s is read once it has held still."""
    with FleetThread([SimSpec(engine="vllm", model="m", name="v", time_scale=50.0)]) as fleet:
        port = free_port_block(1)
        config = tmp_path / "gateway.yaml"
        whole = yaml.safe_dump({"server": {"port": port}, "backends": [
            {"name": "v", "engine": "vllm", "url": fleet.fleet.servers[0].url}], "auth": {"keys": [
                {"name": "team", "key_sha256": "0" * 64}]}}, sort_keys=False)
        config.write_text(whole[:whole.index("auth:")])  # (what a reader finds halfway through the write)
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            # the writer is still at it (the file modified now and then) until the gateway has read what there is
            # (its access time moves past the modification's)
            def read_yet() -> bool:
                assert proc.poll() is None, "the gateway exited"
                seen = config.stat()
                if seen.st_atime_ns > seen.st_mtime_ns:
                    return True
                os.utime(config)
                return False

            wait_until(read_yet, "the gateway reading the file being written", within=60)
            with config.open("a") as rest:
                rest.write(whole[whole.index("auth:"):])
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, url)
            models = httpx.get(url + "/v1/models")
            assert models.status_code == 401, models.text  # (keys in force: started from the whole file)
        finally:
            proc.kill()
            proc.communicate(timeout=30)
