"""The engine-shape benchmarks seed the gateways under test from a measurement of their own fleet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gateway.bench.routing.real_shape import RealShapeConfig, run_real_shape
from gateway.bench.routing.seeding import seeded_targets, seeding_level
from gateway.bench.routing.shape import ShapeConfig, profile_levels, run_shape
from gateway.routing.shape_model import load_profile_file

pytestmark = pytest.mark.unit


def test_profile_levels_reach_the_top_of_the_ramp() -> None:
    assert profile_levels(ShapeConfig()) == [1, 4, 16, 64]
    assert profile_levels(ShapeConfig(levels=[1, 2, 4, 8])) == [1, 4, 8]
    assert profile_levels(ShapeConfig(profile_levels=[8, 1, 8])) == [1, 8]


def test_comparing_seedings_doubles_only_policies_that_model_engine_shape() -> None:
    cfg = ShapeConfig(policies=["least-load", "engine-shape", "default"], compare_seeding=True)
    assert seeded_targets(cfg) == [
        ("least-load", "least-load", "profile"), ("engine-shape", "engine-shape", "profile"),
        ("default", "default", "profile"), ("engine-shape@engine-defaults", "engine-shape", "engine-defaults"),
        ("default@engine-defaults", "default", "engine-defaults")]
    custom = {"mine": {"scorers": [{"name": "engine-shape", "weight": 2.0}]}}
    cfg = ShapeConfig(policies=["mine"], seed_from="engine-defaults", compare_seeding=True, profiles=custom)
    assert seeded_targets(cfg) == [("mine", "mine", "engine-defaults"), ("mine@profile", "mine", "profile")]
    with pytest.raises(ValueError, match="seed_from"):
        seeded_targets(ShapeConfig(seed_from="emulator"))


def test_seeding_figures_put_the_profile_against_the_engine_defaults() -> None:
    def row(tok_s: float, ttft: float) -> dict[str, float]:
        return {"output_tok_s": tok_s, "ttft_ms_p50": ttft, "ttft_ms_p90": 2 * ttft, "e2e_ms_p90": 10 * ttft}

    rows = {"engine-shape": row(200.0, 10.0), "engine-shape@engine-defaults": row(100.0, 20.0),
            "least-load": row(50.0, 5.0)}
    out = seeding_level(rows, seeded_targets(ShapeConfig(compare_seeding=True)))
    assert list(out) == ["engine-shape"]
    x = out["engine-shape"]["profile_vs_engine_defaults"]
    assert x == {"throughput_x": 2.0, "ttft_p50_x": 2.0, "ttft_p90_x": 2.0, "e2e_p90_x": 2.0}
    assert out["engine-shape"]["engine-defaults"]["output_tok_s"] == 100.0


@pytest.mark.system
def test_quick_shape_run_profiles_its_fleet_and_seeds_the_gateways_with_it(tmp_path: Path) -> None:
    cfg = ShapeConfig.quick(out=tmp_path, base_port=18980, compare_seeding=True)
    doc = run_shape(cfg, log=lambda _: None)
    profile = tmp_path / "shape-profile.json"
    assert doc["seeding"]["profile_path"] == str(profile)
    assert set(json.loads(profile.read_text())["backends"]) == {"tabby", "vllm"}  # the gateways' backend names
    load_profile_file(profile)  # a file the gateway accepts
    for name in ("least-load", "engine-shape"):
        routing = yaml.safe_load((tmp_path / "shape" / f"gateway-{name}.yaml").read_text())["routing"]
        assert Path(routing["engine_profile"]) == profile.resolve()
    defaults = yaml.safe_load((tmp_path / "shape" / "gateway-engine-shape@engine-defaults.yaml").read_text())
    assert "engine_profile" not in defaults["routing"]
    for level in ("1", "4"):
        row = doc["levels"][level]
        assert all(t["ok"] == t["requests"] > 0 for t in row["targets"].values())
        assert row["seeding"]["engine-shape"]["profile_vs_engine_defaults"]["throughput_x"] is not None


def _llama_server_cached() -> bool:
    from gateway.llamacpp.build import binary_path

    return binary_path().exists()


@pytest.mark.system
@pytest.mark.skipif(not _llama_server_cached(), reason="no cached llama-server binary (build it once with "
                                                       "`gateway llamacpp build`; about 10 minutes on 2 cores)")
def test_quick_real_shape_run_routes_both_policies_over_both_servers(tmp_path: Path) -> None:
    cfg = RealShapeConfig.quick(out=tmp_path, base_port=18990)
    doc = run_real_shape(cfg, log=lambda _: None)
    profile = json.loads((tmp_path / "real-shape-profile.json").read_text())
    assert set(profile["backends"]) == {"one-slot", "four-slot"}
    # the engines compute on this machine: a busy CPU does not void their levels
    assert doc["seeding"]["profile_levels_used"] == {"one-slot": [1, 4], "four-slot": [1, 4]}
    for policy in ("least-load", "engine-shape"):
        routing = yaml.safe_load((tmp_path / "real-shape" / f"gateway-{policy}.yaml").read_text())["routing"]
        assert Path(routing["engine_profile"]) == (tmp_path / "real-shape-profile.json").resolve()
    for level in ("1", "4"):
        row = doc["levels"][level]
        for p in row["policies"].values():
            assert p["ok"] == p["requests"] > 0
            assert set(p["backends"]) <= {"one-slot", "four-slot"}
        assert set(row["engine_shape_vs_least_load"]) == {"throughput_x", "ttft_p50_x", "ttft_p90_x", "e2e_p90_x"}
