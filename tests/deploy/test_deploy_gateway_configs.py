"""Every gateway configuration under deploy/gateway passes `gateway check-config`, and each one is used."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_support import COMPOSE, GATEWAY_CONFIGS, KUBERNETES, check_config

pytestmark = pytest.mark.unit

CONFIGS = sorted(GATEWAY_CONFIGS.glob("*.yaml"))


def test_there_is_one_per_profile_and_one_for_kubernetes() -> None:
    assert {p.name for p in CONFIGS} == {"compose-cpu.yaml", "compose-gpu.yaml", "compose-emulated.yaml",
                                         "kubernetes.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=[p.name for p in CONFIGS])
def test_check_config_accepts_it(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = check_config(config, capsys)
    assert "OK" in out
    referenced = COMPOSE.read_text() + (KUBERNETES / "kustomization.yaml").read_text()
    assert config.name in referenced or config.name == "kubernetes.yaml"


def test_check_config_rejects_a_broken_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "gateway.yaml"
    broken.write_text((GATEWAY_CONFIGS / "compose-cpu.yaml").read_text().replace("url: http://", "url: tcp://"))
    with pytest.raises(AssertionError, match=r"backends\[0\] \(llamacpp\)\.url"):
        check_config(broken, capsys)
