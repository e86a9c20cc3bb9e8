"""Cluster bundle: rendered manifests (schema-valid, equal to a fresh render), alert rules (promtool), the Grafana
dashboard, and the blue-green rollout script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).parents[2]
K8S = ROOT / "deploy" / "k8s"


def _render(tmp: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "deploy", "render", "--out", str(tmp / "k8s"),
                           "--dashboard", str(tmp / "sdserve.json")], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)


def test_committed_manifests_equal_a_fresh_render(tmp_path: Path) -> None:
    assert _render(tmp_path).returncode == 0
    for path in sorted(K8S.glob("*.yaml")):
        assert (tmp_path / "k8s" / path.name).read_text() == path.read_text(), f"{path.name}: run sdserve deploy render"
    assert {p.name for p in K8S.glob("*.yaml")} == {p.name for p in (tmp_path / "k8s").glob("*.yaml")}
    assert (tmp_path / "sdserve.json").read_text() == (ROOT / "deploy" / "grafana" / "sdserve.json").read_text()


@pytest.mark.parametrize("name", ["deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml"])
def test_manifests_validate_against_the_kubernetes_schema(name: str) -> None:
    for doc in yaml.safe_load_all((K8S / name).read_text()):
        kubernetes_validate.validate(doc, "1.33", strict=True)


def test_service_monitor_shape() -> None:
    # monitoring.coreos.com is a CRD: kubernetes-validate has no schema for it, so its shape is checked here.
    doc = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert doc["spec"]["endpoints"] == [{"interval": "15s", "path": "/metrics", "port": "http"}]


def test_deployment_matches_the_server_and_the_matrix() -> None:
    from server.settings import load_settings

    dep = yaml.safe_load((K8S / "deployment.yaml").read_text())
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


FAKE_KUBECTL = """#!/usr/bin/env bash
echo "kubectl $*" >> "$LOG"
case "$*" in
  *"get service"*) echo -n blue ;;
  *"rollout status"*) exit "${FAKE_ROLLOUT_RC:-0}" ;;
  *port-forward*) sleep 30 ;;
esac
"""
FAKE_SDSERVE = """#!/usr/bin/env bash
echo "sdserve $*" >> "$LOG"
case "$1" in
  deploy) out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/'); mkdir -p "$out"
          touch "$out/deployment.yaml" "$out/pdb.yaml" "$out/hpa.yaml" ;;
  bench) out=$(echo "$*" | sed -E 's/.*--out ([^ ]+).*/\\1/'); echo '{}' > "$out" ;;
  gate) exit "${FAKE_GATE_RC:-0}" ;;
esac
"""


def _rollout(tmp: Path, **env: str) -> tuple[int, str, str]:
    """(exit code, the fake tools' call log, the script's stderr)."""
    for name, body in (("kubectl", FAKE_KUBECTL), ("sdserve", FAKE_SDSERVE)):
        (tmp / name).write_text(body)
        (tmp / name).chmod(0o755)
    log = tmp / "log"
    env = {**os.environ, "KUBECTL": str(tmp / "kubectl"), "SDSERVE": str(tmp / "sdserve"), "LOG": str(log),
           "PORT_FORWARD_WAIT": "0", **env}
    done = subprocess.run([str(ROOT / "deploy" / "rollout.sh"), "sdserve:candidate"], capture_output=True, text=True,
                          timeout=60, env=env)
    return done.returncode, log.read_text(), done.stderr


def test_rollout_switches_traffic_when_the_gate_passes(tmp_path: Path) -> None:
    code, calls, _ = _rollout(tmp_path)
    assert code == 0
    assert "sdserve deploy render --image sdserve:candidate --color green --active blue" in calls
    assert "sdserve gate --baseline" in calls
    assert 'patch service sdserve --type merge -p {"spec":{"selector":{"sdserve/color":"green"}}}' in calls
    assert "delete deployment" not in calls


@pytest.mark.parametrize(("env", "reason", "benched"), [
    ({"FAKE_GATE_RC": "30"}, "sdserve gate found a regression -> rolling back", True),
    ({"FAKE_ROLLOUT_RC": "1"}, "the candidate never became ready", False),
])
def test_rollout_rolls_back_on_regression_or_unready(tmp_path: Path, env: dict[str, str], reason: str,
                                                     benched: bool) -> None:
    code, calls, stderr = _rollout(tmp_path, **env)
    assert code == 1
    assert reason in stderr  # the rollback names why, and it is this cause, not the other
    assert "delete deployment sdserve-green" in calls and "patch service" not in calls
    assert ("sdserve gate --baseline" in calls) is benched  # an unready candidate is never benchmarked or gated


def test_rollout_script_is_shellcheck_clean() -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "shellcheck"), str(ROOT / "deploy" / "rollout.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
