"""The prefix benchmark through three gateway replicas sharing one real redis-server: the replicas, taking the
requests in turn as behind a round-robin load balancer, find the engines' cached prefixes about as well as one
gateway does (the issue's bar: at least 90% of one gateway's cache-hit rate). Each replica publishes the
prompt blocks and sessions it routes; without that, each would learn only a third of the placements."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.bench.routing.prefix import PrefixConfig, run_prefix
from tests.conftest import free_port_block

pytestmark = pytest.mark.system


def test_three_replicas_hit_the_caches_about_as_often_as_one_gateway(tmp_path: Path) -> None:
    # the benchmark's own workload (32 prompt families of 16 requests, 16 streams), on emulators 5x faster
    cfg = PrefixConfig(policies=["round-robin", "default"], replicas=3, time_scale=5.0,
                       base_port=free_port_block(24), out=tmp_path, include_requests=False)
    doc = run_prefix(cfg, log=lambda *_: None)
    policies = doc["policies"]
    assert {name: p["ok"] for name, p in policies.items()} == {"round-robin": 512, "default": 512,
                                                               "default x3": 512}
    replicated = doc["replicas"]["default"]
    assert replicated["target"]["met"], replicated
    # and well above what routing that ignores prefixes gets
    assert policies["default x3"]["cache_hit_rate"] > 1.5 * policies["round-robin"]["cache_hit_rate"]
