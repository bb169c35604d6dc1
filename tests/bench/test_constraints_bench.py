"""The constraint-validation benchmark on three inputs: every engine's verdict and times per input, the verdicts
judged, a worker that segfaults recorded as a crash (and replaced), the sampling part, and the chart."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest

from gateway.bench.constraints import Options, run, smoke_corpus

pytestmark = pytest.mark.system

pytest.importorskip("llguidance")

SEGFAULT = f"{__name__}:segfault"


def segfault(kind: str, dialect: str, text: str) -> tuple[str, str | None, str]:
    """An engine that dies as llguidance 1.9.1 does on a long Lark chain: SIGSEGV, no Python exception."""
    ctypes.string_at(0)
    raise AssertionError("unreachable")


def test_the_benchmark_records_times_verdicts_and_crashes(tmp_path: Path) -> None:
    options = Options(out=tmp_path, engines=["ours", "llguidance", SEGFAULT], repeats=2, timeout_s=30,
                      llama_server=False, samples=2)
    doc = run(options, smoke_corpus(), progress=False)

    saved = json.loads((tmp_path / "constraints.json").read_text())
    assert saved["schema"] == "gateway-bench-constraints/1" and saved["cases"] == json.loads(json.dumps(doc["cases"]))
    assert (tmp_path / "constraints.png").read_bytes()[:4] == b"\x89PNG"
    assert [c["id"] for c in doc["cases"]] == ["gbnf/yes-no", "regex/unclosed", "json/person"]
    for case in doc["cases"]:
        ours, llg, crashed = (case["engines"][e] for e in ("ours", "llguidance", SEGFAULT))
        assert ours["verdict"] == llg["verdict"] == case["expect"], case["id"]
        assert 1 <= len(ours["times"]) <= 2 and ours["median_s"] > 0 and llg["median_s"] > 0
        assert case["agreement"] == "agree" and case["truth"] == case["expect"]
        # every input crashed its own fresh worker, and the run went on
        assert crashed == {"verdict": "crash", "code": "SIGSEGV", "message": "the worker died (SIGSEGV)",
                           "times": [], "median_s": None}
    assert doc["classes"]["regex"]["ours"]["rejected"] == 1
    assert doc["classes"]["json-schema"][SEGFAULT]["crashes"] == 1
    assert doc["classes"]["gbnf"]["llguidance"]["right"] == doc["classes"]["gbnf"]["llguidance"]["judged"] == 1
    phone = doc["sampling"]["constraints"]["regex-phone"]
    assert phone["ours"]["valid"] == 1.0 and phone["llguidance"]["finished"] == 1.0
    assert phone["llguidance"]["per_mask_s"] > 0
