"""docker/Dockerfile: hadolint, and the promises the rest of the deployment relies on (non-root user, health
check, the config path and port that compose.yaml and the Kubernetes manifests use, what .dockerignore keeps)."""

from __future__ import annotations

import fnmatch
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_support import COMPOSE, CONFIG_PATH_IN_IMAGE, DOCKERFILE, ROOT, tool
from deploy_support import dockerfile_instructions as instructions
from deploy_support import dockerfile_stage as stage

pytestmark = pytest.mark.unit


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.system
def test_hadolint_passes() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.system
def test_hadolint_really_lints(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get update && apt-get install -y curl\n")
    result = hadolint(bad)
    assert result.returncode != 0 and "DL3006" in result.stdout  # untagged base image


def test_stages_and_the_default_target() -> None:
    froms = [args for _, op, args in instructions() if op == "FROM"]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE} AS base", "base AS sim", "base AS gateway"]
    assert 'ARG PYTHON_IMAGE=python:3.11-slim' in DOCKERFILE.read_text()
    # the runtime gets the virtual environment, not the build tree
    assert ("COPY", "--from=build /opt/venv /opt/venv") in stage("base")


def test_runs_as_a_non_root_user() -> None:
    users = [args for op, args in stage("base") if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert not [args for s, op, args in instructions() if op == "USER" and s in ("sim", "gateway")]


def test_the_gateway_serves_its_mounted_config_on_8000_with_a_health_check() -> None:
    gateway = dict(stage("gateway"))
    assert gateway["EXPOSE"] == "8000"
    assert "/health" in gateway["HEALTHCHECK"] and ":8000/" in gateway["HEALTHCHECK"]
    assert gateway["CMD"] == f'["serve", "--config", "{CONFIG_PATH_IN_IMAGE}", "--host", "0.0.0.0"]'
    assert dict(stage("base"))["ENTRYPOINT"] == '["gateway"]'


def test_the_sim_target_is_what_compose_runs() -> None:
    sim = dict(stage("sim"))
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert sim["CMD"] == str(services["sim"]["command"]).replace("'", '"')
    ports = [int(p) for p in sim["EXPOSE"].split()]
    assert ports == list(range(18001, 18005)) and "range(18001, 18005)" in sim["HEALTHCHECK"]


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            glob = pattern.lstrip("!").rstrip("/").replace("**/", "*/").replace("**", "*")
            if fnmatch.fnmatch(path, glob) or fnmatch.fnmatch(path, glob + "/*") or path == glob:
                verdict = not negate
        return verdict

    copied = [args.split()[:-1] for op, args in stage("build") if op == "COPY"]
    for source in (s for sources in copied for s in sources):
        assert (ROOT / source).exists(), source
        assert not ignored(source), f".dockerignore drops {source}, which the build copies"
    assert ignored("tests") and ignored(".venv") and ignored("reports") and not ignored("gateway/cli.py")
