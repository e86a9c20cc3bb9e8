"""The ControlNet canary at boot (issue 56, item 6): with ControlNets loaded, after the plain canaries passed, every
loaded ControlNet runs once at the first served size, batch 1, on a fixed control image (``control_image``: the
edit canary's pattern, engines/health/selftest.py ``canary_input``, as an edge map), with the ``[controlnet]`` table
of configs/canaries.toml (its prompt, seed, steps; without one: the first canary's at the suite's steps):

- weight 1 must give a finite, sane image (not blank) that differs from the plain image beyond the canary tolerance
  (the net reaches the denoiser). A net that fails is refused by name with its reason, as a ControlNet that does not
  fit the model is (the log's "ControlNet <name> refused: ..." line, the pipeline's ``refused`` table: a unit naming
  it gets the reason, 422 ``controlnet.model``; its session is dropped, so /controlnet/model_list leaves it out):
  the files are untrusted input, never fatal to the boot;
- weight 0 must reproduce the plain image within the canary tolerance (fingerprint distance, pixel units): the
  ControlNet's residuals are then zeros, so this proves the residual denoiser (``unet_controlnet/``,
  ``transformer_controlnet/``) computes what the plain one does. When every net that passed weight 1 fails it, the
  residual denoiser is wrong and the self-test fails (SelfTestError, exit 24, naming ControlNet); when only some do,
  those nets ignore their conditioning scale and are refused by name.

The canary is relative (each image against the plain image of the same run), so it needs no recorded fingerprints:
a new ControlNet in the folder or a new platform needs no re-recording. Each net's result is a ShapeResult keyed
``<size>x1-controlnet-<name>`` (its weight-1 run's seconds, the distances at weight 0 and 1, a refusal's reason).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from engines.config import SelfTestPlan, Shape
from engines.errors import InferenceError, SdserveError, SelfTestError
from engines.health.selftest import canary_input, sanity
from engines.types.health import fingerprint
from engines.types.request import Batch, BatchResult, ControlUnit
from engines.types.snapshot import ShapeResult

log = logging.getLogger(__name__)

Generate = Callable[[Batch], BatchResult]
LEVELS = 8
"""Gray levels the canary pattern is posterised into: their boundaries are the control image's edges."""


def control_image(width: int, height: int) -> np.ndarray:
    """The canary's control image, uint8 [height, width, 3]: ``canary_input``'s pattern posterised into LEVELS gray
    levels, the level boundaries white on black (a canny-like edge map of the same picture at every size)."""
    gray = canary_input(width, height).astype(np.float32).mean(axis=-1)
    levels = np.floor(gray * LEVELS / 256.0)
    edges = np.zeros(levels.shape, bool)
    edges[:, 1:] |= levels[:, 1:] != levels[:, :-1]
    edges[1:, :] |= levels[1:, :] != levels[:-1, :]
    return np.repeat((edges * np.uint8(255)).astype(np.uint8)[..., None], 3, axis=-1)


def canary_batch(plan: SelfTestPlan, shape: Shape) -> Batch:
    """The plain canary the ControlNet runs are judged against: batch 1 at ``shape``'s size, with the suite's
    ``[controlnet]`` table applied where it has one (its prompt, seed, and steps when set)."""
    base = plan.suite.batch(Shape(shape.width, shape.height, 1))
    table = plan.suite.controlnet
    if table is None:
        return base
    spec = dataclasses.replace(base.images[0], prompt=table.prompt, negative_prompt="", seed=table.seed)
    return dataclasses.replace(base, images=(spec,), steps=table.steps or base.steps)


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(np.abs(fingerprint(a) - fingerprint(b)).max()), 3)


def _controlled(generate: Generate, batch: Batch, name: str, weight: float) -> tuple[np.ndarray, float]:
    """The canary with one unit of ``name`` at ``weight``: its image and seconds. InferenceError for an output the
    engine refuses (NaN/inf, all-black); an ONNX Runtime failure as an InferenceError too (a net's graph is
    untrusted); the engine's other errors (not ready, a bad request) propagate."""
    unit = ControlUnit(control_image(batch.width, batch.height), name, weight=weight)
    start = time.perf_counter()
    try:
        result = generate(dataclasses.replace(batch, control=(unit,)))
    except Exception as exc:  # ORT raises plain Fail/RuntimeException
        if isinstance(exc, SdserveError) and not isinstance(exc, InferenceError):
            raise
        raise InferenceError(f"{type(exc).__name__}: {exc}") from exc
    return np.asarray(result.images[0].image), time.perf_counter() - start


def loaded(pipelines: Iterable[Any]) -> list[str]:
    """The ControlNets the pipelines serve (engines/pipelines/controlnet.py, controlnet_dit.py ``nets``)."""
    return sorted({name for p in pipelines if (c := getattr(p, "controls", None)) is not None for name in c.nets})


