"""The blue-green rollout and the autoscaling `sdserve deploy render` emits for clusters running Argo Rollouts and
KEDA: a `Rollout` (the Deployment's pod template, blue-green between an active and a preview Service), the
`AnalysisTemplate`s that gate promotion (a Job running `sdserve bench` and `sdserve gate`; Prometheus checks on the
preview), and a KEDA `ScaledObject` on queue depth per replica. The PromQL lives here as constants, so the tests
evaluate exactly what the cluster would."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from engines.errors import InvalidRequestError
from server.tenant_config import DEFAULT_SLO_P95_S

log = logging.getLogger("sdserve")

APP = "sdserve"
ACTIVE_SERVICE = APP
PREVIEW_SERVICE = f"{APP}-preview"
GATE_TEMPLATE = f"{APP}-performance-gate"
HEALTH_TEMPLATE = f"{APP}-preview-health"
PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
"""Where the analysis and KEDA read Prometheus (the Prometheus Operator's default Service); `--prometheus` overrides."""

# The ServiceMonitor scrapes through both Services, so every series carries the `service` label of the one it came
# through: the preview's pods are exactly those behind sdserve-preview (Argo Rollouts pins each Service's selector to
# a ReplicaSet's pod-template hash).
PREVIEW = f'service="{PREVIEW_SERVICE}"'
QUEUE_QUERY = f'sum(sdserve_queue_depth{{service="{ACTIVE_SERVICE}"}}) or vector(0)'
"""KEDA's signal: requests waiting for the engine on the active replicas. The trigger's metric type is
AverageValue, so KEDA divides it by the replica count and scales toward ``threshold`` waiting requests per replica."""
ERROR_RATE_QUERY = (f'max(sum by (tenant) (rate(sdserve_tenant_requests_total{{{PREVIEW},status=~"5.."}}[1m])) / '
                    f'(sum by (tenant) (rate(sdserve_tenant_requests_total{{{PREVIEW}}}[1m])) > 0)) or vector(0)')
"""Share of the preview's responses that are 5xx, judged per tenant (the ``tenant`` label of server/metrics.py: a
configured label, ``other``, or ``default`` without auth, which is the whole server): the worst tenant's share, so
one tenant's failures are not diluted by another's traffic. 0 while no tenant has traffic or errors."""
GENERATION_ROUTES = ("/v1/images/generations|/v1/images/edits|/v1/images/variations|/sdapi/v1/txt2img|"
                     "/sdapi/v1/img2img")
_TENANT_P95 = (f'histogram_quantile(0.95, sum by (le, tenant) (rate(sdserve_tenant_request_duration_seconds_bucket'
               f'{{{PREVIEW},route=~"{GENERATION_ROUTES}"}}[1m])))')
_TENANT_SLO = f"min by (tenant) (sdserve_tenant_slo_p95_seconds{{{PREVIEW}}})"
TENANT_P95_QUERY = (f"max(({_TENANT_P95} / on (tenant) {_TENANT_SLO} or ({_TENANT_P95} unless on (tenant) "
                    f"{_TENANT_SLO}) / {DEFAULT_SLO_P95_S:g}) >= 0) or vector(0)")
"""The preview's generation p95 per tenant over its own threshold (``sdserve_tenant_slo_p95_seconds``, a tenant's
``slo.p95_s``; the strictest where pods differ), or over 30 s (DEFAULT_SLO_P95_S) for a tenant without one
(``other``; ``default`` without auth unless configured): the worst tenant's ratio, over 1 fails. ``>= 0`` drops a
tenant whose p95 is NaN (no request in the window); 0 while no tenant has traffic."""
READY_QUERY = f"min(min_over_time(sdserve_ready{{{PREVIEW}}}[1m]))"
"""1 when every preview pod's /ready stayed 200 over the last minute; a flip to 503 (degraded, failed) makes it 0.
Same signal as the SdserveNotReady alert, without its 5 minutes of patience: a candidate gets none."""
SIGNATURE_QUERY = (
    f'(sum(sdserve_degraded{{{PREVIEW},reason=~"livelock|provider_changed|output_drift|canary_invalid|latency_drift|'
    f'model_files"}}) or vector(0)) + '
    f'(sum(increase(sdserve_ort_events_total{{{PREVIEW},kind=~"cpu_fallback|provider_creation_failed|'
    f'provider_library_missing|engine_rebuild"}}[5m])) or vector(0)) + '
    f'(count(sdserve_slow{{{PREVIEW}}} == 1 and on (pod) sdserve_contention{{{PREVIEW}}} == 0) or vector(0))')
"""The fast-path signature of the shipped alerts (deploy/prometheus/alerts.yml: SdserveLivelockSignature,
SdserveSelfTestFailing, SdserveGpuFallback's provider events, SdserveEngineRebuild, SdserveSlowUncontended) on the
preview: 0 when none holds."""


def queries() -> dict[str, str]:
    """Every PromQL expression the rendered objects carry, by name (promtool and the Prometheus test read these)."""
    return {"queue_depth": QUEUE_QUERY, "error_rate": ERROR_RATE_QUERY, "tenant_p95": TENANT_P95_QUERY,
            "ready": READY_QUERY, "fast_path_signature": SIGNATURE_QUERY}


BENCH_ARGS = ("--concurrency", "1,4", "--requests", "16", "--steps", "20")
"""The canary load of the gate: bench's prompts and its fixed canary seeds (fingerprints), at two concurrencies."""


def gate_command(active_url: str = f"http://{ACTIVE_SERVICE}:80",
                 preview_url: str = f"http://{PREVIEW_SERVICE}:80") -> list[str]:
    """The gate Job's command: `sdserve deploy gate` benches the active then the preview Service with the same
    canary load and runs `sdserve gate` on the two results (exit 30 on a regression fails the Job, and the
    analysis with it)."""
    return ["sdserve", "deploy", "gate", "--active", active_url, "--preview", preview_url, *BENCH_ARGS]


def rollout(deployment: dict[str, Any], auto_promote: bool, scale_down_delay_s: int) -> dict[str, Any]:
    """The Rollout around the Deployment's pod template and selector, without the color label (Argo Rollouts tells
    the ReplicaSets apart by their pod-template hash). ``replicas`` is the start; KEDA's ScaledObject takes over. The
    Deployment's RollingUpdate strategy does not apply: blue-green replaces it."""
    spec = deployment["spec"]
    labels = {k: v for k, v in spec["selector"]["matchLabels"].items() if k != "sdserve/color"}
    template = {**spec["template"], "metadata": {**spec["template"]["metadata"], "labels": labels}}
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "Rollout",
            "metadata": {"name": APP, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"replicas": spec["replicas"], "revisionHistoryLimit": 3,
                     "selector": {"matchLabels": labels}, "template": template,
                     "strategy": {"blueGreen": {
                         "activeService": ACTIVE_SERVICE, "previewService": PREVIEW_SERVICE,
                         # Promotion waits for both analyses; a failed one aborts: traffic never moved, the
                         # preview ReplicaSet is scaled down, the active one keeps serving (the rollback).
                         "prePromotionAnalysis": {"templates": [{"templateName": GATE_TEMPLATE},
                                                                {"templateName": HEALTH_TEMPLATE}]},
                         "autoPromotionEnabled": auto_promote,
                         # The old ReplicaSet stays up this long after the switch: `kubectl argo rollouts undo`
                         # within it is instant (no cold start).
                         "scaleDownDelaySeconds": scale_down_delay_s,
                         "abortScaleDownDelaySeconds": 0}}}}


