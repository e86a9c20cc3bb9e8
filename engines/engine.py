"""OrtEngine: the engine protocol on ONNX Runtime."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from engines.config import RuntimeSettings
from engines.errors import NotReadyError, SelfTestError
from engines.pipeline import StableDiffusionOnnx
from engines.protocol import Batch, BatchResult, GeneratedImage, ImageSpec, ModelInfo
from engines.runtime import Runtime
from engines.schedulers import SCHEDULERS

log = logging.getLogger(__name__)


class OrtEngine:
    """One model on one device. ``generate`` runs one batch at a time (a lock), never concurrently."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings) -> None:
        self.model_dir = model_dir
        self.settings = settings
        self._pipeline: StableDiffusionOnnx | None = None
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()
        self._self_test: dict[str, Any] = {}

    def preflight(self) -> dict[str, Any]:
        return {"onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}

    def load(self) -> None:
        self._runtime = Runtime(self.settings, self.model_dir)
        self._pipeline = StableDiffusionOnnx(self.model_dir, self._runtime)
        if not self.settings.allow_cpu:
            return
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

    def capabilities(self) -> dict[str, Any]:
        sessions = {}
        if self._pipeline is not None:
            p = self._pipeline
            for model in (p.text_encoder, p.unet, p.vae_decoder, p.step):
                sessions[model.name] = model.session.get_providers()
        return {"accelerated": self.settings.device == "cuda" and bool(sessions),
                "device": self.settings.device, "providers_policy": list(self.settings.providers),
                "sessions": sessions, "preflight": self.preflight(), "self_test": self._self_test}

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        self._pipeline = None
        self._runtime = None
