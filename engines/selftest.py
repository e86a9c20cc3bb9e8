"""Boot self-test: deterministic canaries at every served shape, output fingerprints, and SLO windows as code.

A shape is (width, height, batch). Each shape runs one warm-up batch (so no first real request pays for a kernel
choice or an engine build), then ``timed_runs`` timed batches. Every image is sanity-checked (not constant, not
all-black), compared with the fingerprints recorded next to the model (``selftest.json``), and the p95 latency is
compared with the SLO window for the shape.
"""

from __future__ import annotations

import json
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.config import load_toml, read_toml
from engines.errors import ConfigError, SelfTestError
from engines.protocol import Batch, BatchResult, ImageSpec
from engines.telemetry import GpuSample, TelemetrySource

THUMB = 8


class Canary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1, max_length=64)
    prompt: str = Field(..., min_length=1)
    negative_prompt: str = ""
    seed: int = Field(..., ge=0, le=2**32 - 1)


class CanarySuite(BaseModel):
    """configs/canaries.toml"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(8, ge=1, le=100)
    scheduler: str = "euler"
    guidance_scale: float = Field(7.5, ge=0, le=30)
    canary: tuple[Canary, ...] = Field(..., min_length=1)

    def batch(self, shape: Shape) -> Batch:
        specs = []
        for i in range(shape.batch):
            c = self.canary[i % len(self.canary)]
            specs.append(ImageSpec(c.prompt, c.negative_prompt, c.seed + i // len(self.canary), self.guidance_scale))
        return Batch(tuple(specs), shape.width, shape.height, self.steps, self.scheduler)

    def names(self, shape: Shape) -> list[str]:
        return [self.canary[i % len(self.canary)].name for i in range(shape.batch)]


class SloWindow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: str
    batch: int = Field(..., ge=1)
    steps: int = Field(..., ge=1)
    budget_s: float = Field(..., gt=0)
    """Bound on the p95 of the timed canary batches, seconds."""
    min_gpu_util_percent: float | None = Field(None, ge=0, le=100)


@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    batch: int

    @property
    def key(self) -> str:
        return f"{self.width}x{self.height}x{self.batch}"

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def load_canaries(path: Path) -> CanarySuite:
    return load_toml(path, CanarySuite, "canary file")


class _Windows(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    windows: tuple[SloWindow, ...] = ()


def load_slo(path: Path, profile: str) -> tuple[SloWindow, ...]:
    """The profile's array of tables in the SLO file."""
    data = read_toml(path, "SLO file")
    try:
        return _Windows.model_validate({"windows": data.get(profile, [])}).windows
    except ValidationError as exc:
        raise ConfigError(f"{path} [{profile}]: {exc}") from None


def fingerprint(image: np.ndarray) -> np.ndarray:
    """8x8 block means of an HxWx3 uint8 image, in pixel units (0..255)."""
    h, w = image.shape[:2]
    rows, cols = np.linspace(0, h, THUMB + 1).astype(int), np.linspace(0, w, THUMB + 1).astype(int)
    pixels = image.astype(np.float64)
    return np.array([[pixels[rows[i]:rows[i + 1], cols[j]:cols[j + 1]].mean(axis=(0, 1)) for j in range(THUMB)]
                     for i in range(THUMB)])


def sanity(image: np.ndarray) -> str | None:
    """Why this image cannot be a real output (constant, all black), or None."""
    if float(image.max()) <= 2.0:
        return "all-black image"
    if float(image.astype(np.float32).std()) < 1.0:
        return "constant image"
    return None


@dataclass
class ShapeResult:
    shape: str
    latencies_s: list[float]
    p50_s: float
    p95_s: float
    budget_s: float | None
    gpu_util_percent: float | None
    gpu_util_floor: float | None
    distances: dict[str, float] = field(default_factory=dict)
    """canary name -> max |fingerprint difference| in pixel units."""
    failures: list[str] = field(default_factory=list)


@dataclass
class SelfTestReport:
    passed: bool
    shapes: list[ShapeResult]
    fingerprints: str
    """'checked (platform ...)', 'not recorded', or 'recorded now'."""
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "fingerprints": self.fingerprints, "seconds": self.seconds,
                "shapes": [asdict(s) for s in self.shapes]}


@dataclass(frozen=True)
class SelfTestPlan:
    """What the self-test runs and against what it judges."""

    suite: CanarySuite
    shapes: tuple[Shape, ...]
    slo: tuple[SloWindow, ...]
    timed_runs: int = 3
    tolerance: float = 4.0
    """Max |fingerprint difference| (pixel units) on the recording platform."""
    cross_platform_tolerance: float = 24.0
    """...and when the recording came from another platform (CPU vs GPU, fp32 vs fp16)."""
    require_fingerprints: bool = False
    fingerprints_file: str = "selftest.json"
    batch_sizes: tuple[int, ...] = (1,)
    """Used with the model's native size when ``shapes`` is empty."""

    def window(self, shape: Shape) -> SloWindow | None:
        return next((w for w in self.slo if (w.size, w.batch, w.steps) == (shape.size, shape.batch,
                                                                            self.suite.steps)), None)


