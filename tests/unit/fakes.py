"""A fake engine behind the engine protocol, for HTTP-layer unit tests only."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
from PIL import Image

from engines.errors import GpuUnavailableError, NotReadyError
from engines.protocol import Batch, BatchResult, CanaryCheck, GeneratedImage, ImageSpec, ModelInfo
from engines.schedulers import SCHEDULERS


class FakeEngine:
    def __init__(self, fail_load: Exception | None = None, load_gate: threading.Event | None = None) -> None:
        self.fail_load = fail_load
        self.load_gate = load_gate
        self.loaded = False
        self.batches: list[Batch] = []
        self.closed = False
        self.latency_s = 0.0

    def preflight(self) -> dict[str, Any]:
        return {"fake": True}

    def load(self) -> None:
        if self.load_gate is not None:
            self.load_gate.wait(10)
        if self.fail_load is not None:
            raise self.fail_load
        self.loaded = True

    def self_test(self) -> dict[str, Any]:
        return {"ok": True}

    def generate(self, batch: Batch) -> BatchResult:
        if not self.loaded:
            raise NotReadyError("not loaded")
        self.batches.append(batch)
        images = []
        for spec in batch.images:
            pixels = np.random.default_rng(spec.seed).integers(0, 256, (batch.height, batch.width, 3), np.uint8)
            images.append(GeneratedImage(Image.fromarray(pixels), spec.seed))
        return BatchResult(tuple(images), "FakeExecutionProvider", {"total": 0.001})

    def canary(self) -> CanaryCheck:
        self.generate(Batch((ImageSpec("canary", seed=1),), 64, 64, 2))
        return CanaryCheck("64x64x1", 0.01 + self.latency_s, 0.01, 0.0, 4.0)

    def prompt_overflows(self, texts: list[str]) -> list[bool]:
        return [len(t.split()) > 75 for t in texts]

    def check_health(self) -> None:
        if not self.loaded:
            raise NotReadyError("not loaded")

    def capabilities(self) -> dict[str, Any]:
        return {"accelerated": False, "sessions": {}, "verdict": {"status": "cpu-dev", "reasons": ["fake"]}}

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake", 16, 64, tuple(SCHEDULERS), 77)

    def close(self) -> None:
        self.closed = True


GPU_MISSING = GpuUnavailableError("unet: cannot create a session: libcublasLt.so.13 missing")
