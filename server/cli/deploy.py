"""`sdserve deploy render`: Kubernetes manifests and the Grafana dashboard, rendered from the version matrix and a
profile, so the cluster schedules only onto nodes the matrix accepts and the probes match the server's truth."""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import yaml

from engines.config import Matrix, version_tuple
from engines.errors import ConfigError
from server.bootstrap import settings_matrix
from server.cli import imagelock, imagerecord, rollout
from server.settings import Settings, load_settings

log = logging.getLogger("sdserve")

APP = "sdserve"
PORT = 8000
UID = 10001


def _labels(color: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/component": "inference", "sdserve/color": color}


def _affinity(matrix: Matrix) -> dict[str, Any]:
    """GPU Feature Discovery labels: driver major at least the matrix minimum, compute major in the allowed set."""
    min_major = version_tuple(matrix.driver.min_version)[0]
    majors = sorted({cc.split(".")[0] for cc in matrix.device.compute_capabilities}, key=int)
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
        "matchExpressions": [
            {"key": "nvidia.com/cuda.driver-version.major", "operator": "Gt", "values": [str(min_major - 1)]},
            {"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": majors},
            {"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]},
        ]}]}}}


PROVENANCE_SECRET = "sdserve-provenance"
PROVENANCE_DIR = "/run/secrets/sdserve-provenance"
PROVENANCE_ENV = [
    {"name": "SDSERVE_PROVENANCE_KEY_FILE", "value": f"{PROVENANCE_DIR}/signer.key"},
    {"name": "SDSERVE_PROVENANCE_CHAIN_FILE", "value": f"{PROVENANCE_DIR}/chain.pem"},
    {"name": "SDSERVE_PROVENANCE_MODE", "valueFrom": {"secretKeyRef": {"name": PROVENANCE_SECRET, "key": "mode",
                                                                       "optional": True}}}]
"""C2PA signing (docs/provenance.md): the optional Secret ``sdserve-provenance`` holds the operator's key
(``signer.key``), chain (``chain.pem``) and ``mode`` (``require``: fail closed). Without it the profile's mode
applies (off)."""


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def deployment(settings: Settings, matrix: Matrix, image: str, color: str, startup_budget_s: int,
               replicas: int) -> dict[str, Any]:
    startup = _probe("/ready", 10, math.ceil(startup_budget_s / 10))
    container = {
        "name": APP, "image": image, "imagePullPolicy": "IfNotPresent",
        "args": ["--profile", settings.profile, "--model", "/models/model", "--port", str(PORT)],
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [{"name": "SDSERVE_API_KEYS_SHA256", "valueFrom": {"secretKeyRef": {
            "name": "sdserve-api-keys", "key": "sha256", "optional": True}}}, *PROVENANCE_ENV],
        "startupProbe": startup, "readinessProbe": _probe("/ready", 5, 1), "livenessProbe": _probe("/health", 10, 3),
        "resources": {"requests": {"cpu": "4", "memory": "24Gi", "nvidia.com/gpu": "1"},
                      "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "provenance", "mountPath": PROVENANCE_DIR, "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": f"{APP}-{color}", "labels": _labels(color)},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": _labels(color)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": _labels(color), "annotations": {
                "sdserve/matrix-onnxruntime": matrix.onnxruntime.version,
                "sdserve/matrix-tensorrt": _tensorrt(settings, matrix)}},
                "spec": {
                    "runtimeClassName": "nvidia", "affinity": _affinity(matrix),
                    # Above the drain timeout: SIGTERM drains queued work before the kubelet's SIGKILL.
                    "terminationGracePeriodSeconds": int(settings.queue.drain_timeout_s) + 30,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [container],
                    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "sdserve-models",
                                                                            "readOnly": True}},
                                {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                                {"name": "provenance", "secret": {"secretName": PROVENANCE_SECRET, "optional": True,
                                                                  "defaultMode": 0o440}}]}}}}


def _tensorrt(settings: Settings, matrix: Matrix) -> str:
    """The TensorRT major the pod's image must carry, or why it needs none (the cuda profile: CUDA provider alone,
    docs/deployment.md#cuda-or-tensorrt)."""
    if "TensorrtExecutionProvider" in settings.runtime.providers:
        return matrix.tensorrt.version
    return f"absent by design ({settings.profile} profile)"