Generate = Callable[[Batch], BatchResult]


class _Sampler:
    """Samples GPU telemetry in the background while timed canaries run."""

    def __init__(self, source: TelemetrySource | None, device: int) -> None:
        self.source, self.device, self.samples = source, device, list[GpuSample]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.source is not None and not self._stop.is_set():
            self.samples.append(self.source.sample(self.device))
            self._stop.wait(0.05)

    def __enter__(self) -> _Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def platform_id(provider: str) -> dict[str, str]:
    import onnxruntime as ort

    return {"provider": provider, "onnxruntime": ort.__version__, "machine": platform.machine()}


def _images(result: BatchResult) -> list[np.ndarray]:
    return [np.asarray(g.image) for g in result.images]


def record(plan: SelfTestPlan, generate: Generate, model_dir: Path) -> Path:
    """Run every canary shape once and store its fingerprints next to the model."""
    shapes: dict[str, list[dict[str, Any]]] = {}
    provider = ""
    for shape in plan.shapes:
        result = generate(plan.suite.batch(shape))
        provider = result.provider
        shapes[shape.key] = [{"canary": name, "thumb": fingerprint(img).round(3).tolist()}
                             for name, img in zip(plan.suite.names(shape), _images(result), strict=True)]
    path = model_dir / plan.fingerprints_file
    record = {"format": 1, "platform": platform_id(provider), "suite": plan.suite.model_dump(mode="json"),
              "shapes": shapes}
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def _recorded(plan: SelfTestPlan, model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / plan.fingerprints_file
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if data.get("suite") != plan.suite.model_dump(mode="json"):
        raise SelfTestError(f"{path} was recorded for another canary suite: re-record with `sdserve selftest --record`")
    return data


def run(plan: SelfTestPlan, generate: Generate, model_dir: Path, telemetry: TelemetrySource | None = None,
        device: int = 0) -> SelfTestReport:
    """Warm up and time every shape, check outputs and budgets; raise SelfTestError naming every failure."""
    start = time.perf_counter()
    recorded = _recorded(plan, model_dir)
    if recorded is None and plan.require_fingerprints:
        raise SelfTestError(f"no canary fingerprints at {model_dir / plan.fingerprints_file}: "
                            "record them with `sdserve selftest --record` on a known-good node")
    results, tolerance, note = [], plan.tolerance, "not recorded"
    for shape in plan.shapes:
        batch = plan.suite.batch(shape)
        warm = generate(batch)
        if recorded is not None:
            same = recorded["platform"] == platform_id(warm.provider)
            tolerance = plan.tolerance if same else plan.cross_platform_tolerance
            note = f"checked against {recorded['platform']} (tolerance {tolerance})"
        latencies = []
        with _Sampler(telemetry, device) as sampler:
            for _ in range(plan.timed_runs):
                t = time.perf_counter()
                generate(batch)
                latencies.append(time.perf_counter() - t)
        results.append(_judge(plan, shape, warm, latencies, sampler.samples, recorded, tolerance))
    failures = [f"{r.shape}: {f}" for r in results for f in r.failures]
    report = SelfTestReport(not failures, results, note, time.perf_counter() - start)
    if failures:
        raise SelfTestError("self-test failed: " + "; ".join(failures), report)
    return report


def _judge(plan: SelfTestPlan, shape: Shape, warm: BatchResult, latencies: list[float], samples: list[GpuSample],
           recorded: dict[str, Any] | None, tolerance: float) -> ShapeResult:
    window = plan.window(shape)
    p95 = float(np.percentile(latencies, 95))
    util = statistics.median(s.sm_percent for s in samples) if samples else None
    result = ShapeResult(shape.key, [round(x, 4) for x in latencies], statistics.median(latencies), p95,
                         window.budget_s if window else None, util,
                         window.min_gpu_util_percent if window else None)
    names = plan.suite.names(shape)
    for name, image in zip(names, _images(warm), strict=True):
        problem = sanity(image)
        if problem:
            result.failures.append(f"canary {name!r}: {problem}")
    if window is not None and p95 > window.budget_s:
        result.failures.append(f"p95 {p95:.3f}s over budget {window.budget_s:.3f}s")
    if window is not None and window.min_gpu_util_percent is not None and (util is None or
                                                                          util < window.min_gpu_util_percent):
        result.failures.append(f"GPU utilization {util if util is not None else 'unknown'}% "
                               f"under floor {window.min_gpu_util_percent}%")
    if recorded is not None:
        stored = recorded["shapes"].get(shape.key)
        if stored is None:
            result.failures.append("no recorded fingerprint for this shape: re-record")
        else:
            for name, image, ref in zip(names, _images(warm), stored, strict=True):
                distance = float(np.abs(fingerprint(image) - np.array(ref["thumb"])).max())
                result.distances[name] = round(distance, 3)
                if distance > tolerance:
                    result.failures.append(f"canary {name!r} fingerprint distance {distance:.1f} over tolerance "
                                           f"{tolerance} (weights or runtime changed)")
    return result
