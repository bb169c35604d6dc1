"""compose.yaml: the Compose Specification's JSON schema, then what the schema cannot see (start order,
profiles, health checks, the engines' flags, the gateway configurations it mounts)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml
from deploy_support import COMPOSE, CONFIG_PATH_IN_IMAGE, ROOT, check_config

from gateway.config import load_settings

pytestmark = pytest.mark.unit

SCHEMA = Path(__file__).parent / "schemas" / "compose-spec.json"
_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\})")


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Compose's variable interpolation (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``,
    ``${VAR:+alt}``, ``$$``), applied to every string as Compose does before validating."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    if not isinstance(node, str):
        return node

    def one(match: re.Match[str]) -> str:
        if match.group(1):
            return "$"
        name, op, arg = match.group(2), match.group(3), match.group(4) or ""
        value = env.get(name)
        empty_is_unset = op is not None and op.startswith(":")
        unset = value is None or (empty_is_unset and value == "")
        if op in ("-", ":-"):
            return arg if unset else str(value)
        if op in ("?", ":?"):
            if unset:
                raise ValueError(f"required variable {name} is missing: {arg}")
            return str(value)
        if op in ("+", ":+"):
            return "" if unset else arg
        return "" if value is None else value

    return _VARIABLE.sub(one, node)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})
    assert isinstance(doc, dict)
    return doc


def schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose["services"]
    return result


def profiles(service: dict[str, Any]) -> set[str]:
    return set(service.get("profiles", []))


def gateways(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if s.get("build", {}).get("target") == "gateway"}


def command_flag(service: dict[str, Any], flag: str) -> str:
    command = [str(part) for part in service["command"]]
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def listening_ports(service: dict[str, Any]) -> set[int]:
    """Ports the service's process listens on, read from its command line."""
    command = [str(part) for part in service.get("command", [])]
    if "--base-port" in command:  # the emulated fleet: one server per engine on consecutive ports
        return set(range(int(command_flag(service, "--base-port")), int(command_flag(service, "--base-port")) + 4))
    return {int(command_flag(service, "--port"))}


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


def test_it_matches_with_variables_set_too() -> None:
    env = {"GATEWAY_PORT": "9000", "VLLM_MODEL": "meta-llama/Llama-3.1-8B-Instruct", "VLLM_GPU": "3",
           "MODELS_DIR": "/srv/models", "LLAMACPP_MODEL": "qwen2.5-7b-q4_k_m.gguf", "GATEWAY_REPLICAS": "3"}
    doc = load_compose(env)
    assert schema_errors(doc) == []
    assert doc["services"]["lb"]["ports"] == ["9000:8000"]
    assert doc["services"]["gateway"]["deploy"]["replicas"] == "3"
    assert doc["services"]["vllm"]["command"][0] == "meta-llama/Llama-3.1-8B-Instruct"
    assert doc["services"]["llamacpp"]["volumes"] == ["/srv/models:/models:ro"]


