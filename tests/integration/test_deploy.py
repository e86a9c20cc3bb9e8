"""Cluster bundle: rendered manifests (equal to a fresh render; every object valid against the Kubernetes and CRD
schemas, unknown and mistyped fields refused), every rendered PromQL parsed by promtool, the alert rules, and the
Grafana dashboard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"


VALIDATOR = ROOT / "deploy" / "validate" / "validate.mjs"
CRD_GROUPS = ("argoproj.io/", "keda.sh/", "monitoring.coreos.com/")


def _render(tmp: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "deploy", "render", "--out", str(tmp / "k8s"),
                           "--dashboard", str(tmp / "sdserve.json"), *flags], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def _docs(folder: Path) -> list[dict[str, Any]]:
    return [d for p in sorted(folder.rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _by_kind(folder: Path) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for doc in _docs(folder):
        found.setdefault(doc["kind"], []).append(doc)
    return found


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh `--kind deployment` render (the plain Deployment for clusters without Argo Rollouts)."""
    tmp = tmp_path_factory.mktemp("plain")
    done = _render(tmp, "--kind", "deployment", "--min-replicas", "0")
    assert done.returncode == 0, done.stderr
    return tmp / "k8s"


def _crd_check(docs: list[dict[str, Any]], tmp: Path) -> subprocess.CompletedProcess[str]:
    """The node validator (deploy/validate/validate.mjs: the @kubernetes-models CRD schemas, unknown fields
    refused) on these documents."""
    node = shutil.which("node")
    assert node, "node missing: install Node.js 20+ (make test installs the schemas with npm)"
    assert (VALIDATOR.parent / "node_modules").is_dir(), "run `make tools` (npm ci in deploy/validate)"
    path = tmp / f"docs-{len(list(tmp.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([node, str(VALIDATOR), str(path)], capture_output=True, text=True, timeout=60)


def test_committed_manifests_equal_a_fresh_render(tmp_path: Path) -> None:
    assert _render(tmp_path).returncode == 0
    committed = {p.relative_to(K8S) for p in K8S.rglob("*.yaml")}
    assert committed == {p.relative_to(tmp_path / "k8s") for p in (tmp_path / "k8s").rglob("*.yaml")}
    for rel in sorted(committed):
        assert (tmp_path / "k8s" / rel).read_text() == (K8S / rel).read_text(), f"{rel}: run sdserve deploy render"
    assert (tmp_path / "sdserve.json").read_text() == (ROOT / "deploy" / "grafana" / "sdserve.json").read_text()


def test_default_render_is_the_argo_rollout_with_keda_and_no_hpa_or_script() -> None:
    kinds = _by_kind(K8S)
    assert sorted(kinds) == ["AnalysisTemplate", "Deployment", "PodDisruptionBudget", "Rollout", "ScaledObject",
                             "Service", "ServiceMonitor"]
    assert [d["metadata"]["name"] for d in kinds["Deployment"]] == ["sdserve-dev"]  # only the dev overlay
    assert not (ROOT / "deploy" / "rollout.sh").exists() and not (K8S / "hpa.yaml").exists()


