"""Shared by tests/deploy: where the deployment files are, the tools that check them, reading the Dockerfile."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from gateway.cli import main as gateway_main

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
GATEWAY_CONFIGS = ROOT / "deploy" / "gateway"
KUBERNETES = ROOT / "deploy" / "kubernetes"
CONFIG_PATH_IN_IMAGE = "/etc/gateway/gateway.yaml"


def tool(name: str) -> str:
    """A command-line tool from the dev extra: next to this interpreter (the virtualenv), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; it comes with the dev extra: pip install -e '.[dev]'")
    return found


def check_config(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run `gateway check-config PATH`; fail with its error output unless it exits 0."""
    code = gateway_main(["check-config", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, f"gateway check-config {path} exited {code}:\n{err}{out}"
    return out


def dockerfile_instructions() -> list[tuple[str, str, str]]:
    """(stage, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out, stage = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        if op.upper() == "FROM":
            stage = args.split(" AS ")[-1].strip() if " AS " in args else args
        out.append((stage, op.upper(), args.strip()))
    return out


def dockerfile_stage(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of one build stage."""
    return [(op, args) for s, op, args in dockerfile_instructions() if s == name]
