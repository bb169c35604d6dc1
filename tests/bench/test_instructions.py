"""``gateway bench instructions``: a gateway process counted by callgrind (valgrind, which the test suite's
system packages include), per request and per chunk, for one checkout or several."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.bench.instructions import InstructionsConfig, counted, functions, main, measure, plot, top_functions
from gateway.bench.runner import run_sync
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_a_dump_is_read_for_its_totals(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.out.1"
    dump.write_text("version: 1\ncmd: python -m gateway serve\npart: 1\nevents: Ir\nsummary: 0\ntotals: 123491512\n")
    assert counted(dump) == 123_491_512
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals"):
        counted(tmp_path / "empty")


ANNOTATED = """\
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
114,666,664 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
28,391,678 (24.76%)  /tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/usr/lib/libpython3.11.so.1.0]
 4,822,800 ( 4.21%)  /tmp/Python-3.11.7/./Modules/_sre/sre_lib.h:sre_ucs1_match [/usr/lib/libpython3.11.so.1.0]
 2,746,686 ( 2.40%)  ???:0x00000000000284f0 [/venv/site-packages/orjson/orjson.cpython-311-x86_64-linux-gnu.so]
 2,122,612 ( 1.85%)  ???:0x0000000000013cc0 [/venv/site-packages/orjson/orjson.cpython-311-x86_64-linux-gnu.so]
   743,879 ( 0.65%)  /tmp/Python-3.11.7/./Include/object.h:_PyEval_EvalFrameDefault'2
   100,000 ( 0.09%)  /tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault [/usr/lib/libpython3.11.so.1.0]
"""


def test_callgrind_annotate_table_is_read_per_function() -> None:
    """Self cost per function: the program total is not a function, recursion levels and inlined parts merge,
    and code without symbols is counted per library."""
    assert functions(ANNOTATED) == {"_PyEval_EvalFrameDefault": 28_391_678 + 743_879 + 100_000,
                                    "sre_ucs1_match": 4_822_800,
                                    "???@orjson.cpython-311-x86_64-linux-gnu.so": 2_746_686 + 2_122_612}


def test_each_functions_share_is_solved_like_the_totals() -> None:
    """Two runs of 100 requests, 4 and 64 chunks each: a function that costs 1,000 per request and 10 per chunk,
    one only per chunk, one only per request; each list longest first."""
    runs = [{"requests": 100, "chunks": 400, "functions": {"both": 100 * 1000 + 400 * 10, "chunk": 400 * 50,
                                                           "request": 100 * 7000}},
            {"requests": 100, "chunks": 6400, "functions": {"both": 100 * 1000 + 6400 * 10, "chunk": 6400 * 50,
                                                            "request": 100 * 7000}}]
    top = top_functions(runs)
    assert top["per_request"] == [["request", 7000], ["both", 1000], ["chunk", 0]]
    assert top["per_chunk"] == [["chunk", 50], ["both", 10], ["request", 0]]


@pytest.mark.system
def test_a_tiny_real_count_of_two_checkouts(tmp_path: Path) -> None:
    """This checkout twice, as two 'checkouts' (a path and '.'): every figure present and positive, the same
    chunk counts, and the two counts within a few percent of each other (the same code: what callgrind's
    determinism buys over /proc's CPU time)."""
    cfg = InstructionsConfig(code=[str(ROOT), "."], requests=12, concurrency=4, tokens=(1, 6), warmup=4,
                             idle_s=1.0, base_port=free_port_block(2), out=tmp_path)
    doc = run_sync(measure(cfg, log=lambda *_: None))
    a, b = doc["code"][str(ROOT)], doc["code"]["."]
    for entry in (a, b):
        assert [(r["max_tokens"], r["requests"], r["chunks"]) for r in entry["runs"]] == [(1, 12, 12), (6, 12, 72)]
        assert all(r["instructions"] > 0 for r in entry["runs"])
        assert entry["idle_per_second"] > 0  # (the idle process's timers and threads, taken from each run)
        assert all(r["instructions"] == r["counted"] - r["idle"] and 0 < r["idle"] < r["counted"]
                   for r in entry["runs"])
        assert entry["runs"][1]["instructions"] > entry["runs"][0]["instructions"], "more chunks, more work"
        assert entry["per_request"] > 0 and entry["per_chunk"] > 0
        names = [name for name, _ in entry["functions"]["per_request"]]
        assert "_PyEval_EvalFrameDefault" in names[:3], names  # (the interpreter leads: the gateway is Python)
        for found in entry["functions"].values():
            assert [v for _, v in found] == sorted((v for _, v in found), reverse=True)
        assert "functions" not in entry["runs"][0]
    assert a["vs_first"] == {"per_request": 1.0, "per_chunk": 1.0}
    # (12 requests, and the idle process's share taken off by its rate: 5.9% apart once beside the rest of the suite)
    assert b["vs_first"]["per_request"] == pytest.approx(1.0, abs=0.10)
    assert plot(doc, tmp_path / "chart.png").stat().st_size > 10_000


def test_the_command_refuses_what_is_not_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="no gateway package there"):
        main(["--code", str(tmp_path), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit):
        main(["--tokens", "4,4"])
    assert "two different chunk counts" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