def test_every_rendered_object_validates_against_its_schema(plain: Path, tmp_path: Path) -> None:
    """Core kinds against Kubernetes 1.33 (kubernetes-validate, strict: unknown fields fail); the CRDs against the
    Argo Rollouts, KEDA and Prometheus Operator schemas (node). Both renders, every object."""
    docs = _docs(K8S) + _docs(plain)
    crds = [d for d in docs if d["apiVersion"].startswith(CRD_GROUPS)]
    for doc in docs:
        if doc not in crds:
            kubernetes_validate.validate(doc, "1.33", strict=True)
    done = _crd_check(crds, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(crds) and all(line.startswith("ok ") for line in lines), done.stdout
    assert {d["kind"] for d in crds} == {"Rollout", "AnalysisTemplate", "ScaledObject", "ServiceMonitor"}


def _mistyped(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    bad: dict[str, Any] = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    node: Any = bad
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return bad


@pytest.mark.parametrize(("kind", "path", "value", "why"), [
    ("ScaledObject", "spec.minReplicaCount", "zero", "/spec/minReplicaCount"),
    ("ScaledObject", "spec.triggers.0.metadata.query", 5, "/spec/triggers/0/metadata/query"),
    ("ScaledObject", "spec.minReplicas", 0, "unknown field(s) /spec/minReplicas"),
    ("Rollout", "spec.strategy.blueGreen.autoPromote", True, "unknown field(s) /spec/strategy/blueGreen/autoPromote"),
    ("Rollout", "spec.strategy.blueGreen.scaleDownDelaySeconds", "ten", "/spec/strategy/blueGreen/scaleDownDelaySec"),
    ("Rollout", "spec.template.spec.containers.0.readinessProbe.httpGet.paht", "/ready", "unknown field(s)"),
    ("AnalysisTemplate", "spec.metrics.0.provider.job.spec.backofLimit", 0, "unknown field(s)"),
    ("ServiceMonitor", "spec.endpoints.0.intervall", "15s", "unknown field(s) /spec/endpoints/0/intervall"),
])
def test_a_mistyped_or_unknown_field_is_rejected(kind: str, path: str, value: Any, why: str, tmp_path: Path) -> None:
    doc = _by_kind(K8S)[kind][0]
    assert _crd_check([doc], tmp_path).returncode == 0  # the committed object passes, so the change is what fails
    done = _crd_check([_mistyped(doc, path, value)], tmp_path)
    assert done.returncode == 1 and done.stdout.startswith(f"INVALID {doc['apiVersion']}/{kind}"), done.stdout
    assert why in done.stdout, done.stdout


def test_an_unknown_core_field_is_rejected_too() -> None:
    service = _by_kind(K8S)["Service"][0]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_mistyped(service, "spec.selectr", {}), "1.33", strict=True)


def _queries(docs: list[dict[str, Any]]) -> list[str]:
    """Every PromQL string in the rendered objects (the analyses' and KEDA's `query` fields)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "query" and isinstance(value, str):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(docs)
    return found


def _promtool_check(queries: list[str], tmp: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make tools` installs Debian's prometheus package"
    rules = {"groups": [{"name": "rendered", "rules": [{"record": f"sdserve:rendered_query_{i}", "expr": q}
                                                       for i, q in enumerate(queries)]}]}
    path = tmp / "queries.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


def test_promtool_parses_every_rendered_query(plain: Path, tmp_path: Path) -> None:
    from server.cli import rollout

    queries = _queries(_docs(K8S) + _docs(plain))
    assert set(queries) == set(rollout.queries().values())  # every constant is rendered, nothing else is
    assert len(queries) == 6  # the ScaledObject's (in both renders) and the four preview checks
    done = _promtool_check(queries, tmp_path)
    assert done.returncode == 0 and f"SUCCESS: {len(queries)} rules found" in done.stdout, done.stdout + done.stderr
    broken = _promtool_check([queries[0].replace(")", "", 1)], tmp_path)  # the check does parse
    assert broken.returncode != 0


def test_rollout_analyses_and_scaling_are_wired_together() -> None:
    from server.cli import rollout

    kinds = _by_kind(K8S)
    ro = kinds["Rollout"][0]
    blue_green = ro["spec"]["strategy"]["blueGreen"]
    services = {s["metadata"]["name"]: s for s in kinds["Service"]}
    assert set(services) == {blue_green["activeService"], blue_green["previewService"]} == {"sdserve",
                                                                                             "sdserve-preview"}
    labels = ro["spec"]["selector"]["matchLabels"]
    assert ro["spec"]["template"]["metadata"]["labels"] == labels
    assert all(s["spec"]["selector"] == labels for s in services.values())
    assert kinds["PodDisruptionBudget"][0]["spec"]["selector"]["matchLabels"] == labels
    assert blue_green["autoPromotionEnabled"] is True and blue_green["scaleDownDelaySeconds"] == 600
    templates = {t["metadata"]["name"]: t for t in kinds["AnalysisTemplate"]}
    assert [t["templateName"] for t in blue_green["prePromotionAnalysis"]["templates"]] == sorted(templates)
    job = templates["sdserve-performance-gate"]["spec"]["metrics"][0]["provider"]["job"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    assert container["command"] == rollout.gate_command() and job["backoffLimit"] == 0
    assert container["command"][:3] == ["sdserve", "deploy", "gate"]
    assert "http://sdserve:80" in container["command"] and "http://sdserve-preview:80" in container["command"]
    health = {m["name"]: m for m in templates["sdserve-preview-health"]["spec"]["metrics"]}
    assert set(health) == {"error-rate", "tenant-p95", "ready", "fast-path-signature"}
    assert all('service="sdserve-preview"' in m["provider"]["prometheus"]["query"] for m in health.values())
    scaled = kinds["ScaledObject"][0]
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
                                                "name": "sdserve"}
    trigger = scaled["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert "sdserve_queue_depth" in trigger["metadata"]["query"] and scaled["spec"]["minReplicaCount"] == 1
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold", "activationThreshold"}


def test_plain_deployment_render_scales_the_deployment_and_can_scale_to_zero(plain: Path) -> None:
    kinds = _by_kind(plain)
    assert "Rollout" not in kinds and "AnalysisTemplate" not in kinds
    names = sorted(d["metadata"]["name"] for d in kinds["Deployment"])
    assert names == ["sdserve-blue", "sdserve-dev"]
    scaled = kinds["ScaledObject"][0]["spec"]
    assert scaled["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sdserve-blue"}
    assert scaled["minReplicaCount"] == 0  # --min-replicas 0


def test_render_refuses_inconsistent_replica_bounds(tmp_path: Path) -> None:
    done = _render(tmp_path, "--min-replicas", "9", "--max-replicas", "8")
    assert done.returncode != 0 and "--min-replicas" in done.stderr


@pytest.mark.parametrize("kind", ["rollout", "deployment"])
def test_pod_template_matches_the_server_and_the_matrix(kind: str, plain: Path) -> None:
    from server.settings import load_settings

    dep = _by_kind(K8S if kind == "rollout" else plain)["Rollout" if kind == "rollout" else "Deployment"][0]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["httpGet"]["path"] == "/ready"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 900
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and pod["runtimeClassName"] == "nvidia"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] > load_settings("production").queue.drain_timeout_s
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    exprs = {e["key"]: e for e in terms[0]["matchExpressions"]}
    assert exprs["nvidia.com/cuda.driver-version.major"] == {"key": "nvidia.com/cuda.driver-version.major",
                                                             "operator": "Gt", "values": ["579"]}
    assert exprs["nvidia.com/gpu.compute.major"]["values"] == ["8", "9", "10", "12"]
    assert {m["mountPath"]: m.get("readOnly") for m in c["volumeMounts"]}["/models"] is True


def test_prometheus_rules_check_and_unit_tests_pass() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: `make tools` installs Debian's prometheus package"
    rules = ROOT / "deploy" / "prometheus"
    check = subprocess.run([promtool, "check", "rules", "alerts.yml"], cwd=rules, capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 10 rules found" in check.stdout, check.stdout + check.stderr
    tests = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=rules, capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_grafana_dashboard_loads_with_the_required_panels() -> None:
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads((ROOT / "deploy" / "grafana" / "sdserve.json").read_text())
    board = Dashboard.from_json(data)  # the Grafana Foundation SDK's dashboard model
    assert board.title == "sdserve" and board.uid == "sdserve-overview"
    titles = [p.title for p in board.panels]
    for title in ("Latency p50 / p95", "Images per minute", "Queue depth", "Readiness and degradation reasons",
                  "GPU SM utilization", "GPU memory-controller utilization", "GPU power"):
        assert title in titles
    exprs = " ".join(t["expr"] for p in data["panels"] for t in p["targets"])
    for metric in ("sdserve_gpu_sm_utilization_percent", "sdserve_gpu_memory_controller_utilization_percent",
                   "sdserve_gpu_power_watts", "sdserve_queue_depth", "sdserve_degraded", "sdserve_ready"):
        assert metric in exprs
