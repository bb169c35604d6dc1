"""``gateway bench routing {prefix,shape,real-prefix,real-shape}``: the routing policies measured against each
other. See ``cli.py`` for what each benchmark does; ``stack.py`` holds what they share; ``oracle.py`` the best
placement a policy could reach, for the prefix benchmarks."""

from gateway.bench.routing.cli import build_parser, main
from gateway.bench.routing.prefix import (
    PrefixConfig,
    kv_capacity_for,
    prefix_fleet,
    prefix_set_tokens,
    prefix_workload,
    run_prefix,
    summarize_prefix,
)
from gateway.bench.routing.real_prefix import RealPrefixConfig, run_real_prefix
from gateway.bench.routing.real_shape import RealShapeConfig, run_real_shape
from gateway.bench.routing.shape import ShapeConfig, run_shape, shape_level, shape_requests, shape_verdict
from gateway.bench.routing.stack import (
    against,
    better,
    dump_yaml,
    fleet_config,
    gateway_config,
    policy_summary,
    sim_server,
    target_check,
)

__all__ = [
    "PrefixConfig", "RealPrefixConfig", "RealShapeConfig", "ShapeConfig", "against", "better", "build_parser",
    "dump_yaml", "fleet_config", "gateway_config", "kv_capacity_for", "main", "policy_summary", "prefix_fleet",
    "prefix_set_tokens", "prefix_workload", "run_prefix", "run_real_prefix", "run_real_shape", "run_shape",
    "shape_level", "shape_requests", "shape_verdict", "sim_server", "summarize_prefix", "target_check",
]