def test_the_schema_check_catches_mistakes(compose: dict[str, Any]) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["depends_on"]["llamacpp"]["condition"] = "service_up"
    broken["services"]["grafana"]["healthcheck"]["retry"] = 3
    broken["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] = "gpu"
    errors = schema_errors(broken)
    assert any(e.startswith("services/gateway/depends_on:") for e in errors), errors
    assert any(e.startswith("services/grafana/healthcheck:") and "retry" in e for e in errors), errors
    assert any(e.startswith("services/vllm/deploy/resources/reservations/devices/0/capabilities:") for e in errors), \
        errors


def test_every_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and not check.get("disable"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert "start_period" in check, f"{name}: give slow starters a start_period"


def test_start_order_waits_for_healthy_dependencies(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on an unknown service {dependency}"
            assert spec["condition"] == "service_healthy", f"{name} -> {dependency}"
            # the dependency must be enabled whenever the dependent is
            needed = profiles(services[dependency])
            assert not needed or needed & profiles(service), f"{name} -> {dependency}: profiles {needed}"


def test_profiles_cpu_by_default_gpu_engines_and_an_emulated_fleet(services: dict[str, dict[str, Any]]) -> None:
    by_default = {name for name, s in services.items() if not profiles(s)}
    assert by_default == {"llamacpp", "gateway", "redis", "lb", "prometheus", "grafana"}
    assert {name for name, s in services.items() if "gpu" in profiles(s)} == {"vllm", "sglang", "tabbyapi",
                                                                             "gateway-gpu"}
    assert {name for name, s in services.items() if "emulated" in profiles(s)} == {"sim", "gateway-emulated"}
    for engine in ("vllm", "sglang", "tabbyapi"):
        devices = services[engine]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], engine
    # the emulated profile needs no GPU and no model: nothing reserved, nothing mounted but its own config
    for name in ("sim", "gateway-emulated"):
        assert "resources" not in services[name].get("deploy", {}), name
        assert all(v.startswith("./deploy/gateway/") for v in services[name].get("volumes", [])), name
    assert services["sim"]["build"]["target"] == "sim"


def test_engines_run_their_real_images_with_metrics_and_cache_reports(services: dict[str, dict[str, Any]]) -> None:
    assert services["llamacpp"]["image"] == "ghcr.io/ggml-org/llama.cpp:server"
    assert services["vllm"]["image"].startswith("vllm/vllm-openai:")
    assert services["sglang"]["image"].startswith("lmsysorg/sglang:")
    assert services["tabbyapi"]["image"].startswith("ghcr.io/theroyallab/tabbyapi:")
    assert "--metrics" in services["llamacpp"]["command"]
    assert command_flag(services["llamacpp"], "--model").startswith("/models/")
    assert any(v.endswith(":/models:ro") for v in services["llamacpp"]["volumes"])
    assert "--enable-prompt-tokens-details" in services["vllm"]["command"]
    assert {"--enable-metrics", "--enable-cache-report"} <= set(services["sglang"]["command"])
    # SGLang's /health runs a generation; the probe must not
    assert "/health" not in " ".join(services["sglang"]["healthcheck"]["test"])


@pytest.mark.parametrize("gateway", ["gateway", "gateway-gpu", "gateway-emulated"])
def test_each_gateway_waits_for_the_backends_its_config_names(
    gateway: str, services: dict[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(gateways(services)) == {"gateway", "gateway-gpu", "gateway-emulated"}
    service = services[gateway]
    mounts = {target: source for source, target, *_ in (v.split(":") for v in service["volumes"])}
    config = ROOT / mounts[CONFIG_PATH_IN_IMAGE]
    check_config(config, capsys)
    settings = load_settings(config)
    assert settings.server.host == "0.0.0.0" and settings.server.port == 8000
    # replicas behind `lb`, sharing their state in the `redis` service
    assert "ports" not in service and service["deploy"]["replicas"] == "2"
    assert settings.state.url == "redis://redis:6379/0" and "redis" in service["depends_on"]
    assert "--save" in services["redis"]["command"]
    assert settings.backends, config
    for backend in settings.backends:
        assert backend.url is not None, f"{config}: compose backends have fixed addresses"
        url = urlsplit(backend.url)
        assert url.hostname in service["depends_on"], f"{gateway} does not wait for {url.hostname}"
        assert url.port in listening_ports(services[url.hostname]), f"{backend.name}: nothing listens on {url.port}"
    assert service["networks"]["default"]["aliases"] == ["gateway"], "lb and Prometheus find the replicas by it"


def test_one_port_in_front_of_the_replicas_and_prometheus_scrapes_each(services: dict[str, dict[str, Any]]) -> None:
    lb = services["lb"]
    assert lb["ports"] == ["8000:8000"] and lb["image"].startswith("nginx:")
    source, target, _ = lb["volumes"][0].split(":")
    assert target == "/etc/nginx/nginx.conf"
    conf = (ROOT / source).read_text()
    # resolved again and again through Docker's DNS (every replica's address), streams unbuffered
    assert "resolver 127.0.0.11" in conf and "set $gateway gateway:8000;" in conf
    assert "proxy_pass http://$gateway;" in conf and "proxy_buffering off;" in conf
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "gateway")
    assert job["dns_sd_configs"] == [{"names": ["gateway"], "type": "A", "port": 8000, "refresh_interval": "30s"}]


def test_monitoring_reads_the_provisioned_files(services: dict[str, dict[str, Any]]) -> None:
    prometheus = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert prometheus["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus/prometheus.yml"
    assert prometheus["/etc/prometheus/rules"] == "./deploy/prometheus/rules"
    assert grafana["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    assert grafana["/var/lib/grafana/dashboards"] == "./deploy/grafana/dashboards"
    for source in (*prometheus.values(), *grafana.values()):
        if source.startswith("./"):
            assert (ROOT / source).exists(), f"compose.yaml mounts {source}, which does not exist"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
