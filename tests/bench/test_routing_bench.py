"""The routing benchmarks' own logic: configurations they generate, figures they compute, and one tiny real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gateway.bench.client import RequestResult, Target
from gateway.bench.report import build_report
from gateway.bench.routing import (
    PrefixConfig,
    ShapeConfig,
    against,
    better,
    build_parser,
    dump_yaml,
    fleet_config,
    gateway_config,
    kv_capacity_for,
    policy_summary,
    prefix_fleet,
    prefix_set_tokens,
    prefix_workload,
    run_prefix,
    shape_level,
    shape_requests,
    shape_verdict,
    sim_server,
    summarize_prefix,
)
from gateway.bench.routing.prefix import tenant_keys, tenants_auth, tenants_summary
from gateway.bench.runner import Phase, RunResult
from gateway.bench.workload import WorkloadConfig, build_workload
from gateway.config import settings_from_mapping
from gateway.sim.cli import load_fleet_yaml
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


def _result(name: str, index: int, ttft: float, e2e: float, prompt: int, cached: int | None,
            backend: str = "b0", out: int = 10) -> RequestResult:
    return RequestResult(index=index, target=name, ok=True, status=200, ttft=ttft, e2e=e2e, chunks=out,
                         output_tokens=out, prompt_tokens=prompt, cached_tokens=cached, backend=backend)


def _run(per_target: dict[str, list[RequestResult]], wall: float = 2.0) -> RunResult:
    run = RunResult(targets=[Target(n, f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(per_target)],
                    results=per_target)
    run.phases = [Phase(n, 0, wall, len(rs), sum(r.chunks for r in rs)) for n, rs in per_target.items()]
    return run


# --- configuration ------------------------------------------------------------------------------------------------

def test_cache_size_holds_a_share_of_the_prefix_set_and_at_least_two_requests() -> None:
    assert prefix_set_tokens(32, 1536) == 32 * (1536 + 16)
    kv = kv_capacity_for(32, 1536, 1 / 3, 64, 48)
    assert kv == int(32 * 1552 / 3)
    assert 3 * kv <= prefix_set_tokens(32, 1536) < 4 * kv  # one backend: a third; four: all, with room
    assert kv_capacity_for(2, 1000, 0.1, 50, 50) == 2 * (1000 + 50 + 50 + 32)  # floor: two whole requests


def test_stated_prefix_size_matches_the_emulator_tokenizer() -> None:
    cfg = PrefixConfig(groups=2, prompts_per_group=1, system_len=300, question_len=10)
    from gateway.bench.workload import build_workload

    req = build_workload(prefix_workload(cfg))[0]
    tokens = len(Tokenizer().encode(render_chat(req.body["messages"])))
    # the prefix set's stated size counts 16 tokens of header and template per system prompt
    assert 0 <= tokens - (cfg.system_len + cfg.question_len) <= 2 * 16


def test_fleet_file_loads_in_the_emulator(tmp_path: Path) -> None:
    cfg = PrefixConfig(groups=8, system_len=100, time_scale=2.5)
    servers = prefix_fleet("prefix", cfg, [19001, 19002, 19003, 19004])
    specs = load_fleet_yaml(dump_yaml(fleet_config(servers), tmp_path / "fleet.yaml"))
    assert [s.name for s in specs] == ["vllm-0", "vllm-1", "vllm-2", "vllm-3"]
    assert [s.port for s in specs] == [19001, 19002, 19003, 19004]
    kv = kv_capacity_for(8, 100, cfg.cache_share, cfg.question_len, cfg.output_len)
    assert all(s.engine == "vllm" and s.time_scale == 2.5 and s.host == "127.0.0.1" for s in specs)
    assert all(s.resolved_profile().kv_capacity_tokens == kv for s in specs)
    tabby = load_fleet_yaml(dump_yaml(fleet_config([sim_server("tabby", "tabbyapi", 19010, 1.0)]),
                                      tmp_path / "t.yaml"))[0]
    assert tabby.engine == "tabbyapi" and tabby.profile == "exllamav2" and not tabby.overrides


def test_gateway_file_is_a_valid_configuration() -> None:
    doc = gateway_config(18000, [("a", "vllm", "http://127.0.0.1:1"), ("b", "tabbyapi", "http://127.0.0.1:2")],
                         "engine-shape", scrape_interval=0.25, models=["m"])
    settings = settings_from_mapping(doc)
    assert settings.server.port == 18000 and settings.routing.policy == "engine-shape"
    assert [(b.name, b.engine, b.models) for b in settings.backends] == [("a", "vllm", ["m"]),
                                                                        ("b", "tabbyapi", ["m"])]
    assert settings.scrape.interval == 0.25


def test_shape_levels_give_every_user_work_and_fixed_lengths() -> None:
    cfg = ShapeConfig(rounds=2, min_round=8, input_len=32, output_len=16)
    reqs, size = shape_requests(cfg, 1)
    assert size == 8 and len(reqs) == 16
    reqs, size = shape_requests(cfg, 64)
    assert size == 64 and len(reqs) == 128
    assert {r.output_len for r in reqs} == {16} and {r.prompt_words for r in reqs} == {32}
    assert all(r.body.get("ignore_eos") for r in reqs)


def test_command_line_parses_each_benchmark() -> None:
    p = build_parser()
    a = p.parse_args(["prefix", "--groups", "24", "--policies", "round-robin,prefix", "--out", "x"])
    assert a.bench == "prefix" and a.groups == 24 and a.policies == "round-robin,prefix" and a.out == Path("x")
    b = p.parse_args(["shape", "--levels", "1,4"])
    assert b.bench == "shape" and b.levels == "1,4"
    c = p.parse_args(["real-prefix", "--concurrency", "2"])
    assert c.bench == "real-prefix" and c.concurrency == 2 and c.servers == 3


# --- figures ------------------------------------------------------------------------------------------------------

def test_better_is_above_one_when_better() -> None:
    assert better(300.0, 100.0) == 3.0
    assert better(100.0, 200.0, lower_is_better=False) == 2.0
    assert better(None, 1.0) is None and better(1.0, math.nan) is None and better(1.0, 0.0) is None


def test_hit_rate_ttft_and_ratios_against_round_robin() -> None:
    rr = [_result("round-robin", i, ttft=0.3, e2e=1.0, prompt=1000, cached=100, backend=f"b{i % 4}")
          for i in range(10)]
    px = [_result("prefix", i, ttft=0.05, e2e=0.6, prompt=1000, cached=900, backend="b1") for i in range(10)]
    doc = build_report(_run({"round-robin": rr, "prefix": px}), {}, include_requests=False)
    out = summarize_prefix(doc)
    assert out["policies"]["round-robin"]["cache_hit_rate"] == pytest.approx(0.1)
    assert out["policies"]["prefix"]["cache_hit_rate"] == pytest.approx(0.9)
    assert out["policies"]["prefix"]["ttft_ms_p50"] == pytest.approx(50.0)
    assert out["policies"]["round-robin"]["backends"] == {"b0": 3, "b1": 3, "b2": 2, "b3": 2}
    a = out["against"]["prefix"]
    assert a["ttft_p50_x"] == pytest.approx(6.0) and a["hit_rate_x"] == pytest.approx(9.0)
    assert a["throughput_x"] == pytest.approx(1.0)  # same tokens in the same wall time
    assert out["against"]["round-robin"]["ttft_p50_x"] == pytest.approx(1.0)
    [check] = out["targets"]
    assert check["met"] and check["value"] == pytest.approx(6.0) and check["miss_by"] is None


def test_a_missed_target_says_by_how_much() -> None:
    rr = [_result("round-robin", i, 0.2, 1.0, 1000, 0) for i in range(4)]
    px = [_result("prefix", i, 0.1, 1.0, 1000, 500) for i in range(4)]
    out = summarize_prefix(build_report(_run({"round-robin": rr, "prefix": px}), {}, include_requests=False))
    [check] = out["targets"]
    assert not check["met"] and check["value"] == pytest.approx(2.0) and check["miss_by"] == pytest.approx(1.5)


def test_no_cache_report_gives_no_hit_rate() -> None:
    rs = [_result("x", 0, 0.1, 0.2, 100, None)]
    s = policy_summary(build_report(_run({"x": rs}), {}, include_requests=False)["targets"]["x"])
    assert s["cache_hit_rate"] is None and s["cached_tokens"] is None
    assert against({"x": s}, "x")["x"]["hit_rate_x"] is None


def _level(ll: float, es: float, tabby: float, vllm: float) -> dict[str, object]:
    per = {"least-load": ll, "engine-shape": es, "tabby-alone": tabby, "vllm-alone": vllm}
    results = {n: [_result(n, i, 0.01, v, 64, None) for i in range(5)] for n, v in per.items()}
    doc = build_report(_run(results), {}, include_requests=False)
    return shape_level(doc, ["least-load", "engine-shape"], ["tabby-alone", "vllm-alone"])


def test_shape_level_ratios_and_best_alone() -> None:
    row = _level(ll=2.0, es=1.0, tabby=3.0, vllm=1.1)
    assert row["engine_shape_vs_least_load_p90_x"] == pytest.approx(2.0)
    assert row["best_alone"] == "vllm-alone" and row["best_alone_p90_ms"] == pytest.approx(1100.0)
    assert row["engine-shape_vs_best_alone_p90_x"] == pytest.approx(1.1)
    assert row["least-load_vs_best_alone_p90_x"] == pytest.approx(0.55)


def test_shape_verdict_over_the_ramp() -> None:
    levels = {"1": _level(1.2, 1.0, 1.0, 1.2), "8": _level(2.0, 1.0, 3.0, 1.02), "64": _level(5.0, 1.0, 9.0, 0.98)}
    checks = {c["name"]: c for c in shape_verdict(levels)}  # type: ignore[arg-type]
    all_levels = checks["shape_vs_least_load_all"]
    assert not all_levels["met"] and all_levels["value"] == pytest.approx(1.2)
    assert all_levels["levels_met"] == [8, 64]
    assert checks["shape_vs_least_load_8plus"]["met"]
    alone = checks["shape_vs_best_alone"]
    assert alone["value"] == pytest.approx(0.98) and not alone["met"] and alone["within_tolerance"]
    assert alone["per_level"]["1"] == pytest.approx(1.0)
    json.dumps(checks)  # string keys only: the report is JSON


# --- one tiny real run ------------------------------------------------------------------------------------------

@pytest.mark.system
def test_tiny_prefix_run_writes_a_complete_report(tmp_path: Path) -> None:
    cfg = PrefixConfig(policies=["round-robin", "prefix"], backends=2, groups=2, prompts_per_group=3,
                       system_len=200, question_len=8, output_len=4, concurrency=2, round_size=3,
                       time_scale=20.0, base_port=18950, out=tmp_path)
    doc = run_prefix(cfg, log=lambda _: None)
    assert set(doc["policies"]) == {"round-robin", "prefix"}
    for s in doc["policies"].values():
        assert s["ok"] == s["requests"] == 6
        assert s["cache_hit_rate"] is not None and 0 <= s["cache_hit_rate"] <= 1
        assert sum(s["backends"].values()) == 6
    assert doc["against"]["round-robin"]["ttft_p50_x"] == pytest.approx(1.0)
    assert doc["targets"][0]["name"] == "prefix_ttft_p50"
    assert {p["target"] for p in doc["phases"]} == {"round-robin", "prefix"}
    assert (tmp_path / "prefix" / "gateway-prefix.yaml").exists()
    assert (tmp_path / "prefix" / "fleet-round-robin.log").exists()
    json.dumps(doc)  # serialisable as is


def test_tenants_get_a_key_each_and_their_cost_is_a_share_of_one_domain() -> None:
    settings = settings_from_mapping({"auth": tenants_auth(3)})
    assert [k.name for k in settings.auth.keys] == tenant_keys(3)
    target = Target("default /3 keys", "http://x", tenant_keys=tuple(tenant_keys(3)))
    requests = build_workload(WorkloadConfig(kind="shared-prefix", groups=2, prompts_per_group=3))
    assert [target.key_for(r) for r in requests[:4]] == [*tenant_keys(3), tenant_keys(3)[0]]
    assert Target("plain", "http://x", api_key="k").key_for(requests[0]) == "k"
    summaries = {"default": {"cache_hit_rate": 0.8}, "default /3 keys": {"cache_hit_rate": 0.4},
                 "default /16 keys": {"cache_hit_rate": 0.0}, "default x2": {"cache_hit_rate": 0.7}}
    out = tenants_summary(summaries, [3, 16])
    assert out == {"default": {"hit_rate": {"1": 0.8, "3": 0.4, "16": 0.0},
                               "share_of_one_domain": {"1": 1.0, "3": 0.5, "16": 0.0}}}
    assert build_parser().parse_args(["prefix", "--tenants", "3,16"]).tenants == "3,16"
