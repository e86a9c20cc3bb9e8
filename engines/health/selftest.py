"""Boot self-test: deterministic canaries at every served shape, output fingerprints, and SLO windows as code.

A shape is (width, height, batch). Each shape runs one warm-up batch (so no first real request pays for a kernel
choice or an engine build), then ``timed_runs`` timed batches. Every image is sanity-checked (not constant, not
all-black), compared with the fingerprints recorded next to the model (``selftest.json``), and the p95 latency is
compared with the SLO window for the shape. Where the largest call the server forms (``max(queue.max_batch,
limits.max_n)`` images) is more than every batch size, one untimed canary runs at it too (SelfTestPlan.row_shapes),
so a row count the engines cannot take fails the boot rather than the first busy minute; it is a check, not a
measurement, so it stays out of the report's timed shapes. An instruction-edit family's edit canary
([family.<name>.edit] in configs/canaries.toml) runs once per served size on a fixed input image (``canary_input``)
where the model edits: sane, fingerprinted, and timed (one run) (the report's ``edits``: admission's first cost of an
edit's reference tokens). With ControlNets loaded, the ControlNet canary (engines/health/controlnet_canary.py) runs
after these and its results join the report (``with_controlnets``).
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from engines.config import SelfTestPlan, Shape
from engines.errors import InferenceError, SdserveError, SelfTestError
from engines.types.health import GpuSample, TelemetrySource, fingerprint
from engines.types.request import Batch, BatchResult, EditImage
from engines.types.snapshot import SelfTestReport, ShapeResult

log = logging.getLogger(__name__)


def sanity(image: np.ndarray) -> str | None:
    """Why this image cannot be a real output (constant, all black), or None."""
    if float(image.max()) <= 2.0:
        return "all-black image"
    if float(image.astype(np.float32).std()) < 1.0:
        return "constant image"
    return None


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


def canary_input(width: int, height: int) -> np.ndarray:
    """The edit canary's fixed input image: uint8 [height, width, 3], a smooth two-axis pattern (the same picture
    at every size, so its resize to a batch's size is itself at that size)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = x / max(1, width - 1), y / max(1, height - 1)
    pixels = np.stack([127.5 + 120 * np.sin(6.0 * u), 127.5 + 120 * np.cos(5.0 * v), 255 * (u + v) / 2], axis=-1)
    return pixels.round().clip(0, 255).astype(np.uint8)


def edit_batch(plan: SelfTestPlan, shape: Shape) -> Batch:
    """The edit canary as an instruction edit at ``shape``: its prompt and seed on the fixed input image."""
    edit = plan.suite.edit
    if edit is None:
        raise ValueError("the canary suite has no edit canary")
    image = EditImage(canary_input(shape.width, shape.height), references=(canary_input(edit.image, edit.image),))
    base = plan.suite.batch(Shape(shape.width, shape.height, 1))
    spec = replace(base.images[0], prompt=edit.prompt, negative_prompt="", seed=edit.seed, edit=image)
    return replace(base, images=(spec,), steps=edit.steps or base.steps)


def _edit_key(shape: Shape) -> str:
    return f"{shape.key}-edit"


def _edit_shapes(plan: SelfTestPlan) -> tuple[Shape, ...]:
    """One edit canary per served size, batch 1 (none without an edit canary)."""
    if plan.suite.edit is None:
        return ()
    return tuple(Shape(w, h, 1) for w, h in dict.fromkeys((s.width, s.height) for s in plan.shapes))


def _suite(plan: SelfTestPlan) -> dict[str, Any]:
    """The suite as a recording names it (``edit`` only where there is one: older recordings stay valid)."""
    dump = plan.suite.model_dump(mode="json")
    if dump.get("edit") is None:
        dump.pop("edit", None)
    dump.pop("controlnet", None)  # the ControlNet canary is judged against the plain image, never a recording
    return dump