def services(ports: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    """Active and preview Services. Argo Rollouts adds the pod-template-hash to each selector when it switches."""
    return [{"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": name, "labels": {"app.kubernetes.io/name": APP}},
             "spec": {"selector": dict(labels), "ports": [dict(p) for p in ports]}}
            for name in (ACTIVE_SERVICE, PREVIEW_SERVICE)]


def gate_template(image: str, deadline_s: int) -> dict[str, Any]:
    """(a) The performance gate: one Job, run once per promotion; it fails (and the analysis with it) when bench
    cannot reach a Service or gate finds a regression."""
    env = [{"name": "SDSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "sdserve-bench-key", "key": "key",
                                                                       "optional": True}}},
           {"name": "HOME", "value": "/tmp"}]
    container = {"name": "gate", "image": image, "command": gate_command(), "env": env,
                 "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
                 "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
                                     "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
                 "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}
    job = {"backoffLimit": 0, "activeDeadlineSeconds": deadline_s,
           "template": {"spec": {"restartPolicy": "Never", "containers": [container],
                                 "volumes": [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}]}}}
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "AnalysisTemplate",
            "metadata": {"name": GATE_TEMPLATE, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"metrics": [{"name": "bench-and-gate", "count": 1, "failureLimit": 0,
                                  "provider": {"job": {"spec": job}}}]}}


def _prometheus_metric(name: str, query: str, condition: str, address: str) -> dict[str, Any]:
    # Five looks a minute apart, after a minute of traffic: a candidate must hold for five minutes; one failed
    # look aborts it. An empty or errored result counts against it too (consecutiveErrorLimit).
    return {"name": name, "initialDelay": "1m", "interval": "1m", "count": 5, "failureLimit": 0,
            "consecutiveErrorLimit": 2, "successCondition": condition,
            "provider": {"prometheus": {"address": address, "query": query}}}


CONDITIONS = {"error_rate": "result[0] <= 0.01", "tenant_p95": "result[0] <= 1", "ready": "result[0] == 1",
              "fast_path_signature": "result[0] == 0"}