DEV_IMAGE = "sdserve:0.1.0-notrt"
HEALTHCHECK = ["python", "/opt/sdserve/healthcheck.py"]


def dev_overlay(deploy: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The Deployment for a laptop or a CI machine (`podman kube play`): the dev profile on the CPU, one replica,
    the -notrt image, no GPU scheduling. Probes are the image's healthcheck run in the container (same /ready and
    /health semantics): podman turns an httpGet probe into `curl` inside the container, and the image has no curl.
    Storage and the securityContext stay exactly as in production."""
    dev: dict[str, Any] = json.loads(json.dumps(deploy))
    dev["metadata"]["name"] = f"{APP}-dev"
    spec = dev["spec"]
    spec["replicas"] = 1
    pod = spec["template"]["spec"]
    for key in ("runtimeClassName", "affinity", "tolerations"):
        pod.pop(key)
    pod["terminationGracePeriodSeconds"] = int(settings.queue.drain_timeout_s) + 30
    c = pod["containers"][0]
    c["image"] = DEV_IMAGE
    c["args"] = ["--profile", "dev", "--model", "/models/model", "--port", str(PORT)]
    c["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    for name, probe in (("startupProbe", c["startupProbe"]), ("readinessProbe", c["readinessProbe"])):
        c[name] = {**{k: v for k, v in probe.items() if k != "httpGet"}, "exec": {"command": list(HEALTHCHECK)}}
    c["livenessProbe"] = {**{k: v for k, v in c["livenessProbe"].items() if k != "httpGet"},
                          "exec": {"command": [*HEALTHCHECK, "/health"]}}
    return dev


def service(active: str) -> dict[str, Any]:
    selector = {k: v for k, v in _labels(active).items()}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": APP, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"selector": selector, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


def pdb(color: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": f"{APP}-{color}"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _labels(color)}}}


def service_monitor() -> dict[str, Any]:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": APP, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": APP}},
                     "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}


KINDS = ("rollout", "deployment")


def pdb_for(labels: dict[str, str], name: str) -> dict[str, Any]:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(labels)}}}


def render(settings: Settings, matrix: Matrix, image: str, color: str = "blue", active: str = "blue",
           startup_budget_s: int = 900, replicas: int = 2, kind: str = "rollout", min_replicas: int = 1,
           max_replicas: int = 8, prometheus: str = rollout.PROMETHEUS, auto_promote: bool = True,
           scale_down_delay_s: int = 600) -> dict[str, list[dict[str, Any]]]:
    """File name -> manifests (dev/deployment.yaml: the dev overlay of the Deployment).

    ``kind`` "rollout" (Argo Rollouts): a Rollout with the Deployment's pod template, active and preview Services,
    the promotion AnalysisTemplates, a KEDA ScaledObject on the Rollout. "deployment": the plain Deployment of
    ``color`` behind one Service selecting ``active`` (clusters without Argo Rollouts), scaled by the same
    ScaledObject. Both: a PodDisruptionBudget, the ServiceMonitor, the dev overlay."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    deploy = deployment(settings, matrix, image, color, startup_budget_s, replicas)
    per_replica = max(1, settings.queue.max_batch)  # one full batch waiting per replica
    common = {"servicemonitor.yaml": [service_monitor()],
              "dev/deployment.yaml": [dev_overlay(deploy, load_settings("dev", None))]}
    if kind == "deployment":
        target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deploy["metadata"]["name"]}
        return {"deployment.yaml": [deploy], "service.yaml": [service(active)], "pdb.yaml": [pdb(color)],
                "scaledobject.yaml": [rollout.scaled_object(target, min_replicas, max_replicas, per_replica,
                                                            prometheus)], **common}
    ro = rollout.rollout(deploy, auto_promote, scale_down_delay_s)
    labels = ro["spec"]["selector"]["matchLabels"]
    target = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout", "name": ro["metadata"]["name"]}
    return {"rollout.yaml": [ro], "service.yaml": rollout.services(service(active)["spec"]["ports"], labels),
            # The gate Job's deadline: the same bound as a replica's boot (two benchmarks of warm servers fit in it).
            "analysis.yaml": [rollout.gate_template(image, startup_budget_s), rollout.health_template(prometheus)],
            "scaledobject.yaml": [rollout.scaled_object(target, min_replicas, max_replicas, per_replica,
                                                        prometheus)],
            "pdb.yaml": [pdb_for(labels, APP)], **common}


