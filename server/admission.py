"""Admission by cost: a request's compute is estimated before it is queued, from measured seconds per image-step
at its shape (the boot self-test, then live batches), times its steps and images. A request that cannot finish
before its deadline even alone is refused at once (4xx naming the deadline and the estimate); one that could, but
not behind the work already queued, gets a prompt 429 with Retry-After. Nothing is computed to be thrown away.

The model is general over what a job costs (size x steps x images), so edits (img2img, inpainting: fewer steps
by their strength) go through the same door."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engines.errors import InvalidRequestError
from server.errors import QueueFullError

ALPHA = 0.3
"""EWMA weight of a new live sample (per image-step seconds at one size)."""


@dataclass(frozen=True)
class Cost:
    """What a job asks of the engine."""

    width: int
    height: int
    steps: int
    images: int

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Estimate:
    seconds: float
    per_image_step_s: float
    basis: str
    """"measured at 64x64" or "scaled from 64x64 by pixel count" (a lower bound: attention grows faster)."""


class CostModel:
    """Seconds per image-step by size: seeded from the self-test (p50 of its timed canaries over batch x steps,
    text encoding and decoding included, so conservative), then an EWMA of live batches at that size."""

    def __init__(self, work: Callable[[int, int], float] | None = None, basis: str = "pixel count") -> None:
        self.per_image_step: dict[tuple[int, int], float] = {}
        self.work = work or (lambda w, h: float(w * h))
        """Relative compute of one step at a size (engines.protocol.ModelInfo.work): what an unmeasured size's
        cost is scaled by from the nearest measured one."""
        self.basis = basis

    def scale_by(self, work: Callable[[int, int], float], basis: str) -> None:
        """The loaded model's work per step (set once the engine is loaded: a DiT scales by its tokens)."""
        self.work, self.basis = work, basis

    def seed(self, width: int, height: int, batch: int, steps: int, seconds: float) -> None:
        if seconds > 0 and batch > 0 and steps > 0 and (width, height) not in self.per_image_step:
            self.per_image_step[(width, height)] = seconds / (batch * steps)

    def observe(self, cost: Cost, seconds: float) -> None:
        """A live batch of ``cost`` (steps: those that ran) took ``seconds``."""
        if seconds <= 0 or cost.steps <= 0 or cost.images <= 0:
            return
        sample = seconds / (cost.steps * cost.images)
        key = (cost.width, cost.height)
        old = self.per_image_step.get(key)
        self.per_image_step[key] = sample if old is None else (1 - ALPHA) * old + ALPHA * sample

    def estimate(self, cost: Cost) -> Estimate | None:
        """None until anything was measured (then nothing is refused on a guess)."""
        if not self.per_image_step:
            return None
        key = (cost.width, cost.height)
        work = cost.steps * cost.images
        if key in self.per_image_step:
            per = self.per_image_step[key]
            return Estimate(per * work, per, f"measured at {cost.size}")
        target = self.work(cost.width, cost.height)
        (w, h), per = min(self.per_image_step.items(),
                          key=lambda item: abs(math.log(self.work(*item[0]) / target)))
        scaled = per * target / self.work(w, h)
        return Estimate(scaled * work, scaled, f"scaled from {w}x{h} by {self.basis}")

    def total(self, costs: Iterable[Cost]) -> float:
        return sum(e.seconds for e in map(self.estimate, costs) if e is not None)

    def snapshot(self) -> dict[str, float]:
        return {f"{w}x{h}": round(s, 6) for (w, h), s in sorted(self.per_image_step.items())}


def admit(model: CostModel, costs: list[Cost], ahead_s: float, remaining_s: float, source: str) -> None:
    """Refuse ``costs`` (one request: one job, or an A1111 run's n_iter jobs) that cannot finish in
    ``remaining_s``: alone (InvalidRequestError: the client must ask for less) or behind ``ahead_s`` of work
    already admitted (QueueFullError: 429, retry after that work)."""
    estimates = [e for e in map(model.estimate, costs) if e is not None]
    if not estimates:
        return
    own = sum(e.seconds for e in estimates)
    first, c = estimates[0], costs[0]
    images = sum(x.images for x in costs)
    if own > remaining_s:
        raise InvalidRequestError(
            f"estimated compute {own:.1f}s ({images} image(s) of {c.size} at {c.steps} steps, "
            f"{first.per_image_step_s * 1000:.1f} ms per image-step {first.basis}) exceeds the request deadline "
            f"{remaining_s:.1f}s ({source}): ask for fewer steps, images or a smaller size, or a longer deadline",
            param="steps")
    if ahead_s + own > remaining_s:
        raise QueueFullError(f"estimated wait {ahead_s:.1f}s for the work queued ahead plus {own:.1f}s of compute "
                             f"exceeds the request deadline {remaining_s:.1f}s ({source}): retry later",
                             max(1, math.ceil(ahead_s)))
