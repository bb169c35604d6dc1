"""Package-level checks: import isolation, CLI, fleet YAML, default fleet."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.sim import FleetThread, SimSpec, default_fleet_specs
from gateway.sim.cli import load_fleet_yaml

pytestmark = pytest.mark.unit

SIM = Path(__file__).resolve().parents[2] / "gateway" / "sim"
ALLOWED = ("gateway.sim", "gateway.structured.syntax", "gateway.kvcache.contexts")


def test_sim_imports_nothing_else_from_gateway() -> None:
    """Except the constraint parsers it samples from and the leaf that opens ZeroMQ contexts safely: tooling
    may use the product (never the reverse)."""
    offenders = []
    files = list(SIM.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom) and node.level > 0:
                depth = len(path.relative_to(SIM).parts) - 1
                if node.level > depth + 1:
                    offenders.append(f"{path}: relative import above gateway.sim")
            offenders += [f"{path}: {n}" for n in names
                          if (n == "gateway" or n.startswith("gateway."))
                          and not n.startswith(ALLOWED)]
    assert offenders == []


def test_default_fleet_specs() -> None:
    specs = default_fleet_specs()
    assert [s.engine for s in specs] == ["llamacpp", "vllm", "sglang", "tabbyapi"]
    assert [s.port for s in specs] == [18001, 18002, 18003, 18004]
    assert {s.model for s in specs} == {"sim-llama-2-7b"}
    assert [s.profile for s in specs] == ["llamacpp", "vllm", "sglang", "exllamav2"]
    assert specs[0].name == "sim-llamacpp"


def test_spec_validates_overrides() -> None:
    assert SimSpec(engine="vllm", model="m", overrides={"max_seqs": 3}).resolved_profile().max_seqs == 3
    with pytest.raises(ValueError, match="unknown profile parameter"):
        SimSpec(engine="vllm", model="m", overrides={"nope": 1})


@pytest.mark.integration
def test_fleet_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "fleet.yaml"
    cfg.write_text("base_port: 0\ndefaults: {time_scale: 50}\nservers:\n"
                   "  - {engine: vllm, model: m1, name: a}\n"
                   "  - {engine: sglang, model: m1, name: b, set: {max_seqs: 2}}\n")
    specs = load_fleet_yaml(cfg)
    assert [s.name for s in specs] == ["a", "b"] and specs[1].resolved_profile().max_seqs == 2
    with FleetThread([SimSpec(**{**s.__dict__, "port": 0}) for s in specs]) as ft, httpx.Client() as c:
        assert c.get(ft.fleet["b"].url + "/v1/loads").json()["loads"][0]["max_running_requests"] == 2


@pytest.mark.system
def test_cli_serve_prints_emulated_and_exits_on_sigterm() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "gateway.sim", "serve", "--engine", "sglang", "--port", str(port),
                             "--model", "m"], stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "EMULATED" in line and "sglang" in line and f":{port}" in line and "m" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
