"""deploy/kubernetes: every manifest against the Kubernetes API schemas (kubernetes-validate, strict), the
ServiceMonitor CRD by its own structure, the rendered kustomization (kubectl kustomize), and the wiring between
them: labels and selectors, ports, probes, the gateway's configuration and the backends' DNS names."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_support import DOCKERFILE, GATEWAY_CONFIGS, KUBERNETES, ROOT, tool

from gateway.config import load_settings

pytestmark = pytest.mark.unit

# the oldest release still in wide use whose API has everything used here (preStop sleep), and the newest bundled
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CRD_GROUPS = ("monitoring.coreos.com/",)

# The part of monitoring.coreos.com/v1 ServiceMonitor that these manifests use (Prometheus Operator's CRD).
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}}},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object",
                                                            "additionalProperties": {"type": "string"}}}},
                "namespaceSelector": {"type": "object"},
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "object", "additionalProperties": False, "required": ["port"],
                              "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                             "interval": {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"},
                                             "scrapeTimeout": {"type": "string"},
                                             "scheme": {"enum": ["http", "https"]}}},
                },
            },
        },
    },
}


def kustomization() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    return doc


def manifests() -> list[tuple[str, dict[str, Any]]]:
    """(file, document) for every resource the kustomization lists."""
    out = []
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((KUBERNETES / name).read_text()):
            if doc:
                out.append((name, doc))
    return out


def validation_errors(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(map(str, exc.path))}: {exc.message}"
    return None


def find(kind: str, name: str, docs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    for doc in docs if docs is not None else [d for _, d in manifests()]:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name}")


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in manifests() if doc["kind"] == kind]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    on_disk = {str(p.relative_to(KUBERNETES)) for p in KUBERNETES.rglob("*.yaml")}
    generated_from = {entry.split("=")[-1] for g in kustomization()["configMapGenerator"] for entry in g["files"]}
    assert on_disk - {"kustomization.yaml"} - generated_from == listed


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_match_the_kubernetes_api(version: str) -> None:
    checked = 0
    for file, doc in manifests():
        if doc["apiVersion"].startswith(CRD_GROUPS):
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, version, strict=True)
            continue
        assert validation_errors(doc, version) is None, f"{file}: {doc['kind']} {doc['metadata']['name']}"
        checked += 1
    assert checked >= 13


def test_strict_validation_catches_mistakes() -> None:
    deployment = copy.deepcopy(find("Deployment", "llm-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {"httpGet": {"path": "/ready"}}
    assert "readinessprobe" in (validation_errors(deployment, VERSIONS[-1]) or "")
    hpa = copy.deepcopy(find("HorizontalPodAutoscaler", "llm-gateway"))
    hpa["spec"]["metrics"][1]["resource"]["target"]["averageUtilization"] = "70%"
    assert validation_errors(hpa, VERSIONS[-1]) is not None


def test_service_monitors_select_services_and_their_ports() -> None:
    monitors = of_kind("ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"llm-gateway", "llm-gateway-engines"}
    services = of_kind("Service")
    for monitor in monitors:
        jsonschema.validate(monitor, SERVICE_MONITOR)
        chosen = [s for s in services if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert chosen, f"ServiceMonitor {monitor['metadata']['name']} selects no Service"
        for service in chosen:
            port_names = {p["name"] for p in service["spec"]["ports"]}
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint["port"] in port_names and endpoint["path"] == "/metrics"
    gateway = find("ServiceMonitor", "llm-gateway")
    assert [s["metadata"]["name"] for s in services
            if selects(gateway["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])] == ["llm-gateway"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**gateway, "spec": {**gateway["spec"], "endpoint": []}}, SERVICE_MONITOR)


def test_the_gateway_deployment() -> None:
    deployment = find("Deployment", "llm-gateway")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] == 3
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    # non-root, as the image's own user; nothing writable but /tmp
    uid = int(re.search(r"^USER (\d+)", DOCKERFILE.read_text(), re.M).group(1))  # type: ignore[union-attr]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == uid
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"]
    assert volumes[mounts["/etc/gateway"]]["configMap"]["name"] == "llm-gateway-config"
    args = container["args"]
    assert args[:3] == ["serve", "--config", "/etc/gateway/gateway.yaml"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and "memory" in container["resources"]["limits"]
    # the Service, the autoscaler and the disruption budget all find these Pods
    service = find("Service", "llm-gateway")
    assert selects(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    hpa = find("HorizontalPodAutoscaler", "llm-gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm-gateway"}
    assert hpa["spec"]["minReplicas"] == deployment["spec"]["replicas"] < hpa["spec"]["maxReplicas"]
    # on the gateway's own saturation signal, through prometheus-adapter's rule for it, and on CPU
    pods = next(m["pods"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods")
    adapter = yaml.safe_load((ROOT / "deploy/prometheus/adapter-rules.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert rule["name"]["as"] == pods["metric"]["name"] == "gateway_requests_in_flight"
    assert rule["seriesQuery"].startswith(pods["metric"]["name"] + "{")
    assert "gateway_requests_in_flight" in (ROOT / "gateway/telemetry/request_metrics.py").read_text()
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Pods", "Resource"}
    pdb = find("PodDisruptionBudget", "llm-gateway")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_the_configmap_carries_the_validated_gateway_config() -> None:
    (generator,) = kustomization()["configMapGenerator"]
    assert generator["name"] == "llm-gateway-config" and generator["files"] == ["gateway.yaml=gateway/gateway.yaml"]
    copy_in_base = KUBERNETES / "gateway" / "gateway.yaml"
    assert copy_in_base.read_text() == (GATEWAY_CONFIGS / "kubernetes.yaml").read_text(), (
        "deploy/kubernetes/gateway/gateway.yaml must be a copy of deploy/gateway/kubernetes.yaml "
        "(kustomize cannot read files outside deploy/kubernetes)")


def test_the_replicas_share_one_redis() -> None:
    settings = load_settings(GATEWAY_CONFIGS / "kubernetes.yaml")
    namespace = kustomization()["namespace"]
    assert settings.state.url == f"redis://redis.{namespace}.svc.cluster.local:6379/0"
    service = find("Service", "redis")
    (port,) = service["spec"]["ports"]
    assert port["port"] == 6379
    redis = find("Deployment", "redis")
    assert redis["spec"]["replicas"] == 1 and selects(service["spec"]["selector"],
                                                       redis["spec"]["template"]["metadata"]["labels"])
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert {"name": port["targetPort"], "containerPort": 6379, "protocol": "TCP"} in container["ports"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--save" in container["args"]  # no persistence: soft state


def test_backends_are_found_through_headless_services() -> None:
    """Each DNS backend names a headless Service of this namespace, on the port its Pods listen on."""
    settings = load_settings(GATEWAY_CONFIGS / "kubernetes.yaml")
    # replicas agree on prefixes through the placements they share in Redis
    assert settings.routing.policy == "default" and settings.state.url is not None
    namespace = kustomization()["namespace"]
    deployments = of_kind("Deployment")
    assert len(settings.backends) == 3
    for backend in settings.backends:
        assert backend.url is None and backend.dns is not None, backend.name
        service_name, ns, *rest = backend.dns.split(".")
        assert (ns, rest) == (namespace, ["svc", "cluster", "local"]), backend.dns
        service = find("Service", service_name)
        assert service["spec"]["clusterIP"] == "None", f"{service_name} must be headless: one address per Pod"
        (port,) = service["spec"]["ports"]
        assert port["port"] == backend.port
        (deployment,) = [d for d in deployments
                         if selects(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert {"name": port["targetPort"], "containerPort": backend.port} in container["ports"]
        assert deployment["metadata"]["name"] == backend.name == backend.engine
        assert container["readinessProbe"], "DNS lists only ready Pods: the probe decides when a replica joins"


def test_backends_run_the_engines_real_images_with_metrics() -> None:
    def container(name: str) -> dict[str, Any]:
        result: dict[str, Any] = find("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        return result

    llamacpp, vllm, sglang = container("llamacpp"), container("vllm"), container("sglang")
    assert llamacpp["image"] == "ghcr.io/ggml-org/llama.cpp:server" and "--metrics" in llamacpp["args"]
    assert vllm["image"].startswith("vllm/vllm-openai:") and "--enable-prompt-tokens-details" in vllm["args"]
    assert sglang["image"].startswith("lmsysorg/sglang:")
    assert {"--enable-metrics", "--enable-cache-report"} <= set(sglang["args"])
    for gpu in (vllm, sglang):
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in llamacpp["resources"].get("limits", {})


@pytest.mark.system
def test_the_rendered_kustomization_validates() -> None:
    """What `kubectl apply -k deploy/kubernetes` would send (kubectl's built-in kustomize, offline)."""
    rendered = subprocess.run([tool("kubectl"), "kustomize", str(KUBERNETES)], capture_output=True, text=True,
                              timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert len(docs) == len(manifests()) + 1  # + the generated ConfigMap
    namespace = kustomization()["namespace"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]["name"]
        if not doc["apiVersion"].startswith(CRD_GROUPS):
            assert validation_errors(doc, VERSIONS[-1]) is None, doc["metadata"]["name"]
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["data"]["gateway.yaml"] == (GATEWAY_CONFIGS / "kubernetes.yaml").read_text()
    deployment = find("Deployment", "llm-gateway", docs)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"] != "llm-gateway-config"
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    (entry,) = kustomization()["images"]
    assert image == f"{entry['newName']}:{entry['newTag']}"


@pytest.mark.system
def test_kubectl_kustomize_fails_on_a_broken_base(tmp_path: Path) -> None:
    broken = tmp_path / "kustomization.yaml"
    broken.write_text("resources:\n  - missing.yaml\n")
    rendered = subprocess.run([tool("kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True,
                              timeout=120)
    assert rendered.returncode != 0


def test_the_keda_example_scales_a_backend_of_the_base_on_metrics_the_gateway_exports() -> None:
    scaled = yaml.safe_load((ROOT / "deploy" / "keda" / "vllm.yaml").read_text())
    assert scaled["kind"] == "ScaledObject" and scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["metadata"]["namespace"] == kustomization()["namespace"]
    target = scaled["spec"]["scaleTargetRef"]
    backend = next(d for d in yaml.safe_load_all((KUBERNETES / "backends" / "vllm.yaml").read_text())
                   if d["kind"] == "Deployment")
    assert (target["kind"], target["name"]) == (backend["kind"], backend["metadata"]["name"])
    exported = (ROOT / "gateway/telemetry/flow.py").read_text()
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
        names = re.findall(r"\b(gateway_[a-z_]+)\{", trigger["metadata"]["query"])
        assert names and all(f'"{name}"' in exported for name in names), names
