"""The Grafana dashboard and Prometheus rules in deploy/: generated as committed, every panel queries something,
and every metric they name is one the gateway exports (gateway/telemetry/metrics.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_JSON = GRAFANA / "dashboards" / "gateway.json"
RULES = ROOT / "deploy" / "prometheus" / "rules" / "gateway-rules.yml"
# where the gateway's metrics are defined: metrics.py, request_metrics.py for the series every request updates,
# loop_lag.py for the event loop's lag
METRICS_SOURCES = [ROOT / "gateway" / "telemetry" / name
                   for name in ("metrics.py", "request_metrics.py", "loop_lag.py")]


def metric_source() -> str:
    return "\n".join(path.read_text() for path in METRICS_SOURCES)
ROWS = ["Traffic", "Latency", "Throughput", "Backends", "Routing", "KV events (vLLM, SGLang)", "Shared state (Redis)"]

# a metric name, not part of a recording rule's level:name:operation
METRIC_NAME = re.compile(r"(?<![\w:])(gateway_\w+)(?![\w:])")


def load_script(name: str) -> ModuleType:
    """A deploy/grafana script as a module (they are standalone scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"deploy_grafana_{name}", GRAFANA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text())
    return loaded


def exported_names() -> set[str]:
    """Every series name the gateway exposes: the names defined in metrics.py, with the suffixes Prometheus
    adds for counters (_total) and histograms (_bucket, _sum, _count)."""
    names: set[str] = set()
    for name in re.findall(r'"(gateway_\w+)"', metric_source()):
        names |= {name, f"{name}_total", f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


@pytest.mark.system
def test_the_committed_dashboard_is_the_generators_output() -> None:
    run = subprocess.run([sys.executable, str(GRAFANA / "dashboard.py")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, f"the generator failed (needs grafana-foundation-sdk, a dev dependency):\n{run.stderr}"
    assert run.stdout == DASHBOARD_JSON.read_text(), (
        "deploy/grafana/dashboards/gateway.json is stale: "
        "python deploy/grafana/dashboard.py > deploy/grafana/dashboards/gateway.json")


def test_rows_panels_and_queries() -> None:
    board = dashboard()
    preview = load_script("preview")
    found = preview.panels(board)
    assert [p["title"] for p in board["panels"] if p["type"] == "row"] == ROWS
    assert {p.row for p in found} == set(ROWS), "every row has panels"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in found:
        assert panel.targets, f"{panel.title}: no query"
        assert panel.unit, f"{panel.title}: no unit"
    for raw in board["panels"]:
        if raw["type"] == "row":
            continue
        assert raw["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, raw["title"]
        for target in raw["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", raw["title"]
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"], target["expr"]
            assert target["refId"] and target["legendFormat"], raw["title"]


def test_template_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("backend", "model"):
        var = variables[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"] and var["allValue"] == ".*"
        assert f", {name})" in var["query"]["query"]
    exprs = [t.expr for p in load_script("preview").panels(dashboard()) for t in p.targets]
    unlabelled = ("gateway_routing_plugin_seconds", "gateway_requests_in_flight",  # no backend label
                  "gateway_connections_refused_total", "gateway_state_", "gateway_event_loop_lag_seconds")
    for expr in exprs:
        assert "$backend" in expr or any(name in expr for name in unlabelled), expr
    assert any("$model" in e for e in exprs)


def test_every_metric_the_dashboard_and_rules_name_is_exported() -> None:
    exported = exported_names()
    board = dashboard()
    texts = [t.expr for p in load_script("preview").panels(board) for t in p.targets]
    texts += [v["query"]["query"] for v in board["templating"]["list"] if isinstance(v.get("query"), dict)]
    rules = yaml.safe_load(RULES.read_text())
    texts += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    named = {name for text in texts for name in METRIC_NAME.findall(text)}
    assert named, "no metric names found"
    assert named <= exported, f"not exported by the gateway: {sorted(named - exported)}"
    # every family the gateway exports appears on the dashboard
    families = set(re.findall(r'"(gateway_\w+)"', metric_source()))
    missing = {f for f in families if not any(n.startswith(f) for n in named)}
    assert not missing, f"exported but on no panel or rule: {sorted(missing)}"


def test_recording_rules_used_by_alerts_are_defined() -> None:
    rules = yaml.safe_load(RULES.read_text())
    records = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"GatewayBackendDown", "GatewayTimeToFirstTokenHigh",
                                            "GatewayErrorRateHigh", "GatewayBackendLoadStale",
                                            "GatewayNoReadyBackend"}
    for alert in alerts:
        for used in re.findall(r"\b[a-z_]+:[a-z_0-9]+:[a-z_0-9]+\b", alert["expr"]):
            assert used in records, f"{alert['alert']} uses undefined {used}"
        assert alert["annotations"]["summary"] and alert["labels"]["severity"]
