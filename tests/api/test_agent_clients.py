"""Claude Code and Codex, as released on npm, headless through the gateway with their defaults (only the base URL,
a key and a model set): a tool round trip with a reasoning model on every engine kind of the emulated agent
fleet, and with a real llama-server (its generated agent model calls the tool llama.cpp's grammar lets it).

Issue 42 found neither working with its defaults; these run the real clients, so a client release that sends
something new shows here first. Safety: each client runs in a scratch directory with its own scratch home,
reaches loopback only (its traffic, telemetry and updates off), and has what runs commands or reaches the web
turned off (Claude Code ``--restricted`` and its editing and web tools disallowed; Codex's shell tools off,
``--sandbox read-only``): the emulated model calls the first tool it is offered with arguments it makes up.

The clients are installed from npm into ``~/.cache/llm-gateway/agents`` on first use (~760 MB, ~10 s); the test
skips only when they are not there and npm cannot fetch them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.app import create_app
from gateway.llamacpp.build import cache_lock
from gateway.llamacpp.server import LlamaServer
from gateway.sim import FleetThread, agent_fleet_specs
from tests.api.conftest import ENGINES, TIME_SCALE, gateway_settings
from tests.conftest import AGENT_LLAMA, ServerThread, serve_in_thread

pytestmark = pytest.mark.system

CLIENTS = {"@anthropic-ai/claude-code": "2.1.328", "@openai/codex": "0.169.0"}
CACHE = Path(os.environ.get("LLM_GATEWAY_CACHE", Path.home() / ".cache" / "llm-gateway")) / "agents" / "npm"
BIN = CACHE / "node_modules" / ".bin"


def _installed() -> bool:
    for package, version in CLIENTS.items():
        manifest = CACHE / "node_modules" / package / "package.json"
        if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != version:
            return False
    return (BIN / "claude").exists() and (BIN / "codex").exists()


@pytest.fixture(scope="module")
def clients() -> Path:
    if _installed():
        return BIN
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent clients cannot be fetched")
    with cache_lock("agents-npm"):  # (the suite's other process may be installing them)
        if not _installed():
            CACHE.mkdir(parents=True, exist_ok=True)
            run = subprocess.run([npm, "install", "--prefix", str(CACHE), "--no-audit", "--no-fund",
                                  "--loglevel=error", *(f"{p}@{v}" for p, v in CLIENTS.items())],
                                 capture_output=True, text=True, timeout=600)
            if run.returncode != 0 or not _installed():
                pytest.skip(f"npm could not install the agent clients: {run.stderr[-500:]}")
    return BIN


class _Lines(logging.Handler):
    """The gateway's access-log lines, as dicts."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture(scope="module")
def gateway(agent_llama: LlamaServer) -> Iterator[tuple[ServerThread, _Lines]]:
    specs = [replace(s, model=f"agent-{s.engine}") for s in agent_fleet_specs(base_port=0, time_scale=TIME_SCALE)]
    lines = _Lines()
    logger = logging.getLogger("gateway.access")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with (FleetThread(specs) as fleet,
              serve_in_thread(create_app(gateway_settings(fleet.fleet.servers,
                                                          real={"llama-agent": agent_llama.url}))) as gw):
            yield gw, lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def _scratch(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "hello.txt").write_text("The secret word is banana.\n")
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    return work, env


MODELS = {**{engine: f"agent-{engine}" for engine in ENGINES}, "llama-server": AGENT_LLAMA}


def _requests(lines: _Lines, model: str) -> list[dict[str, Any]]:
    return [line for line in lines.lines if line.get("model") == model]


