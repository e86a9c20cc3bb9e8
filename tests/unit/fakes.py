"""A fake engine behind the engine protocol, for HTTP-layer unit tests only."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.errors import GpuUnavailableError, NotReadyError
from engines.health.signature import classify
from engines.protocol import StepRun
from engines.types.health import CanaryCheck, GpuSample, Signature, TelemetrySource
from engines.types.model import LoraInfo, LoraStats, ModelInfo
from engines.types.request import Batch, BatchResult, GeneratedImage, ImageSpec, LoraUse, StepHook, Timings, lora_key
from engines.types.snapshot import (
    Artifacts,
    Attention,
    Capabilities,
    CheckResult,
    IoInfo,
    OrtEvent,
    Policy,
    SelfTestReport,
    Verdict,
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

    def step_key(self, batch: Batch) -> Hashable | None:
        """None: the fake runs every batch whole (StepFakeEngine steps)."""
        return None

    def begin(self, batch: Batch) -> StepRun:
        raise NotImplementedError("the fake runs batches whole")

    def tick(self, runs: Sequence[StepRun]) -> None:
        raise NotImplementedError("the fake runs batches whole")

    def decode(self, run: StepRun, images: int) -> None:
        raise NotImplementedError("the fake runs batches whole")

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        raise NotImplementedError("the fake runs batches whole")

    def discard(self, run: StepRun) -> None:
        raise NotImplementedError("the fake runs batches whole")

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


@dataclass(eq=False)
class FakeRun:
    batch: Batch
    steps_done: int = 0
    released: bool = False
    ticks: list[int] = field(default_factory=list)
    """The size of every tick this run took part in (rows of the set)."""
    decoded: int = 0
    """Images decoded by ``decode`` so far."""

    @property
    def steps_total(self) -> int:
        return self.batch.steps

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.batch.steps


class StepFakeEngine(HashedEngine):
    """The fake staged for step-level batching: runs keyed by size and LoRA set advance one step per tick; a tick
    can be held (``hold``) so a test decides what joins at the boundary, with events, not sleeps."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = threading.Event()
        self.hold.set()
        self.ticked = threading.Event()
        self.in_tick = threading.Event()
        """Set when a tick starts (before the hold): the operation in flight is a tick."""
        self.gate: threading.Semaphore | None = None
        """When set, each tick takes one of its permits after the hold: a test lets ticks through one at a time
        (the step loop runs ticks of the same rows back to back)."""
        self.decode_hold = threading.Event()
        self.decode_hold.set()
        self.in_decode = threading.Event()
        """Set when a part of a decode starts (before ``decode_hold``)."""
        self.runs: list[FakeRun] = []
        self.tick_log: list[list[str]] = []
        """The prompts of the first image of every run in each tick, in order."""
        self.ops: list[tuple[str, str]] = []
        """Every operation in order: ("begin" | "tick" | "finish", the lead run's first prompt; a tick's rows are
        in tick_log)."""

    def step_key(self, batch: Batch) -> Hashable | None:
        return (batch.width, batch.height, batch.lora_key)

    def begin(self, batch: Batch) -> StepRun:
        if not self.loaded:
            raise NotReadyError("not loaded")
        run = FakeRun(batch)
        self.runs.append(run)
        self.ops.append(("begin", batch.images[0].prompt))
        return run

    def tick(self, runs: Sequence[StepRun]) -> None:
        self.in_tick.set()
        assert self.hold.wait(20), "the test never released the tick"
        gate = self.gate
        assert gate is None or gate.acquire(timeout=20), "the test never let the tick through"
        fakes = [r for r in runs if isinstance(r, FakeRun)]
        assert len({self.step_key(r.batch) for r in fakes}) == 1, "a tick mixed step keys"
        self.tick_log.append([r.batch.images[0].prompt for r in fakes])
        self.ops.append(("tick", fakes[0].batch.images[0].prompt))
        for run in fakes:
            assert not run.finished and not run.released
            run.steps_done += 1
            run.ticks.append(len(fakes))
        self.ticked.set()

    def decode(self, run: StepRun, images: int) -> None:
        assert isinstance(run, FakeRun) and not run.released and run.decoded < len(run.batch.images)
        self.in_decode.set()
        assert self.decode_hold.wait(20), "the test never released the decode"
        run.decoded = min(len(run.batch.images), run.decoded + images)
        self.ops.append(("decode", run.batch.images[0].prompt))

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        assert isinstance(run, FakeRun) and not run.released
        run.released = True
        self.batches.append(run.batch)
        self.ops.append(("finish", run.batch.images[0].prompt))
        images = tuple(GeneratedImage(Image.fromarray(np.random.default_rng(s.seed).integers(
            0, 256, (run.batch.height, run.batch.width, 3), np.uint8)), s.seed) for s in run.batch.images)
        return BatchResult(images, self.provider, Timings(total=0.001), len(images), run.steps_done,
                           stopped or run.steps_done < run.batch.steps)

    def discard(self, run: StepRun) -> None:
        assert isinstance(run, FakeRun)
        run.released = True


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