"""Argo's successCondition per query (an expr over ``result``, the query's sample values)."""


def health_template(address: str) -> dict[str, Any]:
    """(b) Prometheus checks on the preview while the gate Job loads it."""
    metrics = [_prometheus_metric(name.replace("_", "-"), queries()[name], CONDITIONS[name], address)
               for name in ("error_rate", "tenant_p95", "ready", "fast_path_signature")]
    return {"apiVersion": "argoproj.io/v1alpha1", "kind": "AnalysisTemplate",
            "metadata": {"name": HEALTH_TEMPLATE, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"metrics": metrics}}


def scaled_object(target: dict[str, str], min_replicas: int, max_replicas: int, per_replica: int,
                  address: str) -> dict[str, Any]:
    """KEDA on queue depth per replica. ``min_replicas`` 0 enables scale to zero (see docs/deployment.md for what a
    cold start costs, and why the queue alone cannot wake a workload that has no pod)."""
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": APP, "labels": {"app.kubernetes.io/name": APP}},
            "spec": {"scaleTargetRef": target, "minReplicaCount": min_replicas, "maxReplicaCount": max_replicas,
                     "pollingInterval": 15,
                     # A replica takes minutes to become ready (load, verification, self-test): shrink slowly.
                     "cooldownPeriod": 600,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                         "scaleDown": {"stabilizationWindowSeconds": 300}}}},
                     "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                         "serverAddress": address, "query": QUEUE_QUERY, "threshold": str(per_replica),
                         # Above 0 waiting requests a workload at zero wakes (if anything reached a queue).
                         "activationThreshold": "0"}}]}}


# ---- `sdserve deploy gate`: what the gate Job runs ----------------------------------------------------------------

async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _forward(host: str, port: int) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


class Forwarder:
    """Loopback TCP forwarders to the two Services, in a thread of their own. `sdserve bench` only loads loopback
    targets (a load generator pointed elsewhere is an accident); the Job forwards explicitly, as the operator's
    `kubectl port-forward` did, and benches 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gate-forward")
        self.thread.start()

    def open(self, url: str) -> str:
        """A loopback URL that reaches ``url`` (scheme http)."""
        parsed = urlparse(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise InvalidRequestError(f"{url}: the gate forwards plain http://host[:port] URLs", param="url")
        server = asyncio.run_coroutine_threadsafe(_forward(parsed.hostname, parsed.port or 80), self.loop).result(30)
        port = server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def register_gate(commands: Any) -> None:
    p = commands.add_parser("gate", help="the rollout's performance gate (the analysis Job): bench the active and "
                                         "the preview Service with the canary load, then `sdserve gate`")
    p.add_argument("--active", required=True, help="URL of the active Service (the baseline)")
    p.add_argument("--preview", required=True, help="URL of the preview Service (the candidate)")
    p.add_argument("--concurrency", default="1,4", help="bench's concurrency levels")
    p.add_argument("--requests", type=int, default=16, help="bench's requests per level")
    p.add_argument("--steps", type=int, default=20, help="bench's denoising steps per request")
    p.add_argument("--out", type=Path, default=None, help="folder for baseline.json and candidate.json "
                                                          "(default: a temporary one)")
    p.add_argument("--p95-tolerance", type=float, default=0.10, help="`sdserve gate`'s allowed p95 increase")
    p.add_argument("--throughput-tolerance", type=float, default=0.10, help="`sdserve gate`'s allowed throughput "
                                                                            "drop")
    p.set_defaults(run=run_gate)


def run_gate(args: argparse.Namespace) -> int:
    """Exit code: bench's when a bench fails (the Service unreachable or not ready), else gate's (0, or 30 on a
    regression)."""
    forwarder = Forwarder()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = args.out or Path(tmp)
            out.mkdir(parents=True, exist_ok=True)
            load = ["--concurrency", args.concurrency, "--requests", str(args.requests), "--steps", str(args.steps)]
            cli = [sys.executable, "-m", "server.cli"]
            for url, name in ((args.active, "baseline"), (args.preview, "candidate")):
                log.info("gate: benchmarking %s (%s)", url, name)
                done = subprocess.run([*cli, "bench", "--url", forwarder.open(url), *load,
                                       "--out", str(out / f"{name}.json")], check=False)
                if done.returncode != 0:
                    log.error("gate: the %s benchmark of %s failed (exit %d)", name, url, done.returncode)
                    return done.returncode
            return subprocess.run([*cli, "gate", "--baseline", str(out / "baseline.json"),
                                   "--candidate", str(out / "candidate.json"),
                                   "--p95-tolerance", str(args.p95_tolerance),
                                   "--throughput-tolerance", str(args.throughput_tolerance)], check=False).returncode
    finally:
        forwarder.close()