def with_controlnets(report: SelfTestReport, results: tuple[ShapeResult, ...]) -> SelfTestReport:
    """``report`` with the ControlNet canary's results (SelfTestReport.controlnets)."""
    if not results:
        return report
    return report.model_copy(update={"controlnets": results})


def record(plan: SelfTestPlan, generate: Generate, model_dir: Path) -> Path:
    """Run every canary shape once and store its fingerprints next to the model."""
    shapes: dict[str, list[dict[str, Any]]] = {}
    provider = ""
    for shape in (*plan.shapes, *plan.row_shapes()):
        result = generate(plan.suite.batch(shape))
        provider = result.provider
        shapes[shape.key] = [{"canary": name, "thumb": fingerprint(img).round(3).tolist()}
                             for name, img in zip(plan.suite.names(shape), _images(result), strict=True)]
    for shape in _edit_shapes(plan):
        result = generate(edit_batch(plan, shape))
        shapes[_edit_key(shape)] = [{"canary": plan.suite.edit.name if plan.suite.edit else "",
                                     "thumb": fingerprint(_images(result)[0]).round(3).tolist()}]
    path = model_dir / plan.fingerprints_file
    record = {"format": 1, "platform": platform_id(provider), "suite": _suite(plan), "shapes": shapes}
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def _recorded(plan: SelfTestPlan, model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / plan.fingerprints_file
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    if data.get("suite") != _suite(plan):
        raise SelfTestError(f"{path} was recorded for another canary suite: re-record with `sdserve selftest --record`")
    return data


def _canary_run(generate: Generate, batch: Batch, shape: Shape) -> BatchResult:
    """One canary batch; an output the engine refuses (NaN/inf, all-black) fails the self-test (exit 24)."""
    try:
        return generate(batch)
    except InferenceError as exc:
        raise SelfTestError(f"self-test failed: {shape.key}: canary output refused: {exc}") from exc


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
        warm = _canary_run(generate, batch, shape)
        if recorded is not None:
            same = recorded["platform"] == platform_id(warm.provider)
            tolerance = plan.tolerance if same else plan.cross_platform_tolerance
            note = f"checked against {recorded['platform']} (tolerance {tolerance})"
        latencies = []
        with _Sampler(telemetry, device) as sampler:
            for _ in range(plan.timed_runs):
                t = time.perf_counter()
                _canary_run(generate, batch, shape)
                latencies.append(time.perf_counter() - t)
        results.append(_judge(plan, shape, warm, latencies, sampler.samples, recorded, tolerance))
    # the largest call is a check, not a measurement: kept out of the report's shapes (the boot baseline and the
    # cost model's seeds), its failures fail the self-test like any shape's
    largest = [_largest_call(plan, shape, generate, recorded, tolerance) for shape in plan.row_shapes()]
    edits = [_edit_canary(plan, shape, generate, recorded, tolerance) for shape in _edit_shapes(plan)]
    failures = [f"{r.shape}: {f}" for r in (*results, *largest, *edits) for f in r.failures]
    report = SelfTestReport(passed=not failures, shapes=tuple(results), fingerprints=note,
                            seconds=time.perf_counter() - start, edits=tuple(edits))
    if failures:
        raise SelfTestError("self-test failed: " + "; ".join(failures), report)
    return report


def _largest_call(plan: SelfTestPlan, shape: Shape, generate: Generate, recorded: dict[str, Any] | None,
                  tolerance: float) -> ShapeResult:
    """The largest call the server forms (``plan.max_images`` images), run once, untimed: the engines must take
    its rows and its images must be sane; no SLO window judges it (one cold run), and its fingerprints are compared
    where the recording has them (recordings made before it ran lack them)."""
    t = time.perf_counter()
    try:
        warm = generate(plan.suite.batch(shape))
    except Exception as exc:  # ORT raises plain Fail/RuntimeException: an input outside a TensorRT profile among them
        if isinstance(exc, SdserveError) and not isinstance(exc, InferenceError):
            raise
        raise SelfTestError(f"self-test failed: {shape.key}: the largest call the configuration forms (max(queue."
                            f"max_batch, limits.max_n) = {shape.batch} images) failed: {exc}") from exc
    seconds = time.perf_counter() - t
    log.info("self-test: the largest call the configuration forms, %s, ran in %.3fs (untimed)", shape.key, seconds)
    stored = recorded if recorded is not None and shape.key in recorded.get("shapes", {}) else None
    return _judge(plan, shape, warm, [seconds], [], stored, tolerance, timed=False)


def _edit_canary(plan: SelfTestPlan, shape: Shape, generate: Generate, recorded: dict[str, Any] | None,
                 tolerance: float) -> ShapeResult:
    """The edit canary at one served size, one run (timed with its warm-up: a conservative first figure for
    admission's cost of an edit's reference tokens, server/app.py, which live edits then refine); its image must be
    sane, its fingerprint match where the recording has it (recordings made before the edit canary lack it); no SLO
    window judges it."""
    batch = edit_batch(plan, shape)
    t = time.perf_counter()
    warm = _canary_run(generate, batch, shape)
    seconds = time.perf_counter() - t
    log.info("self-test: the edit canary at %s ran in %.3fs", shape.size, seconds)
    key = _edit_key(shape)
    stored = recorded if recorded is not None and key in recorded.get("shapes", {}) else None
    return _judge(plan, shape, warm, [seconds], [], stored, tolerance, timed=False, key=key)


def _judge(plan: SelfTestPlan, shape: Shape, warm: BatchResult, latencies: list[float], samples: list[GpuSample],
           recorded: dict[str, Any] | None, tolerance: float, timed: bool = True, key: str = "") -> ShapeResult:
    """``key``: the edit canary's (its fingerprints' key and its one name), else the shape's canaries."""
    window = plan.window(shape) if timed else None
    p95 = float(np.percentile(latencies, 95))
    util = statistics.median(s.sm_percent for s in samples) if samples else None
    names = [plan.suite.edit.name] if key and plan.suite.edit is not None else plan.suite.names(shape)
    failures = [f"canary {name!r}: {problem}" for name, image in zip(names, _images(warm), strict=True)
                if (problem := sanity(image))]
    if window is not None and p95 > window.budget_s:
        failures.append(f"p95 {p95:.3f}s over budget {window.budget_s:.3f}s")
    if window is not None and window.min_gpu_util_percent is not None and (util is None or
                                                                          util < window.min_gpu_util_percent):
        failures.append(f"GPU utilization {util if util is not None else 'unknown'}% "
                        f"under floor {window.min_gpu_util_percent}%")
    distances: dict[str, float] = {}
    if recorded is not None:
        _compare(recorded["shapes"].get(key or shape.key), names, _images(warm), tolerance, distances, failures)
    return ShapeResult(shape=key or shape.key, latencies_s=tuple(round(x, 4) for x in latencies),
                       p50_s=statistics.median(latencies), p95_s=p95,
                       budget_s=window.budget_s if window else None, gpu_util_percent=util,
                       gpu_util_floor=window.min_gpu_util_percent if window else None, distances=distances,
                       failures=tuple(failures))


def _compare(stored: list[dict[str, Any]] | None, names: list[str], images: list[np.ndarray], tolerance: float,
             distances: dict[str, float], failures: list[str]) -> None:
    """Canary outputs against the recorded fingerprints of their shape; fills ``distances`` and ``failures``."""
    if stored is None:
        failures.append("no recorded fingerprint for this shape: re-record")
        return
    for name, image, ref in zip(names, images, stored, strict=True):
        distance = float(np.abs(fingerprint(image) - np.array(ref["thumb"])).max())
        distances[name] = round(distance, 3)
        if distance > tolerance:
            failures.append(f"canary {name!r} fingerprint distance {distance:.1f} over tolerance "
                            f"{tolerance} (weights or runtime changed)")