def _panel(pid: int, title: str, exprs: list[tuple[str, str]], unit: str, x: int, y: int) -> dict[str, Any]:
    targets = [{"refId": chr(65 + i), "expr": e, "legendFormat": legend} for i, (e, legend) in enumerate(exprs)]
    return {"id": pid, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"}, "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "targets": targets}


def dashboard() -> dict[str, Any]:
    rate = "sum by (le) (rate(sdserve_request_duration_seconds_bucket{route=\"/v1/images/generations\"}[5m]))"
    panels = [
        _panel(1, "Latency p50 / p95", [(f"histogram_quantile(0.5, {rate})", "p50"),
                                        (f"histogram_quantile(0.95, {rate})", "p95")], "s", 0, 0),
        _panel(2, "Images per minute", [("sum(rate(sdserve_images_generated_total[5m])) * 60", "images/min")],
               "short", 12, 0),
        _panel(3, "Queue depth", [("sum by (pod) (sdserve_queue_depth)", "{{pod}}")], "short", 0, 8),
        _panel(4, "Readiness and degradation reasons", [("sum by (pod) (sdserve_ready)", "ready {{pod}}"),
                                                        ("sum by (reason) (sdserve_degraded) > 0", "{{reason}}")],
               "short", 12, 8),
        _panel(5, "GPU SM utilization", [("sdserve_gpu_sm_utilization_percent", "{{pod}} gpu {{gpu}}")],
               "percent", 0, 16),
        _panel(6, "GPU memory-controller utilization",
               [("sdserve_gpu_memory_controller_utilization_percent", "{{pod}} gpu {{gpu}}")], "percent", 12, 16),
        _panel(7, "GPU power", [("sdserve_gpu_power_watts", "{{pod}} gpu {{gpu}}")], "watt", 0, 24),
        _panel(8, "429 and 5xx per second", [
            ("sum(rate(sdserve_requests_total{status=\"429\"}[5m]))", "429"),
            ("sum(rate(sdserve_requests_total{status=~\"5..\"}[5m]))", "5xx")], "reqps", 12, 24),
    ]
    return {"title": "sdserve", "uid": "sdserve-overview", "schemaVersion": 39, "version": 1, "editable": True,
            "tags": ["sdserve", "gpu", "inference"], "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
            "timezone": "utc", "panels": panels, "annotations": {"list": []},
            "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                     "label": "Prometheus"}]}}


def write(out: Path, rendered: dict[str, list[dict[str, Any]]]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs in rendered.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        header = "# Rendered by `sdserve deploy render` from configs/ and the version matrix. Do not edit by hand.\n"
        path.write_text(header + yaml.safe_dump_all(docs, sort_keys=True), encoding="utf-8")
        written.append(path)
    return written


def write_dashboard(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dashboard(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def register(sub: Any) -> None:
    deploy = sub.add_parser("deploy", help="render Kubernetes manifests and the Grafana dashboard; lock the image; "
                                           "run the rollout's performance gate")
    commands = deploy.add_subparsers(dest="deploy_cmd", required=True)
    register_lock(commands)
    register_record(commands)
    rollout.register_gate(commands)
    p = commands.add_parser("render")
    p.add_argument("--profile", choices=["dev", "production", "cuda"], default="production",
                   help="production: TensorRT engines (a fixed size set, the last 5-30%%); cuda: the CUDA provider "
                        "alone (many sizes or LoRA sets, frequent model changes, an image without TensorRT): "
                        "docs/deployment.md#cuda-or-tensorrt")
    p.add_argument("--config", type=Path, default=None)
    p.add_argument("--matrix", type=Path, default=None)
    p.add_argument("--image", default="sdserve:0.1.0")
    p.add_argument("--kind", choices=list(KINDS), default="rollout",
                   help="rollout: an Argo Rollouts blue-green Rollout with its analyses; deployment: a plain "
                        "Deployment and Service (clusters without Argo Rollouts)")
    p.add_argument("--color", default="blue", help="--kind deployment: this deployment's blue-green color")
    p.add_argument("--active", default="blue", help="--kind deployment: the color the Service sends traffic to")
    p.add_argument("--min-replicas", type=int, default=1,
                   help="KEDA's minReplicaCount; 0 scales to zero when idle (a cold start: docs/deployment.md)")
    p.add_argument("--max-replicas", type=int, default=8, help="KEDA's maxReplicaCount")
    p.add_argument("--prometheus", default=rollout.PROMETHEUS,
                   help="Prometheus URL the analyses and KEDA query")
    p.add_argument("--manual-promotion", action="store_true",
                   help="the Rollout waits for `kubectl argo rollouts promote` after its analyses pass")
    p.add_argument("--scale-down-delay-s", type=int, default=600,
                   help="how long the old color keeps running after promotion (instant undo)")
    p.add_argument("--startup-budget-s", type=int, default=900, help="boot + self-test budget of the probe")
    p.add_argument("--out", type=Path, default=Path("deploy/k8s"))
    p.add_argument("--dashboard", type=Path, default=Path("deploy/grafana/sdserve.json"))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.profile, args.config)
    if not 0 <= args.min_replicas <= args.max_replicas or args.max_replicas < 1:
        raise ConfigError("need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1")
    rendered = render(settings, settings_matrix(settings, args.matrix), args.image, args.color, args.active,
                      args.startup_budget_s, kind=args.kind, min_replicas=args.min_replicas,
                      max_replicas=args.max_replicas, prometheus=args.prometheus,
                      auto_promote=not args.manual_promotion, scale_down_delay_s=args.scale_down_delay_s)
    for path in [*write(args.out, rendered), write_dashboard(args.dashboard)]:
        log.info("wrote %s", path)
    return 0


def register_lock(commands: Any) -> None:
    p = commands.add_parser("lock", help="resolve the image's runtime closure from the matrix and freeze it with "
                                         "hashes (deploy/image/*.lock)")
    p.add_argument("--matrix", type=Path, default=None)
    p.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    p.add_argument("--out", type=Path, default=imagelock.LOCK_DIR)
    p.add_argument("--cert", default=None, help="TLS bundle pip trusts (default: pip's own)")
    p.add_argument("--tensorrt-index", default=None,
                   help="NVIDIA's Python package index: also lock the TensorRT libraries from it")
    p.set_defaults(run=run_lock)


def run_lock(args: argparse.Namespace) -> int:
    matrix = settings_matrix(load_settings("production", None), args.matrix)
    for path in imagelock.write_locks(args.out, args.pyproject, matrix, args.cert, args.tensorrt_index):
        log.info("wrote %s", path)
    return 0


def register_record(commands: Any) -> None:
    p = commands.add_parser("record", help="the content record of a built image: digest, pip freeze, file-list "
                                           "digest, doctor snapshot of a boot inside it")
    p.add_argument("--engine", default="podman", help="docker or podman")
    p.add_argument("--image", required=True)
    p.add_argument("--model", type=Path, default=Path("models/tiny"), help="model folder the doctor boot mounts")
    p.add_argument("--run-flags", default="", help="extra flags for `ENGINE run` (e.g. podman's --runtime)")
    p.add_argument("--profile", choices=["dev", "production", "cuda"], default="dev",
                   help="profile of the doctor boot (production or cuda on a GPU node, with the engine's GPU "
                        "flags)")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(run=run_record)


def run_record(args: argparse.Namespace) -> int:
    record = imagerecord.build(args.engine, args.image, args.model, args.run_flags.split(), args.profile)
    log.info("wrote %s (image %s, %d packages, doctor exit %s)", imagerecord.write(args.out, record),
             record["digest"] or record["id"], len(record["freeze"]), record["doctor"]["exit_code"]["code"])
    return 0
