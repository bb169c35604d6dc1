"""The overhead benchmark's parts: its backend's protocol, the gateway configuration it writes, its table rows, the
cost phase's solve, the saturation verdicts, the issue targets, the median of runs; and a tiny real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.bench.overhead import (
    CostRun,
    OverheadConfig,
    evaluate_targets,
    gateway_yaml,
    level_row,
    median_of,
    paired_us,
    prompt_text,
    run_overhead,
    saturation_limit,
    saturation_summary,
    solve_cost,
    summarize_runs,
    vs_reference,
)
from gateway.bench.stats import paired_difference
from gateway.bench.translation_cost import translation_row
from gateway.config import settings_from_mapping
from tests.bench.conftest import RawBackendThread
from tests.conftest import free_port_block

pytestmark = pytest.mark.unit


@pytest.mark.integration
def test_raw_backend_streams_usage_only_when_asked_and_answers_plain_requests(raw_backend: RawBackendThread) -> None:
    body = {"model": "bench-model", "messages": [], "stream": True, "max_tokens": 3}
    with_usage = httpx.post(raw_backend.url + "/v1/chat/completions",
                            json={**body, "stream_options": {"include_usage": True}}).text
    without = httpx.post(raw_backend.url + "/v1/completions", json=body).text
    assert with_usage.count('"content":" tok"') == 3 and '"completion_tokens":3' in with_usage
    assert without.count('"text":" tok"') == 3 and '"usage"' not in without
    assert with_usage.endswith("data: [DONE]\n\n") and without.endswith("data: [DONE]\n\n")
    plain = httpx.post(raw_backend.url + "/v1/chat/completions", json={**body, "stream": False}).json()
    assert plain["usage"]["completion_tokens"] == 3
    assert httpx.get(raw_backend.url + "/v1/models").json()["data"][0]["id"] == "bench-model"
    assert httpx.post(raw_backend.url + "/v1/chat/completions", content=b"{").status_code == 400


def test_gateway_config_is_valid_and_runs_the_default_policy() -> None:
    settings = settings_from_mapping(yaml.safe_load(gateway_yaml("http://127.0.0.1:1", 2)))
    assert settings.backends[0].engine == "openai" and settings.server.port == 2
    assert settings.backends[0].max_concurrency == 4096
    assert settings.routing.policy == "default"


def test_level_row_adds_against_direct() -> None:
    def target(ttft: float, itl: float) -> dict[str, object]:
        m = {"ttfb_s": {"p50": ttft}, "ttft_s": {"p50": ttft, "p99": 2 * ttft},
             "itl_s": {"mean": itl, "p50": itl, "p99": 3 * itl}}
        return {"ok": 1, "requests": 1, "errors": 0, "metrics": m, "chunks_per_s": 10.0,
                "cpu_ms_per_request": 1.0, "cpu_us_per_chunk": 2.0}

    row = level_row({"targets": {"direct": target(0.001, 0.005), "gw": target(0.003, 0.0051)}}, "direct")
    assert "added_ttft_ms_p50" not in row["direct"] and "added_itl_ms_p50" not in row["direct"]
    assert abs(row["gw"]["added_ttft_ms_p50"] - 2.0) < 1e-9 and abs(row["gw"]["added_ttft_ms_p99"] - 4.0) < 1e-9
    assert abs(row["gw"]["added_itl_ms_mean"] - 0.1) < 1e-9 and abs(row["gw"]["added_itl_ms_p50"] - 0.1) < 1e-9
    assert abs(row["gw"]["added_itl_ms_p99"] - 0.3) < 1e-9 and abs(row["gw"]["itl_ms_p50"] - 5.1) < 1e-9


def test_vs_reference_is_each_proxys_added_ttft_over_the_references() -> None:
    levels = {"1": {"direct": {"added_ttft_ms_p50": None},
                    "gateway": {"added_ttft_ms_p50": 3.0, "added_ttft_ms_p99": 8.0},
                    "smg": {"added_ttft_ms_p50": 2.0, "added_ttft_ms_p99": 0.0}}}
    out = vs_reference(levels, "smg")
    assert out["reference"] == "smg" and list(out["levels"]["1"]) == ["gateway"]
    assert out["levels"]["1"]["gateway"]["added_ttft_p50_x"] == pytest.approx(1.5)
    assert out["levels"]["1"]["gateway"]["added_ttft_p99_x"] is None  # the reference added nothing
    assert vs_reference(levels, None) == {"reference": None, "levels": {}}


def test_solve_cost_recovers_per_request_and_per_chunk_cpu() -> None:
    r, c = 120e-6, 18e-6  # seconds per request, per chunk

    def run(requests: int, chunks: int) -> CostRun:
        return CostRun(requests, chunks, requests * r + chunks * c, cpu_error_s=0.02)

    fit = solve_cost(run(2000, 8000), run(2000, 128_000))
    assert fit["cpu_us_per_request"] == pytest.approx(120.0) and fit["cpu_us_per_chunk"] == pytest.approx(18.0)
    # worst case of a 20 ms error in each run's CPU: (128,000 + 8,000) * 0.02 / det, (2000 + 2000) * 0.02 / det
    det = 2000 * 128_000 - 2000 * 8000
    assert fit["cpu_us_per_request_error"] == pytest.approx(1e6 * 136_000 * 0.02 / det)
    assert fit["cpu_us_per_chunk_error"] == pytest.approx(1e6 * 4000 * 0.02 / det)
    # runs of different sizes, and the order of the runs does not matter
    swapped = solve_cost(run(900, 57_600), run(1500, 6000))
    assert swapped["cpu_us_per_request"] == pytest.approx(120.0) and swapped["cpu_us_per_chunk"] == pytest.approx(18.0)


@pytest.mark.parametrize(("a", "b"), [
    (CostRun(100, 400, 0.1), CostRun(200, 800, 0.2)),  # as many chunks per request in both: nothing to separate
    (CostRun(100, 400, None), CostRun(100, 6400, 0.5)),  # no CPU figure
    (CostRun(0, 0, 0.0), CostRun(100, 6400, 0.5)),  # no requests
    (CostRun(100, 0, 0.1), CostRun(100, 0, 0.1)),  # no chunks at all
])
def test_solve_cost_degenerate_input_gives_no_figures(a: CostRun, b: CostRun) -> None:
    assert set(solve_cost(a, b).values()) == {None}


def test_prompt_text_is_about_two_thousand_tokens_of_varied_words_and_deterministic() -> None:
    text = prompt_text(3)
    assert 7900 <= len(text) <= 8000 and text == prompt_text(3) and text != prompt_text(4)
    words = text.split(" ")
    assert len(set(words)) > 500 and max(words.count(w) for w in set(words)) < 20
    assert all(w.isalpha() for w in words)
    assert 1900 <= len(text) / 4 <= 2000  # ~4 characters per token
    assert len(prompt_text(0, 100)) <= 100 and prompt_text(0, 0) == ""


def test_saturation_limit_says_what_ran_out() -> None:
    assert saturation_limit(0.95, 0.3, 0.8, 0.99) == "proxy"
    assert saturation_limit(0.7, 0.3, 0.8, 0.95) == "machine"
    assert saturation_limit(0.5, 0.2, 0.93, 0.8) == "client"
    assert saturation_limit(0.5, 0.92, 0.5, 0.8) == "backend"
    assert saturation_limit(0.5, 0.2, 0.5, 0.6) == "none"
    assert saturation_limit(None, None, None, None) == "none"


def test_saturation_summary_takes_each_targets_best_level() -> None:
    def row(cps: float, cores: float, limit: str) -> dict[str, Any]:
        return {"chunks_per_s": cps, "proxy_cores": cores, "limit": limit}

    levels = {"256": {"gateway": row(20_000, 0.8, "machine"), "smg": row(30_000, 0.5, "machine")},
              "512": {"gateway": row(24_000, 0.97, "proxy"), "smg": row(29_000, 0.6, "machine")}}
    out = saturation_summary(levels, {"gateway": 25_000.0})
    assert out["gateway"] == {"max_chunks_per_s": 24_000, "at_level": 512, "proxy_cores": 0.97, "limit": "proxy",
                              "saturated": True, "capacity_chunks_per_s": 25_000.0}
    assert out["smg"]["at_level"] == 256 and out["smg"]["saturated"] is False
    assert out["smg"]["capacity_chunks_per_s"] is None


def _run_doc(ttft_x: dict[str, float | None], chunk_us: float, request_us: float, cps: float,
             complete: int) -> dict[str, Any]:
    return {
        "config": {"hold": 1000},
        "levels": {lv: {"gateway": {"added_ttft_ms_p50": 1.0}} for lv in ("1", "16", "64", "256", "512")},
        "vs_reference": {"reference": "smg", "levels": {lv: {"gateway": {"added_ttft_p50_x": x}}
                                                        for lv, x in ttft_x.items()}},
        "cost": {"targets": {"gateway": {"cpu_us_per_chunk": chunk_us, "cpu_us_per_request": request_us,
                                         "cpu_us_per_chunk_error": 0.5, "cpu_us_per_request_error": 10.0},
                             "smg": {"cpu_us_per_chunk": 15.0, "cpu_us_per_request": 100.0}}},
        "saturation": {"targets": {"gateway": {"max_chunks_per_s": cps, "saturated": True, "limit": "proxy",
                                               "capacity_chunks_per_s": cps * 1.1}}},
        "hold": {"gateway": {"streams": 1000, "complete": complete}},
    }


def test_evaluate_targets_against_the_issue() -> None:
    doc = _run_doc({"1": 1.4, "16": 1.6, "64": 2.0, "256": None}, 24.0, 151.0, 40_000.0, 999)
    t = evaluate_targets(doc)
    assert set(t) == {"cpu_us_per_chunk", "cpu_us_per_request", "chunks_per_s", "added_ttft_p50_x_at_1",
                      "added_ttft_p50_x_at_16", "added_ttft_p50_x_at_64", "added_ttft_p50_x_at_256", "hold_complete"}
    assert t["cpu_us_per_chunk"]["met"] is True and t["cpu_us_per_chunk"]["reference"] == 15.0
    assert t["cpu_us_per_request"]["met"] is False and t["cpu_us_per_request"]["target"] == 150.0
    assert t["chunks_per_s"]["met"] is True and t["chunks_per_s"]["saturated"] is True  # >= 40,000
    assert t["added_ttft_p50_x_at_1"]["met"] is True and t["added_ttft_p50_x_at_16"]["met"] is False
    assert t["added_ttft_p50_x_at_64"]["met"] is True  # 2x allowed at 64 streams
    assert t["added_ttft_p50_x_at_256"]["value"] is None and t["added_ttft_p50_x_at_256"]["met"] is None
    assert t["hold_complete"]["met"] is False and t["hold_complete"]["target"] == 1000
    # a run without the cost and saturation phases, without a reference, at other levels
    bare = evaluate_targets({"config": {"hold": 0}, "levels": {"2": {}}, "vs_reference": {"reference": None}})
    assert {k: v["met"] for k, v in bare.items()} == {"cpu_us_per_chunk": None, "cpu_us_per_request": None,
                                                       "chunks_per_s": None}


def test_median_of_runs() -> None:
    assert median_of([3, None, 1, 2]) == 2 and median_of([1.0, 4.0]) == 2.5 and median_of([None, None]) is None
    assert median_of([True, True, False]) is True and median_of([True, False]) is False
    assert median_of(["proxy", "machine"]) == "proxy" and median_of([[1], [2]]) == [1]
    assert median_of([8, 8]) == 8 and isinstance(median_of([8, 8]), int) and median_of([2, 4]) == 3
    assert isinstance(median_of([2, 4]), int) and median_of([2, 5]) == 3.5
    assert median_of([{"a": 1, "b": {"c": 10}}, {"a": 3, "b": {"c": 30}, "d": 7}, {"a": 2, "b": None}]) == {
        "a": 2, "b": {"c": 20}, "d": 7}


def test_summary_is_the_median_of_runs_with_every_run_kept() -> None:
    runs = [_run_doc({"1": x, "16": 2.0}, chunk, 140.0, cps, 1000)
            for x, chunk, cps in ((1.6, 30.0, 39_000.0), (1.4, 20.0, 41_000.0), (1.45, 22.0, 45_000.0))]
    for i, doc in enumerate(runs):
        doc["targets"] = evaluate_targets(doc)
        doc["run"] = i + 1
    summary = summarize_runs(runs)
    assert summary["repeat"] == 3 and summary["runs"] == runs
    assert summary["cost"]["targets"]["gateway"]["cpu_us_per_chunk"] == 22.0
    assert summary["vs_reference"]["levels"]["1"]["gateway"]["added_ttft_p50_x"] == 1.45  # median of the ratios
    t = summary["targets"]
    assert t["added_ttft_p50_x_at_1"]["value"] == 1.45 and t["added_ttft_p50_x_at_1"]["met"] is True
    assert t["added_ttft_p50_x_at_1"]["runs"] == [1.6, 1.4, 1.45]
    assert t["cpu_us_per_chunk"]["met"] is True and t["cpu_us_per_chunk"]["runs"] == [30.0, 20.0, 22.0]
    assert t["chunks_per_s"]["value"] == 41_000.0 and t["chunks_per_s"]["met"] is True
    assert t["hold_complete"]["met"] is True
    with pytest.raises(ValueError):
        summarize_runs([])


def test_repeat_writes_each_run_and_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gateway.bench.overhead as overhead

    calls: list[Path | None] = []

    indexes: list[int] = []

    def fake_run(cfg: OverheadConfig, log: Any = None, logs: Path | None = None, run_index: int = 0) -> dict[str, Any]:
        calls.append(logs)
        indexes.append(run_index)  # (what the state pairs' order rotates by)
        doc = _run_doc({"1": 1.0 + len(calls) / 10}, 20.0, 100.0, 50_000.0, 1000)
        doc["targets"] = evaluate_targets(doc)
        return doc

    plots: list[str] = []
    monkeypatch.setattr(overhead, "run_once", fake_run)
    monkeypatch.setattr(overhead, "plot_overhead", lambda doc, path: plots.append(path.name))
    summary = run_overhead(OverheadConfig(out=tmp_path, repeat=3), log=lambda *_: None)
    assert calls == [tmp_path / f"run-{i}" for i in (1, 2, 3)] and indexes == [0, 1, 2]
    assert plots == ["overhead-1.png", "overhead-2.png", "overhead-3.png", "overhead.png"]
    assert [json.loads((tmp_path / f"overhead-{i}.json").read_text())["run"] for i in (1, 2, 3)] == [1, 2, 3]
    on_disk = json.loads((tmp_path / "overhead.json").read_text())
    assert on_disk["summary"] == summary["summary"] == "median of 3 runs"
    assert on_disk["targets"]["added_ttft_p50_x_at_1"]["value"] == pytest.approx(1.2)
    assert on_disk["targets"]["added_ttft_p50_x_at_1"]["runs"] == pytest.approx([1.1, 1.2, 1.3])


@pytest.mark.system
def test_a_tiny_real_run_measures_every_phase(tmp_path: Path) -> None:
    """The whole machinery end to end, at tiny sizes (a few seconds): the gateway (and the Rust router when
    installed), every phase; the figures are noise, the layout is what is checked."""
    cfg = OverheadConfig(levels=[2], rounds=1, min_round=4, tokens=4, gap_ms=1.0, hold=20, hold_seconds=0.2,
                         cost_requests=16, cost_concurrency=4, cost_tokens=(1, 4), cost_rounds=1,
                         cost_prompt_chars=2000, saturation_levels=[8], saturation_requests=16, saturation_tokens=4,
                         translation_level=2, state=True, state_rounds=3, workers=2, base_port=free_port_block(14),
                         out=tmp_path)
    summary = run_overhead(cfg, log=lambda *_: None)
    on_disk = json.loads((tmp_path / "overhead.json").read_text())
    assert on_disk["repeat"] == 1 and len(on_disk["runs"]) == 1 and summary["summary"] == "median of 1 run"
    run = json.loads((tmp_path / "overhead-1.json").read_text())
    assert run["run"] == 1 and (tmp_path / "gateway.log").exists()
    assert (tmp_path / "overhead.png").stat().st_size > 10_000
    stateful = {"gateway+redis", "gateway+redis, rpm key", "gateway+redis, tpm key", "gateway x2",
                "gateway, rpm key", "gateway, tpm key"}
    names = set(on_disk["levels"]["2"]) - stateful
    assert {"direct", "gateway", "relay"} <= names
    gw = on_disk["levels"]["2"]["gateway"]
    for key in ("added_ttft_ms_p50", "added_ttft_ms_p99", "added_itl_ms_p50", "added_itl_ms_p99",
                "added_itl_ms_mean", "chunks_per_s"):
        assert key in gw
    assert gw["ok"] == gw["requests"] == 4
    cost = on_disk["cost"]["targets"]
    assert set(cost) == names | stateful
    assert cost["gateway"]["runs"]["max_tokens_1"]["chunks"] == 16 and cost["gateway"]["runs"]["max_tokens_4"][
        "chunks"] == 64
    assert cost["gateway"]["runs"]["max_tokens_4"]["cpu_s"] is not None
    sat = on_disk["saturation"]
    assert sat["levels"]["8"]["gateway"]["ok"] == 16 and sat["levels"]["8"]["gateway"]["chunks"] == 64
    assert sat["targets"]["gateway"]["at_level"] == 8 and sat["targets"]["gateway"]["limit"] in (
        "proxy", "machine", "client", "backend", "none")
    assert on_disk["hold"]["gateway"]["complete"] == 20
    # the bare TCP relay, the floor any proxy pays here: measured like the others, and named beside the targets
    assert on_disk["levels"]["2"]["relay"]["ok"] == 4 and on_disk["hold"]["relay"]["complete"] == 20
    assert on_disk["targets"]["cpu_us_per_request"]["relay"] == pytest.approx(cost["relay"]["cpu_us_per_request"])
    state = on_disk["state"]["levels"]["2"]  # the gateway with its slots in a loopback redis-server
    assert state["ttft_us_p50"] is not None and state["cpu_us_per_request"] is not None
    assert len(on_disk["levels"]["2"]["gateway+redis"]["ttft_ms_p50_by_round"]) == 1  # (one round)
    assert state["ttft_us_p50_paired"]["pairs"] == 1 and state["ttft_us_p50_paired"]["median"] is None  # (< 3)
    assert on_disk["levels"]["2"]["gateway+redis"]["ok"] == 4
    # the same with keys whose limits live in Redis: requests per minute (leased), tokens per minute, each
    # against the same key and limit without Redis
    for part, name in (("state_limited", "gateway+redis, rpm key"), ("state_tokens", "gateway+redis, tpm key")):
        limited = on_disk[part]["levels"]["2"]
        assert limited["ttft_us_p50"] is not None and limited["cpu_us_per_request"] is not None
        assert on_disk[part]["against"] == name.replace("+redis", "")
        # how its admissions were decided, and apart from them its leases' top-ups in the background
        assert set(on_disk[part]["admissions"]) == {"local", "waited", "redis"}
        assert isinstance(on_disk[part]["lease_refills"], int)
        assert on_disk["levels"]["2"][name]["ok"] == on_disk["levels"]["2"][name.replace("+redis", "")]["ok"] == 4
    # each comparison again with its pair alone (A B, B A, ...), the figure the target is judged on, and the
    # method's floor: two gateways without Redis
    pairs = on_disk["state_pairs"]
    assert set(pairs) == {"state", "state_limited", "state_tokens", "state_floor"}
    assert (pairs["state"]["off"], pairs["state"]["on"]) == ("gateway", "gateway+redis")
    assert (pairs["state_floor"]["off"], pairs["state_floor"]["on"]) == ("gateway, rpm key", "gateway, tpm key")
    for part, pair in pairs.items():
        assert pair["rounds"] == 3 and pair["level"] == 16 and set(pair["errors"].values()) == {0}
        assert pair["ttft_us_p50_paired"]["pairs"] == 3 and pair["ttft_us_p50_paired"]["median"] is not None
        if part != "state_floor":
            target = on_disk["targets"][f"{part}_ttft_us_p50_at_16"]
            assert target["phase"] == "state_pairs" and target["rounds"] == 3
            assert target["value"] == pytest.approx(pair["ttft_us_p50_paired"]["median"])
    workers = on_disk["workers"]  # two worker processes sharing that redis-server, against one process with it
    assert workers["count"] == 2 and workers["against"] == "gateway+redis"
    assert workers["levels"]["2"]["ttft_us_p50"] is not None
    assert workers["saturation"]["8"]["gateway x2"]["chunks_per_s"] > 0
    assert on_disk["levels"]["2"]["gateway x2"]["ok"] == 4
    translation = on_disk["translation"]
    assert translation["concurrency"] == 2
    assert {t: v["errors"] for t, v in translation["targets"].items()} == {
        "direct": 0, "gateway": 0, "gateway /v1/messages": 0}
    assert translation["translated_added_ttft_ms_p50"] is not None and translation["translation_ms_p50"] is not None
    targets = on_disk["targets"]
    assert {"cpu_us_per_chunk", "cpu_us_per_request", "chunks_per_s", "hold_complete"} <= set(targets)
    assert targets["hold_complete"]["met"] is True and targets["hold_complete"]["runs"] == [20]
    ref = on_disk["vs_reference"]["reference"]
    assert (ref is None) == (names == {"direct", "gateway", "relay"}), "a Rust reference exactly when one ran"


def test_translation_row_is_what_translating_adds_over_the_native_path() -> None:
    def target(p50: float, p99: float) -> dict[str, Any]:
        return {"metrics": {"ttft_s": {"p50": p50, "p99": p99}}, "requests": 8, "errors": 0}

    doc = {"targets": {"direct": target(0.010, 0.020), "gateway": target(0.012, 0.025),
                       "gateway /v1/messages": target(0.013, 0.030)}}
    row = translation_row(doc, "direct", "gateway", "gateway /v1/messages")
    assert row["native_added_ttft_ms_p50"] == pytest.approx(2.0)
    assert row["translated_added_ttft_ms_p50"] == pytest.approx(3.0)
    assert row["translated_added_ttft_ms_p99"] == pytest.approx(10.0)
    assert row["translation_ms_p50"] == pytest.approx(1.0) and row["translated_over_native_x"] == pytest.approx(1.5)
    assert row["targets"]["gateway /v1/messages"]["ttft_ms_p50"] == pytest.approx(13.0)


def test_paired_difference_cancels_the_drift_between_rounds() -> None:
    # b is a steady 0.3 above a, while the machine's speed drifts both by up to 3 between rounds: the pooled
    # medians' difference depends on which rounds each target was lucky in, the paired one does not
    drift = [0.0, 3.0, 1.0, 2.5, 0.2, 1.7, 2.9, 0.4, 1.1, 2.2]
    a = [10 + d for d in drift]
    b = [10.3 + d for d in drift]
    out = paired_difference(a, b)
    assert out["median"] == pytest.approx(0.3) and out["pairs"] == 10
    assert out["low"] == pytest.approx(0.3) and out["high"] == pytest.approx(0.3)
    # noise around the steady difference: the interval holds the median and widens with the noise
    noisy = [y + e for y, e in zip(b, [0.2, -0.1, 0.05, -0.3, 0.15, 0.0, -0.05, 0.25, -0.2, 0.1], strict=True)]
    wide = paired_difference(a, noisy)
    assert wide["low"] is not None and wide["high"] is not None and wide["median"] is not None
    assert wide["low"] <= wide["median"] <= wide["high"] and wide["high"] - wide["low"] > 0.05
    assert paired_difference(a, noisy) == wide  # seeded: the same data, the same interval
    # a round one target lost (None on the way in, NaN here) drops that pair; under 3 pairs, nothing
    assert paired_difference([1.0, float("nan"), 2.0, 3.0], [1.5, 9.0, 2.5, 3.5])["pairs"] == 3
    assert paired_difference([1.0, 2.0], [1.5, 2.5]) == {"median": None, "low": None, "high": None, "pairs": 2}


def test_paired_us_is_the_rounds_difference_in_microseconds_and_judges_the_state_target() -> None:
    off = {"ttft_ms_p50_by_round": [2.0, 5.0, 3.0, None, 4.0]}
    on = {"ttft_ms_p50_by_round": [2.4, 5.4, 3.4, 3.0, 4.4]}
    paired = paired_us(off, on)
    assert paired["median"] == pytest.approx(400.0) and paired["pairs"] == 4
    assert paired_us(off, {})["median"] is None
    # the pooled p50s differ by 900 us (a drift), the rounds by 400: the target is judged on the rounds
    doc = {"config": {"hold": 0}, "levels": {"16": {}}, "vs_reference": {"reference": None},
           "state": {"levels": {"16": {"ttft_us_p50": 900.0, "ttft_us_p50_paired": paired}}}}
    target = evaluate_targets(doc)["state_ttft_us_p50_at_16"]
    assert target["value"] == pytest.approx(400.0) and target["met"] is True and target["pooled"] == 900.0
    assert target["rounds"] == 4 and target["ci90"][0] <= 400.0 <= target["ci90"][1]
    # a run from before the paired figure: judged on the pooled one
    doc["state"]["levels"]["16"] = {"ttft_us_p50": 900.0}
    assert evaluate_targets(doc)["state_ttft_us_p50_at_16"]["met"] is False
