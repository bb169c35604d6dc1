"""Small real runs on loopback: the raw backend directly, and emulated engines behind the gateway."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gateway.bench.cli import main
from gateway.bench.client import Target
from gateway.bench.runner import Arrival, poisson_offsets, run, run_sync
from gateway.bench.workload import WorkloadConfig, build_workload
from tests.bench.conftest import GatewayFleet, RawBackendThread


def test_closed_loop_counts_tokens_and_bounds_concurrency(raw_backend: RawBackendThread) -> None:
    reqs = build_workload(WorkloadConfig(kind="random", count=30, output_min=5, output_max=5, input_min=4,
                                         input_max=20))
    result = run_sync(run([Target("raw", raw_backend.url)], reqs, Arrival(concurrency=6)))
    rs = result.results["raw"]
    assert [r.index for r in rs] == list(range(30))
    assert all(r.ok and r.chunks == 5 and r.output_tokens == 5 and len(r.itl) == 4 for r in rs)
    assert all(r.ttfb <= r.ttft <= r.e2e for r in rs)
    stats = httpx.get(raw_backend.url + "/stats").json()
    assert stats["requests"] == 30
    # the closed loop never has more than its users in flight (and has several: how many overlap at the backend
    # is the machine's timing, 4 of 6 on a loaded one)
    assert 2 <= stats["peak_streams"] <= 6


def test_interleaved_compare_gives_every_target_the_same_requests(raw_backend: RawBackendThread) -> None:
    reqs = build_workload(WorkloadConfig(kind="random", count=12, output_min=2, output_max=4, input_min=4,
                                         input_max=10))
    url = raw_backend.url
    targets = [Target("a", url), Target("b", url + "/v1"), Target("c", url)]
    result = run_sync(run(targets, reqs, Arrival(concurrency=2), round_size=5))
    assert [(p.target, p.round) for p in result.phases] == [
        ("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1), ("c", 2), ("a", 2), ("b", 2)]
    assert [p.requests for p in result.phases] == [5, 5, 5, 5, 5, 5, 2, 2, 2]
    for name in "abc":
        rs = result.results[name]
        assert [r.index for r in rs] == list(range(12))
        assert [r.output_tokens for r in rs] == [q.output_len for q in reqs]


def test_open_loop_issues_at_poisson_offsets_until_the_duration(raw_backend: RawBackendThread) -> None:
    # a seed whose arrivals all stay clear of the deadline, so the count does not depend on timing
    seed = next(s for s in range(1000) if all(abs(t - 1.0) > 0.2 for t in poisson_offsets(40, 4.0, s)))
    expected = sum(1 for t in poisson_offsets(40, 4.0, seed) if t < 1.0)
    assert 0 < expected < 40
    reqs = build_workload(WorkloadConfig(kind="random", count=40, output_min=1, output_max=1, input_min=1, input_max=5))
    result = run_sync(run([Target("raw", raw_backend.url)], reqs, Arrival(rate=4.0, duration=1.0, seed=seed,
                                                                          concurrency=None)))
    assert len(result.results["raw"]) == expected
    assert all(r.ok for r in result.results["raw"])


def test_errors_are_recorded_not_raised(raw_backend: RawBackendThread) -> None:
    reqs = build_workload(WorkloadConfig(kind="random", count=3))
    closed = Target("closed", "http://127.0.0.1:9", model="m")  # nothing listens on the discard port
    result = run_sync(run([closed], reqs, Arrival(concurrency=2)))
    assert len(result.results["closed"]) == 3
    assert all(not r.ok and r.error for r in result.results["closed"])


def test_gateway_vs_direct_reports_backends_usage_and_cache(gateway_fleet: GatewayFleet, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    code = main(["bench", "--target", f"gateway={gateway_fleet.url}/v1",
                 "--target", f"direct={gateway_fleet.backend_url('sim-vllm')}", "--compare",
                 "--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3", "--system-len", "64",
                 "--question-len", "8", "--count", "12", "--output-len", "6", "--ignore-eos", "--concurrency", "3",
                 "--structured-fraction", "0.25", "--round-size", "6", "--out", str(out), "--no-progress"])
    assert code == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    gw, direct = doc["targets"]["gateway"], doc["targets"]["direct"]
    assert gw["requests"] == gw["ok"] == 12 and direct["ok"] == 12
    assert sum(gw["backends"].values()) == 12 and set(gw["backends"]) <= {"sim-vllm", "sim-sglang"}
    assert direct["backends"] == {}  # no gateway header when talking to the engine directly
    plain = [r for r in doc["requests"]["gateway"] if not r["structured"]]
    assert plain and all(r["output_tokens"] == 6 for r in plain)
    assert any(r["structured"] for r in doc["requests"]["gateway"])
    assert direct["cached_tokens"] > 0  # shared system prompts hit the engine's prefix cache
    assert set(doc["ratios"]) == {"direct"} and doc["ratios"]["direct"]["ttft_s.p50"] is not None


def test_multi_turn_through_the_gateway(gateway_fleet: GatewayFleet, tmp_path: Path) -> None:
    out = tmp_path / "mt"
    assert main(["bench", "--target", f"gw={gateway_fleet.url}", "--workload", "multi-turn", "--conversations", "3",
                 "--turns", "3", "--output-len", "4", "--concurrency", "3", "--out", str(out), "--no-chart",
                 "--no-progress"]) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    reqs = doc["requests"]["gw"]
    assert len(reqs) == 9 and all(r["ok"] for r in reqs)
    by_turn = [sorted(r["prompt_tokens"] for r in reqs if r["index"] // 3 == t) for t in range(3)]
    assert by_turn[0][-1] < by_turn[1][0] and by_turn[1][-1] < by_turn[2][0]  # history grows turn by turn


def test_profile_writes_schema_and_chart(gateway_fleet: GatewayFleet, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert main(["profile", "--backend", f"vllm={gateway_fleet.backend_url('sim-vllm')}", "--engine", "vllm=vllm",
                 "--levels", "1,2", "--input-len", "16", "--output-len", "8", "--requests-per-user", "1",
                 "--time-scale", "50", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "gateway-engine-profile/1" and doc["settings"]["levels"] == [1, 2]
    b = doc["backends"]["vllm"]
    assert b["engine"] == "vllm" and [lv["concurrency"] for lv in b["levels"]] == [1, 2]
    for lv in b["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == lv["concurrency"]
        assert lv["per_user_decode_tok_s"] > 0 and lv["aggregate_tok_s"] > 0 and lv["ttft_p50_s"] > 0
        assert isinstance(lv["host_saturated"], bool)
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_cli_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--target", "a=http://x", "--compare"])
    with pytest.raises(SystemExit):
        main(["bench"])
    assert main(["bench", "--target", "a=http://127.0.0.1:9", "--no-progress", "--no-chart"]) == 2
    assert "cannot list models" in capsys.readouterr().err
