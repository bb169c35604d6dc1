"""The Dockerfile's install steps, run here in a clean virtual environment: the build context its COPY lines
make, a wheel of it, that wheel installed with its dependencies from the registry (pip's cache reused), then the
installed `gateway` runs: --help, check-config on every deploy/gateway file, and `serve` answering the image's
own HEALTHCHECK command. Catches a dependency or package file missing from pyproject.toml that a checkout with
an editable install would hide."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_support import GATEWAY_CONFIGS, ROOT
from deploy_support import dockerfile_stage as stage

from tests.conftest import free_port
from tests.files import write_config
from tests.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.system]


def run(*cmd: str | Path, cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_NO_CACHE_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, cmd))} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result.stdout


def build_context(tmp: Path) -> Path:
    """What the build stage's COPY lines put in /src."""
    context = tmp / "src"
    context.mkdir()
    for op, args in stage("build"):
        if op != "COPY":
            continue
        *sources, dest = args.split()
        for source in sources:
            target = context / dest / (Path(source).name if dest.endswith("/") else "")
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / source, target)
    return context


def test_the_image_install_steps_work_in_a_clean_environment(tmp_path: Path) -> None:
    build_steps = " ".join(args for op, args in stage("build") if op == "RUN")
    # the steps below are these; change both together
    assert "python -m venv /opt/venv" in build_steps
    assert "python -m pip wheel --no-deps --wheel-dir /dist ." in build_steps
    assert "/opt/venv/bin/pip install /dist/*.whl" in build_steps

    context = build_context(tmp_path)
    assert sorted(p.name for p in context.iterdir()) == ["README.md", "gateway", "pyproject.toml"]
    venv = tmp_path / "venv"
    # (the venv without a pip of its own, and installed into without compiling: what is installed is the image's,
    # in a third of the time)
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path, timeout=120)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", tmp_path / "dist", ".",
        cwd=context, timeout=180)
    (wheel,) = (tmp_path / "dist").glob("llm_gateway-*.whl")
    run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-compile",
        "--disable-pip-version-check", wheel, cwd=tmp_path, timeout=300)

    gateway = venv / "bin" / "gateway"
    assert "check-config" in run(gateway, "--help", cwd=tmp_path, timeout=60)
    for config in sorted(GATEWAY_CONFIGS.glob("*.yaml")):
        assert "OK" in run(gateway, "check-config", config, cwd=tmp_path, timeout=60)
    where = run(venv / "bin" / "python", "-c", "import gateway, uvloop, httptools; print(gateway.__file__)",
                cwd=tmp_path, timeout=60)
    assert where.startswith(str(venv)), "the installed package, not the checkout"

    # `gateway serve` from the installed package answers the image's own HEALTHCHECK command
    port = free_port()
    config = tmp_path / "gateway.yaml"
    write_config(config, f"server: {{host: 127.0.0.1, port: {port}}}\n"
                      f"backends: [{{name: absent, engine: vllm, url: 'http://127.0.0.1:{free_port()}'}}]\n")
    healthcheck = json.loads(dict(stage("gateway"))["HEALTHCHECK"].split(" CMD ", 1)[1])
    assert healthcheck[0] == "python"
    probe = [str(venv / "bin" / "python"), *(a.replace(":8000/", f":{port}/") for a in healthcheck[1:])]
    server = subprocess.Popen([str(gateway), "serve", "--config", str(config), "--log-level", "warning"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def healthy() -> bool:
        assert server.poll() is None, f"gateway serve exited:\n{server.communicate()[0]}"
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0

    try:
        wait_until(healthy, "the HEALTHCHECK command succeeding", within=30)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode == 0