def refuse(pipelines: Iterable[Any], name: str, why: str) -> None:
    """Leave ``name`` out of every pipeline with ``why`` (a unit naming it is refused with it) and drop its
    sessions' reports (``controlnet_<name>``, ``@<size>``): the served list reads them."""
    for pipe in pipelines:
        controls = getattr(pipe, "controls", None)
        if controls is None or name not in controls.nets:
            continue
        controls.nets.pop(name)
        controls.refused[name] = why
        reports = pipe.runtime.reports
        for session in [s for s in reports if s.split("@")[0] == f"controlnet_{name}"]:
            reports.pop(session)
    log.warning("ControlNet %s refused: %s", name, why)


def _weight_one(generate: Generate, batch: Batch, name: str, plain: np.ndarray, tolerance: float,
                distances: dict[str, float]) -> tuple[float, str]:
    """The net at weight 1: its seconds and why it is refused ("" when it passes)."""
    try:
        image, seconds = _controlled(generate, batch, name, 1.0)
    except InferenceError as exc:
        return 0.0, f"ControlNet canary at weight 1: output refused ({exc})"
    distances["weight 1"] = moved = _distance(image, plain)
    problem = sanity(image)
    if problem is not None:
        return seconds, f"ControlNet canary at weight 1: {problem}"
    if moved <= tolerance:
        return seconds, (f"ControlNet canary at weight 1 leaves the image unchanged (fingerprint distance {moved} "
                         f"within tolerance {tolerance}): the net does not reach the denoiser")
    return seconds, ""


def _weight_zero(generate: Generate, batch: Batch, name: str, plain: np.ndarray, tolerance: float,
                 distances: dict[str, float]) -> str:
    """The net at weight 0: how its image differs from the plain one ("" when it reproduces it)."""
    try:
        image, _ = _controlled(generate, batch, name, 0.0)
    except InferenceError as exc:
        return f"output refused ({exc})"
    distances["weight 0"] = drift = _distance(image, plain)
    return f"fingerprint distance {drift} from the plain image, over tolerance {tolerance}" if drift > tolerance \
        else ""


def check(plan: SelfTestPlan, pipelines: Iterable[Any], generate: Generate) -> tuple[ShapeResult, ...]:
    """Run the ControlNet canary for every loaded ControlNet (none loaded: nothing runs); refuse the nets that fail
    by name; SelfTestError when the residual denoiser does not reproduce the plain image."""
    pipes = list(pipelines)
    names = loaded(pipes)
    if not names:
        return ()
    first = plan.shapes[0]
    batch = canary_batch(plan, Shape(first.width, first.height, 1))
    try:
        plain = np.asarray(generate(batch).images[0].image)
    except InferenceError as exc:
        raise SelfTestError(f"self-test failed: ControlNet canary at {first.size}: the plain canary's output was "
                            f"refused: {exc}") from exc
    tolerance = plan.tolerance
    distances: dict[str, dict[str, float]] = {name: {} for name in names}
    # weight 1 first: a NaN net gives NaN at weight 0 too (0 * NaN), which is never the residual denoiser's fault
    ran = {name: _weight_one(generate, batch, name, plain, tolerance, distances[name]) for name in names}
    refused = {name: why for name, (_, why) in ran.items() if why}
    off = {name: why for name in names if name not in refused
           and (why := _weight_zero(generate, batch, name, plain, tolerance, distances[name]))}
    if off and len(off) == len(names) - len(refused):
        raise SelfTestError(f"self-test failed: ControlNet canary at {first.size}: at weight 0 the residual denoiser "
                            "(unet_controlnet/ or transformer_controlnet/) does not reproduce the plain canary ("
                            + "; ".join(f"with ControlNet {n}: {why}" for n, why in off.items())
                            + "): the residual variant differs from the base path")
    for name, why in off.items():  # others reproduce it: these nets ignore their conditioning scale
        refused[name] = f"ControlNet canary at weight 0 does not give the plain image ({why}): the net ignores " \
                        "its conditioning scale"
    for name in names:
        if name in refused:
            refuse(pipes, name, refused[name])
        else:
            log.info("self-test: ControlNet canary %s at %s passed (fingerprint distances %s, tolerance %s)", name,
                     first.size, distances[name], tolerance)
    return tuple(ShapeResult(shape=f"{first.size}x1-controlnet-{name}", latencies_s=(round(ran[name][0], 4),),
                             p50_s=ran[name][0], p95_s=ran[name][0], budget_s=None, gpu_util_percent=None,
                             gpu_util_floor=None, distances=distances[name],
                             failures=(f"refused: {refused[name]}",) if name in refused else ())
                 for name in names)
