"""OrtEngine: the engine protocol on ONNX Runtime, with preflight against the version matrix and a capability
snapshot that says whether the fast path is really running."""

from __future__ import annotations

import datetime
import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engines.config import RuntimeSettings
from engines.errors import GpuUnavailableError, NotReadyError, SelfTestError, VersionMismatchError
from engines.matrix import Matrix
from engines.pipeline import StableDiffusionOnnx
from engines.preflight import Check, Observations, evaluate, failures, gather
from engines.protocol import Batch, BatchResult, GeneratedImage, ImageSpec, ModelInfo
from engines.runtime import Runtime, provider_options
from engines.schedulers import SCHEDULERS

log = logging.getLogger(__name__)
SCHEMA_VERSION = 1


def _describe(checks: list[Check]) -> str:
    return "; ".join(f"{c.name}: found {c.observed}, expected {c.expected} ({c.remediation})" for c in checks)


class OrtEngine:
    """One model on one device. ``generate`` runs one batch at a time (a lock), never concurrently."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings, matrix: Matrix | None = None) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self.matrix = matrix or Matrix()
        self._pipeline: StableDiffusionOnnx | None = None
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()
        self._observations: Observations | None = None
        self._checks: list[Check] = []
        self._self_test: dict[str, Any] = {}
        self._errors: list[str] = []

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
        self._runtime = Runtime(self.settings, self.model_dir)
        try:
            self._pipeline = StableDiffusionOnnx(self.model_dir, self._runtime)
        except NotReadyError as exc:
            self._errors.append(str(exc))
            raise
        if self.settings.allow_cpu:
            log.warning("CPU execution allowed by the profile: this server is NOT accelerated")

    @property
    def pipeline(self) -> StableDiffusionOnnx:
        if self._pipeline is None:
            raise NotReadyError("model not loaded")
        return self._pipeline

    @property
    def info(self) -> ModelInfo:
        p = self.pipeline
        return ModelInfo(self.model_dir.name, p.size_multiple, p.default_size, tuple(SCHEDULERS),
                         p.tokenizer.max_length)

    def self_test(self) -> dict[str, Any]:
        """A canary at the model's default size: finite, not constant. (Fingerprints and SLOs come later.)"""
        size = self.pipeline.default_size
        result = self.generate(Batch((ImageSpec("a canary in a coal mine", seed=1234),), size, size, 4, "euler"))
        pixels = np.asarray(result.images[0].image, dtype=np.float32)
        if not np.isfinite(pixels).all() or float(pixels.std()) < 1.0:
            raise SelfTestError(f"canary image is constant or invalid (std {float(pixels.std()):.3f})")
        self._self_test = {"canary_seconds": result.timings.get("total"), "canary_std": float(pixels.std())}
        return self._self_test

    def generate(self, batch: Batch) -> BatchResult:
        pipeline = self.pipeline
        with self._lock:
            images, truncated, timings = pipeline(batch)
        out = tuple(GeneratedImage(Image.fromarray(img), spec.seed, trunc)
                    for img, spec, trunc in zip(images, batch.images, truncated, strict=True))
        return BatchResult(out, self.provider, timings)

    @property
    def provider(self) -> str:
        return str(self.pipeline.unet.session.get_providers()[0])

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
            "self_test": self._self_test,
        }

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        self._pipeline = None
        self._runtime = None
