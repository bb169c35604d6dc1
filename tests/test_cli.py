"""The command line as a newcomer meets it: a missing optional extra is one line saying what to install, and
`gateway bench --help` shows the benchmarks it has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.bench.cli import SUBCOMMANDS
from gateway.cli import main

pytestmark = pytest.mark.unit


def run_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`gateway ARGS` in a fresh interpreter where importing ``module`` fails as if it were not installed."""
    code = (f"import sys; sys.modules[{module!r}] = None; from gateway.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.system
def test_llamacpp_model_without_its_extra_says_what_to_install(tmp_path: Path) -> None:
    done = run_without("gguf", "llamacpp", "model", "--out", str(tmp_path / "m.gguf"))
    assert done.returncode == 2
    assert done.stderr == ("error: 'gateway llamacpp model' needs the llamacpp extra (no module named 'gguf'): "
                           "pip install 'llm-gateway[llamacpp]'\n")
    assert not list(tmp_path.iterdir())


@pytest.mark.system
def test_bench_without_its_extra_says_what_to_install(tmp_path: Path) -> None:
    # nothing listens on the discard port: the run records errors, then the report needs rich
    done = run_without("rich", "bench", "--target", "closed=http://127.0.0.1:9", "--model", "m", "--count", "1",
                       "--no-chart", "--no-progress", "--out", str(tmp_path / "bench"))
    assert done.returncode == 2
    assert done.stderr == ("error: 'gateway bench' needs the bench extra (no module named 'rich'): "
                           "pip install 'llm-gateway[bench]'\n")


def test_other_missing_modules_are_not_blamed_on_an_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: list[str]) -> int:
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    monkeypatch.setattr("gateway.llamacpp.cli.main", broken)
    with pytest.raises(ModuleNotFoundError, match="yaml"):
        main(["llamacpp", "build"])


def test_bench_help_lists_its_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    usage = out.splitlines()[0]
    listed = {line.split()[0] for line in out.split("benchmarks (")[1].splitlines()[1:] if line.startswith("  ")}
    for name in ("overhead", "routing", "soak", "faults"):
        assert name in usage
        assert name in listed
    assert "gateway profile" in out


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_listed_subcommand_runs(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: gateway bench {name}")
