"""A fake engine behind the engine protocol, for HTTP-layer unit tests only."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.errors import GpuUnavailableError, NotReadyError
from engines.health.signature import classify
from engines.protocol import (
    Artifacts,
    Attention,
    Batch,
    BatchResult,
    CanaryCheck,
    Capabilities,
    CheckResult,
    GeneratedImage,
    GpuSample,
    ImageSpec,
    IoInfo,
    LoraInfo,
    LoraStats,
    LoraUse,
    ModelInfo,
    OrtEvent,
    Policy,
    SelfTestReport,
    Signature,
    StepHook,
    TelemetrySource,
    Timings,
    Verdict,
    lora_key,
)
from server.app import create_app
from server.settings import Settings


class FakeEngine:
    def __init__(self, fail_load: Exception | None = None, load_gate: threading.Event | None = None) -> None:
        self.fail_load = fail_load
        self.load_gate = load_gate
        self.loaded = False
        self.batches: list[Batch] = []
        self.closed = False
        self.latency_s = 0.0
        self.drift_distance = 0.0
        """Fingerprint distance the canary reports (tolerance 4.0): > 4 is output drift."""
        self.canary_problem: str | None = None
        self.canary_error: Exception | None = None
        """Raised by the next canaries (e.g. the pipeline refusing NaN output)."""
        self.pending_events: list[OrtEvent] = []
        """ORT log events the next ``ort_events()`` call returns (then forgets, like the engine's tee)."""
        self.provider = "FakeExecutionProvider"
        """The provider the fake says ran each batch."""
        self.library: tuple[LoraInfo, ...] = ()
        """The LoRA files the fake lists (the server resolves request names against them)."""
        self.merge_s = 0.0
        """What an adapter set not in ``cached`` costs at admission."""
        self.cached: set[tuple[tuple[str, float, float], ...]] = set()

    def preflight(self) -> tuple[CheckResult, ...]:
        return ()

    def load(self) -> None:
        if self.load_gate is not None:
            self.load_gate.wait(10)
        if self.fail_load is not None:
            raise self.fail_load
        self.loaded = True

    def self_test(self) -> SelfTestReport:
        return SelfTestReport(passed=True, shapes=(), fingerprints="not recorded", seconds=0.0)

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        if not self.loaded:
            raise NotReadyError("not loaded")
        self.batches.append(batch)
        done = batch.steps
        for step in range(1, batch.steps + 1):  # the protocol's step boundaries, as the real pipeline calls them
            if on_step is not None and not on_step(step, batch.steps) and step < batch.steps:
                done = step
                break
        images = []
        for spec in batch.images:
            pixels = np.random.default_rng(spec.seed).integers(0, 256, (batch.height, batch.width, 3), np.uint8)
            images.append(GeneratedImage(Image.fromarray(pixels), spec.seed))
        return BatchResult(tuple(images), self.provider, Timings(total=0.001), len(images), done,
                           done < batch.steps)

    def canary(self) -> CanaryCheck:
        if self.canary_error is not None:
            raise self.canary_error
        result = self.generate(Batch((ImageSpec("canary", seed=1),), 64, 64, 2))
        return CanaryCheck("64x64x1", 0.01 + self.latency_s, 0.01, self.drift_distance, 4.0, self.canary_problem,
                           2, result.provider)

    def record_fingerprints(self) -> Path:
        raise NotImplementedError("the fake records nothing")

    def check_health(self) -> None:
        if not self.loaded:
            raise NotReadyError("not loaded")

    def capabilities(self) -> Capabilities:
        return Capabilities(
            generated_at="2026-01-01T00:00:00+00:00", accelerated=False,
            verdict=Verdict(status="cpu-dev", reasons=("fake",)), device="cpu", device_id=0, model="fake",
            policy=Policy(providers=("CPUExecutionProvider",), allow_cpu=True, enable_fallback=True,
                          disable_cpu_ep_fallback=False, placement_audit=False, cpu_allowlist=()),
            provider_options={}, checks=(), observations=None, sessions={}, placement_summary={},
            io=IoInfo(binding="fake", device="cpu", host_staging="none", buffers_reused_per_shape=False),
            arena={}, artifacts=Artifacts(), attention=Attention(fused=False, on_gpu=False, by_session={}),
            self_test=None)

    def telemetry(self) -> TelemetrySource | None:
        return None

    def signature(self, samples: list[GpuSample], requests_running: bool) -> Signature:
        return classify(samples, requests_running)  # the real classifier: the watchdog's verdicts depend on it

    def ort_events(self) -> list[OrtEvent]:
        events, self.pending_events = self.pending_events, []
        return events

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77)

    def loras(self) -> tuple[LoraInfo, ...]:
        return self.library

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        return self.library

    def lora_cost_s(self, uses: tuple[LoraUse, ...]) -> float:
        return 0.0 if not uses or lora_key(uses) in self.cached else self.merge_s

    def lora_stats(self) -> LoraStats:
        return LoraStats()

    def close(self) -> None:
        self.closed = True


GPU_MISSING = GpuUnavailableError("unet: cannot create a session: libcublasLt.so.13 missing")


DIGEST = "ab" * 32
TITLE = f"fake [{DIGEST[:10]}]"


class HashedEngine(FakeEngine):
    """The fake with a manifest digest; like OrtEngine, ``info`` raises until the model is loaded."""

    def __init__(self, load_gate: threading.Event | None = None) -> None:
        super().__init__(load_gate=load_gate)
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()

    @property
    def info(self) -> ModelInfo:
        if not self.loaded:
            raise NotReadyError("model not loaded")
        return ModelInfo("fake", 16, 64, SCHEDULER_NAMES, 77, DIGEST)

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        if batch.images[0].prompt == "canary":  # the watchdog's canary is never held
            return super().generate(batch, on_step)

        def held(done: int, total: int) -> bool:
            go_on = on_step(done, total) if on_step is not None else True
            if done == 1:  # hold the batch after its first step boundary
                self.entered.set()
                assert self.release.wait(10), "the test never released the batch"
                go_on = on_step(done, total) if on_step is not None else True  # ask again after the hold
            return go_on

        return super().generate(batch, held)


def wait_for(client: TestClient, path: str, check: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """GET ``path`` until ``check(response)`` holds; a generous bound (the fake loads in a background task)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.get(path)
        if check(response):
            return dict(response.json())
        time.sleep(0.02)
    raise AssertionError(f"{path} never matched: {response.status_code} {response.text}")




def start(engine: FakeEngine, settings: Settings) -> Iterator[TestClient]:
    """The app on ``engine`` under ``settings``, ready (a Host header links may use)."""
    with TestClient(create_app(engine, settings), base_url="http://localhost") as client:
        wait_for(client, "/ready", lambda r: r.status_code == 200)
        yield client
