"""OrtEngine: the engine protocol on ONNX Runtime, with preflight against the version matrix and a capability
snapshot that says whether the fast path is really running."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engines import artifacts, selftest
from engines.config import RuntimeSettings
from engines.errors import GpuUnavailableError, NotReadyError, SelfTestError, VersionMismatchError
from engines.faults import FaultInjector
from engines.matrix import Matrix
from engines.pipeline import StableDiffusionOnnx
from engines.preflight import Check, Observations, evaluate, failures, gather
from engines.protocol import Batch, BatchResult, CanaryCheck, GeneratedImage, ModelInfo
from engines.runtime import Runtime, provider_options
from engines.schedulers import SCHEDULERS
from engines.selftest import Canary, CanarySuite, SelfTestPlan, SelfTestReport, Shape
from engines.telemetry import TelemetrySource

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1


def _describe(checks: list[Check]) -> str:
    return "; ".join(f"{c.name}: found {c.observed}, expected {c.expected} ({c.remediation})" for c in checks)


class OrtEngine:
    """One model on one device. ``generate`` runs one batch at a time (a lock), never concurrently."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings, matrix: Matrix | None = None,
                 plan: SelfTestPlan | None = None, faults: FaultInjector | None = None) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.matrix = matrix or Matrix()
        self.plan = plan
        self.faults = faults
        self._report: SelfTestReport | None = None
        self._boot_fingerprint: np.ndarray | None = None
        self._pipeline: StableDiffusionOnnx | None = None
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()
        self._observations: Observations | None = None
        self._checks: list[Check] = []
        self._self_test: dict[str, Any] = {}
        self._errors: list[str] = []
        self._artifacts: dict[str, Any] = {}

    def preflight(self) -> dict[str, Any]:
        """Check versions, provider libraries and the device against the matrix. With a GPU policy, any failure
        raises: version mismatches (exit 21) before a missing GPU path (exit 20)."""
        self._observations = gather()
        self._checks = evaluate(self._observations, self.matrix, self.settings)
        gpu, versions = failures(self._checks)
        for check in self._checks:
            if check.status == "fail":
                log.error("preflight %s: found %s, expected %s", check.name, check.observed, check.expected)
        if versions:
            raise VersionMismatchError("version matrix mismatch: " + _describe(versions))
        if gpu:
            raise GpuUnavailableError("GPU path unavailable: " + _describe(gpu))
        return {"checks": [c.as_dict() for c in self._checks]}

    def load(self) -> None:
        """Verify artifacts, then build every session under the policy."""
        try:
            sources = self._verify_artifacts()
            self._runtime = Runtime(self.settings, self.model_dir)
            self._pipeline = StableDiffusionOnnx(self.model_dir, self._runtime, sources)
        except NotReadyError as exc:
            self._errors.append(str(exc))
            raise
        if self.settings.allow_cpu:
            log.warning("CPU execution allowed by the profile: this server is NOT accelerated")

    def _verify_artifacts(self) -> dict[str, Path]:
        """The model folder against its manifest; with TensorRT in the policy, the prebuilt engines against this
        node. Returns the EP-context models to load instead of the plain ONNX files."""
        artifacts.verify_model(self.model_dir, self.settings.verify)
        self._artifacts = {"model_manifest": f"verified ({self.settings.verify})"}
        trt = self.model_dir / artifacts.TRT_DIR
        if "TensorrtExecutionProvider" not in self.settings.providers:
            return {}
        if not (trt / "manifest.json").is_file():
            if self.settings.tensorrt.require_engines:
                raise artifacts.ArtifactError(
                    f"no prebuilt TensorRT engines in {trt}: build them with `sdserve engines build` on a node with "
                    "the deployed versions (the server never builds engines in production)")
            log.warning("no prebuilt TensorRT engines in %s: TensorRT may build them on this node (slow boot)", trt)
            return {}
        live = artifacts.node_identity(self._observations.as_dict() if self._observations else {},
                                       self.settings.device_id)
        self._artifacts["engines"] = artifacts.verify_engines(self.model_dir, live, self.settings.verify)
        return {c: trt / f"{c}_ctx.onnx" for c in ("text_encoder", "unet", "vae_decoder")
                if (trt / f"{c}_ctx.onnx").is_file()}

    @property
    def pipeline(self) -> StableDiffusionOnnx:
        if self._pipeline is None:
            raise NotReadyError("model not loaded")
        return self._pipeline

    @property
    def info(self) -> ModelInfo:
        p = self.pipeline
        return ModelInfo(self.model_dir.name, p.size_multiple, p.default_size, tuple(SCHEDULERS),
                         p.tokenizer.max_length, self._digest())

    def _digest(self) -> str:
        manifest = self.model_dir / "manifest.json"
        if not manifest.is_file():
            return ""
        files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
        return str(files.get("unet/model.onnx", ""))

    def resolved_plan(self) -> SelfTestPlan:
        """The configured plan (or one built-in canary), with no shapes meaning the model's native size."""
        size = self.pipeline.default_size
        plan = self.plan or SelfTestPlan(
            CanarySuite(canary=(Canary(name="default", prompt="a canary in a coal mine", seed=1234),)), (), ())
        if plan.shapes:
            return plan
        return dataclasses.replace(plan, shapes=tuple(Shape(size, size, b) for b in plan.batch_sizes))

    def _telemetry(self) -> TelemetrySource | None:
        if self.settings.device != "cuda":
            return None
        from engines.telemetry import NvmlTelemetry

        return NvmlTelemetry()

    def self_test(self) -> dict[str, Any]:
        """Canaries at every served shape: sanity, fingerprints, SLO windows (engines/selftest.py)."""
        plan = self.resolved_plan()
        try:
            self._report = selftest.run(plan, self.generate, self.model_dir, self._telemetry(),
                                        self.settings.device_id)
        except SelfTestError as exc:
            if isinstance(exc.report, SelfTestReport):
                self._report = exc.report
            self._errors.append(str(exc))
            raise
        first = plan.shapes[0]
        self._boot_fingerprint = selftest.fingerprint(np.asarray(self.generate(plan.suite.batch(
            Shape(first.width, first.height, 1))).images[0].image))
        self._self_test = self._report.as_dict()
        return self._self_test

    def record_fingerprints(self) -> Path:
        return selftest.record(self.resolved_plan(), self.generate, self.model_dir)

    def canary(self) -> CanaryCheck:
        """One batch-1 canary at the first served shape, against the boot baseline latency and output."""
        plan = self.resolved_plan()
        first = plan.shapes[0]
        shape = Shape(first.width, first.height, 1)
        start = time.perf_counter()
        result = self.generate(plan.suite.batch(shape))
        seconds = time.perf_counter() - start
        image = np.asarray(result.images[0].image)
        baseline = next((r.p50_s / first.batch for r in (self._report.shapes if self._report else [])
                         if r.shape == first.key), seconds)
        distance = (float(np.abs(selftest.fingerprint(image) - self._boot_fingerprint).max())
                    if self._boot_fingerprint is not None else 0.0)
        problem = selftest.sanity(image)
        return CanaryCheck(shape.key, seconds, baseline, distance, plan.tolerance, problem)

    def generate(self, batch: Batch) -> BatchResult:
        pipeline = self.pipeline
        with self._lock:
            images, truncated, timings = pipeline(batch)
            if self.faults is not None and self.faults.latency_s > 0:
                time.sleep(self.faults.latency_s)
        out = tuple(GeneratedImage(Image.fromarray(img), spec.seed, trunc)
                    for img, spec, trunc in zip(images, batch.images, truncated, strict=True))
        return BatchResult(out, self.provider, timings)

    @property
    def provider(self) -> str:
        return str(self.pipeline.unet.session.get_providers()[0])

    def prompt_overflows(self, texts: list[str]) -> list[bool]:
        return list(self.pipeline.tokenizer(texts).truncated)

    def check_health(self) -> None:
        self.pipeline  # noqa: B018 - raises NotReadyError when not loaded

    def _accelerated(self) -> bool:
        if self.settings.device != "cuda" or self._pipeline is None or self._runtime is None:
            return False
        reports = self._runtime.reports.values()
        return (all(c.status != "fail" for c in self._checks) and bool(self._checks)
                and all(r.providers_used[:1] and r.providers_used[0] != "CPUExecutionProvider" for r in reports)
                and all(r.placement is None or r.placement.ok for r in reports))

    def capabilities(self) -> dict[str, Any]:
        """The capability snapshot (schema: engines/schemas/capabilities.schema.json)."""
        accelerated = self._accelerated()
        reports = self._runtime.reports if self._runtime else {}
        failed = [c for c in self._checks if c.status == "fail"]
        reasons = [f"{c.name}: found {c.observed}, expected {c.expected}" for c in failed] + self._errors
        if self.settings.allow_cpu:
            reasons.insert(0, "CPU allowed by the profile (dev): not accelerated")
        status = "pass" if accelerated else ("cpu-dev" if self.settings.allow_cpu and not failed and
                                            not self._errors else "fail")
        return {
            "schema_version": SCHEMA_VERSION,
            "generated_at": datetime.datetime.now(datetime.UTC).isoformat(),
            "accelerated": accelerated,
            "verdict": {"status": status, "reasons": reasons},
            "device": self.settings.device,
            "device_id": self.settings.device_id,
            "model": str(self.model_dir),
            "policy": {"providers": list(self.settings.providers), "allow_cpu": self.settings.allow_cpu,
                       "enable_fallback": self.settings.allow_cpu,
                       "disable_cpu_ep_fallback": self.settings.disable_cpu_ep_fallback,
                       "placement_audit": self.settings.placement_audit,
                       "cpu_allowlist": list(self.settings.cpu_allowlist)},
            "provider_options": {name: opts for name, opts in provider_options(self.settings, self.model_dir)},
            "checks": [c.as_dict() for c in self._checks],
            "observations": self._observations.as_dict() if self._observations else {},
            "sessions": {name: r.as_dict() for name, r in reports.items()},
            "placement_summary": {name: {"nodes_by_provider": r.placement.nodes_by_provider,
                                         "compute_on_cpu": r.placement.compute_on_cpu, "ok": r.placement.ok}
                                  for name, r in reports.items() if r.placement is not None},
            "io": {"binding": "iobinding", "device": self.settings.device,
                   "host_staging": self._runtime.host.kind if self._runtime else "none",
                   "buffers_reused_per_shape": True},
            "arena": self.settings.cuda.model_dump(),
            "artifacts": self._artifacts,
            "attention": self._attention(reports),
            "self_test": self._self_test,
        }

    @staticmethod
    def _attention(reports: dict[str, Any]) -> dict[str, Any]:
        """Whether attention is fused (fused attention ops present) and where those ops run."""
        fused: dict[str, dict[str, int]] = {}
        for name, report in reports.items():
            if report.placement is not None and report.placement.attention:
                fused[name] = report.placement.attention
        on_gpu = bool(fused) and all(p != "CPUExecutionProvider" for f in fused.values() for p in f)
        return {"fused": bool(fused), "on_gpu": on_gpu, "by_session": fused}

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        self._pipeline = None
        self._runtime = None