@pytest.mark.parametrize("engine", MODELS)
def test_claude_code_completes_a_tool_round_trip(clients: Path, gateway: tuple[ServerThread, _Lines], engine: str,
                                                 tmp_path: Path) -> None:
    gw, lines = gateway
    work, env = _scratch(tmp_path)
    env.update({"ANTHROPIC_BASE_URL": gw.url, "ANTHROPIC_API_KEY": "sk-local",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"})
    model = MODELS[engine]
    before = len(lines.lines)
    run = subprocess.run([str(clients / "claude"), "-p", "Read hello.txt and tell me the secret word", "--model",
                          model, "--output-format", "json", "--no-session-persistence", "--restricted",
                          "--disallowedTools", "Edit", "Write", "NotebookEdit", "WebSearch", "WebFetch"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=240)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert run.returncode == 0 and not result["is_error"], (run.stdout[-2000:], run.stderr[-2000:])
    seen = _requests(since(lines, before), model)
    # every request it sent was answered, none refused first (it used to resend each, one feature less a time)
    assert seen and all(line["status"] == 200 for line in seen), [(s["route"], s["status"]) for s in seen]
    assert result["num_turns"] >= 2 and len(seen) >= 2  # a call, its result, an answer: a round trip
    assert {line["route"] for line in seen} == {"messages"} and all(line["stream"] for line in seen)


@pytest.mark.parametrize("engine", MODELS)
def test_codex_completes_a_tool_round_trip(clients: Path, gateway: tuple[ServerThread, _Lines], engine: str,
                                           tmp_path: Path) -> None:
    gw, lines = gateway
    work, env = _scratch(tmp_path)
    env.update({"CODEX_HOME": env["HOME"], "GATEWAY_KEY": "sk-local"})
    model = MODELS[engine]
    before = len(lines.lines)
    provider = {"name": "gateway", "base_url": gw.url + "/v1", "env_key": "GATEWAY_KEY", "wire_api": "responses"}
    overrides = [f"model_providers.gateway.{k}={json.dumps(v)}" for k, v in provider.items()]
    overrides += ['model_provider="gateway"', "features.shell_tool=false", "features.unified_exec=false"]
    run = subprocess.run([str(clients / "codex"), "exec", "--skip-git-repo-check", "--sandbox", "read-only",
                          "--json", *(a for o in overrides for a in ("-c", o)), "-m", model,
                          "Tell me the secret word in hello.txt"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("item", {}).get("type") for e in events if e.get("type") == "item.completed"]
    assert "agent_message" in kinds, kinds  # it answered
    seen = _requests(since(lines, before), model)
    assert seen and all(line["status"] == 200 for line in seen), [(s["route"], s["status"]) for s in seen]
    assert len(seen) >= 2 and {line["route"] for line in seen} == {"responses"}  # a call, its result, an answer


def since(lines: _Lines, start: int) -> _Lines:
    """The lines logged from ``start`` on (this test's)."""
    out = _Lines()
    out.lines = lines.lines[start:]
    return out


def test_the_published_matrix_is_the_one_these_tests_run() -> None:
    """docs/agent-apis.md's client x backend matrix names the client versions these tests install and the
    backends they run on (a client bumped here, or a backend added, shows there)."""
    from importlib.metadata import version

    docs = (Path(__file__).resolve().parents[2] / "docs" / "agent-apis.md").read_text()
    header, *rows = [line for line in docs.splitlines()
                     if line.startswith("| ") and ("round trip" in line or line.startswith("| client (version)"))]
    columns = [c.strip() for c in header.strip("|").split("|")][2:]
    assert columns == ["llama.cpp", "vLLM", "SGLang", "TabbyAPI", "real llama-server"]
    assert len(columns) == len(MODELS)  # (ENGINES in that order, then the real server)
    expected = {"Claude Code": CLIENTS["@anthropic-ai/claude-code"], "Codex CLI": CLIENTS["@openai/codex"],
                "OpenAI Agents SDK": version("openai-agents")}
    named = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        client, _, at = cells[0].partition(" (")[0].rpartition(" ")
        named[client] = at
        assert cells[2:] == ["round trip"] * len(MODELS), row
    assert named == expected
