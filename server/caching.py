"""Step caching policy and its quality gate: which requests run with a step cache (engines/numerics/step_cache.py,
first_block.py), and the gate that decides, per served shape, whether the configured cache may run at all.

The gate runs the canaries cached and uncached with the same seeds and steps and compares the images (PSNR, numpy):
a shape is served cached only when the mean and the worst PSNR reach ``[cache] gate_min_mean_psnr_db`` and
``gate_min_worst_psnr_db``. What a threshold does depends on the model it runs on (published figures are for other
models: Cache-DiT's DBCache on FLUX.1-dev 1.80x at 33.8 dB), so the gate measures it on the served model, at boot
when ``[cache] policy`` is not off, and on demand with `sdserve gate --cache`. Tiny random-weight models say nothing
about quality on real weights: the gate's figures are only as good as the model it ran on.

Requests: ``step_cache`` (both APIs: a top-level extension field of the OpenAI and the A1111 generation routes)
true asks for it, false refuses it, absent follows the policy (``on``: cached where the gate passed). A request
that asks where the cache cannot run (policy off, fewer than ``CACHE_MIN_STEPS`` steps: the engines' constant, a
shape whose gate failed or never ran) gets a 422 naming ``step_cache`` and why, rather than an uncached image it did
not ask for silently.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engines.config import Canary
from engines.errors import InvalidRequestError
from engines.types.request import CACHE_MIN_STEPS, Batch, BatchResult, CacheUse, ImageSpec, StepCache
from server.generation import STEP_CACHE
from server.settings import CacheSettings

log = logging.getLogger(__name__)
PSNR_IDENTICAL_DB = 99.0
"""The PSNR reported for identical images (infinite otherwise; JSON has no infinity)."""


def psnr_db(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images in dB (``PSNR_IDENTICAL_DB`` when they are equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return PSNR_IDENTICAL_DB if mse == 0 else min(PSNR_IDENTICAL_DB, 10 * math.log10(255.0 ** 2 / mse))


def spec_of(settings: CacheSettings) -> StepCache:
    return StepCache(settings.method, settings.threshold, settings.warmup, settings.final, settings.max_reuse)


@dataclass(frozen=True)
class ShapeGate:
    """One shape's verdict: the canaries' PSNR cached vs uncached, the evaluations reused and the time ratio."""

    width: int
    height: int
    spec: StepCache
    steps: int
    mean_psnr_db: float
    worst_psnr_db: float
    reused: int
    evaluations: int
    time_ratio: float
    """Cached over uncached wall time of the canaries (below 1: the cache saved time)."""
    passed: bool
    reason: str

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"

    def as_dict(self) -> dict[str, object]:
        return {"size": self.size, "method": self.spec.method, "threshold": self.spec.threshold,
                "steps": self.steps, "mean_psnr_db": round(self.mean_psnr_db, 2),
                "worst_psnr_db": round(self.worst_psnr_db, 2), "reused": self.reused,
                "evaluations": self.evaluations, "time_ratio": round(self.time_ratio, 3), "passed": self.passed,
                "reason": self.reason}


Generate = Callable[[Batch], BatchResult]


def gate_shape(generate: Generate, width: int, height: int, canaries: Sequence[Canary], settings: CacheSettings,
               scheduler: str, guidance: float) -> ShapeGate:
    """Run every canary uncached then cached at ``width``x``height`` and ``settings.gate_steps``; the verdict."""
    spec, steps = spec_of(settings), settings.gate_steps
    psnrs: list[float] = []
    reused = evaluations = 0
    plain_s = cached_s = 0.0
    for canary in canaries:
        batch = Batch((ImageSpec(canary.prompt, canary.negative_prompt, canary.seed, guidance),), width, height,
                      steps, scheduler)
        start = time.perf_counter()
        plain = generate(batch)
        middle = time.perf_counter()
        cached = generate(dataclasses.replace(batch, cache=spec))
        plain_s += middle - start
        cached_s += time.perf_counter() - middle
        if cached.cache is None:
            raise RuntimeError(f"the engine ran the gate's cached canary {canary.name!r} without its cache")
        reused += cached.cache.reused
        evaluations += cached.cache.evaluations
        psnrs.extend(psnr_db(np.asarray(a.image), np.asarray(b.image))
                     for a, b in zip(plain.images, cached.images, strict=True))
    mean, worst = float(np.mean(psnrs)), float(np.min(psnrs))
    failures = [f"mean PSNR {mean:.1f} dB < {settings.gate_min_mean_psnr_db:g}"] * (
        mean < settings.gate_min_mean_psnr_db)
    failures += [f"worst PSNR {worst:.1f} dB < {settings.gate_min_worst_psnr_db:g}"] * (
        worst < settings.gate_min_worst_psnr_db)
    reason = "; ".join(failures) or f"mean {mean:.1f} dB, worst {worst:.1f} dB, {reused}/{evaluations} reused"
    return ShapeGate(width, height, spec, steps, mean, worst, reused, evaluations,
                     cached_s / plain_s if plain_s else 1.0, not failures, reason)


class Caching:
    """The server's step-cache policy and the gate's verdicts per shape (filled at boot)."""

    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.spec = spec_of(settings)
        self.gates: dict[tuple[int, int], ShapeGate] = {}
        self.error = ""
        """Why the gate could not run (the cache then serves nothing)."""

    def run_gate(self, generate: Generate, sizes: Sequence[tuple[int, int]], canaries: Sequence[Canary],
                 scheduler: str, guidance: float, model_steps: int = CACHE_MIN_STEPS) -> list[ShapeGate]:
        """Gate every size (blocking: the caller holds the engine); a failed gate only keeps the cache off.
        ``model_steps``: the model's default steps; a few-step model (Turbo, schnell) is never gated nor cached."""
        if model_steps < CACHE_MIN_STEPS:
            self.error = (f"a few-step model (its default is {model_steps} steps): a step cache never runs below "
                          f"{CACHE_MIN_STEPS} steps")
            log.info("step cache gate not run: %s", self.error)
            return []
        for width, height in sizes:
            try:
                gate = gate_shape(generate, width, height, canaries, self.settings, scheduler, guidance)
            except Exception as exc:  # the cache stays off; the server still serves uncached
                self.error = f"{width}x{height}: {type(exc).__name__}: {exc}"
                log.warning("step cache gate could not run at %dx%d: %s", width, height, exc)
                continue
            self.gates[(width, height)] = gate
            log.info("step cache gate %s at %s: %s", "passed" if gate.passed else "FAILED", gate.size, gate.reason)
        return list(self.gates.values())

    def spec_for(self, asked: bool | None, batch: Batch) -> StepCache | None:
        """The cache ``batch`` runs with: None unless asked (or the policy is on) and allowed here; a request
        that asks where it cannot run gets InvalidRequestError naming ``step_cache``."""
        policy = self.settings.policy
        if asked is False or (asked is None and policy != "on"):
            return None
        why = self.refusal(batch)
        if why and asked:
            raise InvalidRequestError(f"{STEP_CACHE} cannot run for this request: {why}", param=STEP_CACHE)
        return None if why else self.spec

    def refusal(self, batch: Batch) -> str:
        if self.settings.policy == "off":
            return "the step cache is off on this server ([cache] policy)"
        if batch.steps < CACHE_MIN_STEPS:
            return (f"it needs at least {CACHE_MIN_STEPS} steps (got {batch.steps}; few-step generations gain "
                    "nothing and every evaluation counts)")
        gate = self.gates.get((batch.width, batch.height))
        if gate is None:
            gated = ", ".join(g.size for g in self.gates.values()) or "none"
            return (f"no quality gate ran for {batch.width}x{batch.height} on this model (gated sizes: {gated}"
                    + (f"; the gate failed to run: {self.error}" if self.error else "") + ")")
        if not gate.passed:
            return f"its quality gate failed at {gate.size} on this model ({gate.reason})"
        return ""

    def snapshot(self) -> dict[str, object]:
        """For /capabilities: the policy, the configuration and every shape's gate."""
        s = self.settings
        return {"policy": s.policy, "method": s.method, "threshold": s.threshold, "warmup": s.warmup,
                "final": s.final, "max_reuse": s.max_reuse, "min_steps": CACHE_MIN_STEPS,
                "gate": {"steps": s.gate_steps, "min_mean_psnr_db": s.gate_min_mean_psnr_db,
                         "min_worst_psnr_db": s.gate_min_worst_psnr_db, "error": self.error,
                         "shapes": [g.as_dict() for g in self.gates.values()]}}


def header_value(use: CacheUse) -> str:
    """``x-sdserve-cache``: ``output:0.2; reused=12/30``."""
    return f"{use.spec.label()}; reused={use.reused}/{use.evaluations}"


def infotext_value(use: CacheUse) -> str:
    """The infotext's ``Step cache`` entry: ``output 0.2 reused 12/30`` (no commas or colons: A1111's parser)."""
    return f"{use.spec.method} {use.spec.threshold:g} reused {use.reused}/{use.evaluations}"
