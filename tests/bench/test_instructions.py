"""``gateway bench instructions``: a gateway process counted by callgrind (valgrind, which the test suite's
system packages include), per request and per chunk, for one checkout or several."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.bench.instructions import InstructionsConfig, counted, main, measure, plot
from gateway.bench.runner import run_sync
from tests.conftest import free_port_block

ROOT = Path(__file__).resolve().parents[2]


def test_a_dump_is_read_for_its_totals(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.out.1"
    dump.write_text("version: 1\ncmd: python -m gateway serve\npart: 1\nevents: Ir\nsummary: 0\ntotals: 123491512\n")
    assert counted(dump) == 123_491_512
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals"):
        counted(tmp_path / "empty")


def test_a_tiny_real_count_of_two_checkouts(tmp_path: Path) -> None:
    """This checkout twice, as two 'checkouts' (a path and '.'): every figure present and positive, the same
    chunk counts, and the two counts within a few percent of each other (the same code: what callgrind's
    determinism buys over /proc's CPU time)."""
    cfg = InstructionsConfig(code=[str(ROOT), "."], requests=12, concurrency=4, tokens=(1, 6), warmup=4,
                             base_port=free_port_block(2), out=tmp_path)
    doc = run_sync(measure(cfg, log=lambda *_: None))
    a, b = doc["code"][str(ROOT)], doc["code"]["."]
    for entry in (a, b):
        assert [(r["max_tokens"], r["requests"], r["chunks"]) for r in entry["runs"]] == [(1, 12, 12), (6, 12, 72)]
        assert all(r["instructions"] > 0 for r in entry["runs"])
        assert entry["runs"][1]["instructions"] > entry["runs"][0]["instructions"], "more chunks, more work"
        assert entry["per_request"] > 0 and entry["per_chunk"] > 0
    assert a["vs_first"] == {"per_request": 1.0, "per_chunk": 1.0}
    assert b["vs_first"]["per_request"] == pytest.approx(1.0, abs=0.05)
    assert plot(doc, tmp_path / "chart.png").stat().st_size > 10_000


def test_the_command_refuses_what_is_not_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="no gateway package there"):
        main(["--code", str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        main(["--tokens", "4,4"])
    assert "two different chunk counts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
