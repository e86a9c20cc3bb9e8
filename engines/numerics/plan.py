"""A sampler's plan: per-step coefficients over the step graph's basis, computed on the host, no tensors.

engines/numerics/schedulers.py and multistep.py build plans; the pipeline runs them with the step graph
(engines/numerics/step_graph.py), one UNet evaluation at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class Lin:
    """Coefficients over the step basis (sample, model_output, prev_denoised, noise, earlier history entries).

    ``prev`` is the entry the previous evaluation pushed (its ``Step.denoised``); ``earlier[k]`` the one pushed
    ``k + 2`` evaluations back (multistep samplers only; engines/numerics/multistep.py)."""

    sample: float = 0.0
    model: float = 0.0
    prev: float = 0.0
    noise: float = 0.0
    earlier: tuple[float, ...] = ()

    @property
    def history(self) -> tuple[float, ...]:
        """Coefficients of the history entries, most recent first (``prev`` first)."""
        return (self.prev, *self.earlier)

    def __add__(self, other: Lin) -> Lin:
        depth = max(len(self.earlier), len(other.earlier))
        mine, theirs = (x.earlier + (0.0,) * (depth - len(x.earlier)) for x in (self, other))
        return Lin(self.sample + other.sample, self.model + other.model, self.prev + other.prev,
                   self.noise + other.noise, tuple(a + b for a, b in zip(mine, theirs, strict=True)))

    def __mul__(self, k: float) -> Lin:
        return Lin(self.sample * k, self.model * k, self.prev * k, self.noise * k, tuple(e * k for e in self.earlier))

    __rmul__ = __mul__

    def __sub__(self, other: Lin) -> Lin:
        return self + other * -1.0


def hist(k: int) -> Lin:
    """The history entry pushed ``k`` evaluations back (``hist(1) == PREV``)."""
    return PREV if k == 1 else Lin(earlier=(0.0,) * (k - 2) + (1.0,))


SAMPLE = Lin(sample=1.0)
MODEL = Lin(model=1.0)
PREV = Lin(prev=1.0)
NOISE = Lin(noise=1.0)


@dataclass(frozen=True)
class Step:
    """One denoising step: what the UNet is fed and how its output is combined."""

    timestep: float
    """Value fed to the UNet's timestep input."""
    input_scale: float
    """The UNet input is ``sample * input_scale`` (Euler's ``scale_model_input``)."""
    next: Lin
    denoised: Lin
    """The history entry this evaluation pushes: the x0 estimate, except where a multistep sampler keeps another
    quantity (PLMS the model output, LMS the derivative)."""
    then: Step | None = None
    """A second UNet evaluation within the same step (Heun's corrector, PLMS's first step), at ``next``: its
    coefficients are over the basis after this evaluation (``next`` is its sample, ``denoised`` its ``prev``)."""

    def evaluations(self) -> tuple[Step, ...]:
        return (self, *(self.then.evaluations() if self.then is not None else ()))


@dataclass(frozen=True)
class SchedulePlan:
    """Everything one request needs: the initial noise scale and every step's coefficients."""

    init_noise_sigma: float
    steps: tuple[Step, ...]
    sigmas: tuple[float, ...] = ()
    """The noise level (VE sigma) at the start of each UNet evaluation, then the final one (0): one entry more
    than :meth:`evaluations` (the noise an edit adds at its first step and inpainting's blend after every
    evaluation, as diffusers blends after every timestep of its loop; Heun's and PLMS's steps hold two)."""
    ve: bool = False
    """How a clean sample x0 is noised to level sigma, as the scheduler's ``add_noise``: True ``x0 + sigma*noise``
    (the Euler family), False ``alpha*x0 + sigma_t*noise`` with alpha = 1/sqrt(sigma^2 + 1) (DDPM, DDIM, DPM)."""

    def noising(self, index: int) -> tuple[float, float]:
        """(a, b) of ``add_noise``: the sample at the start of evaluation ``index`` (len(evaluations()): the end)
        is ``a*x0 + b*noise``."""
        sigma = self.sigmas[index]
        if self.ve:
            return 1.0, sigma
        alpha = 1.0 / (sigma * sigma + 1.0) ** 0.5
        return alpha, sigma * alpha

    def sliced(self, start: int) -> SchedulePlan:
        """The plan from step ``start`` on (diffusers' ``get_timesteps``: img2img and inpainting skip the first
        steps; the sampler's own history must already restart there, see schedulers.make_plan)."""
        if not start:
            return self
        first = sum(len(step.evaluations()) for step in self.steps[:start])
        return SchedulePlan(self.init_noise_sigma, self.steps[start:], self.sigmas[first:], self.ve)

    def evaluations(self) -> tuple[tuple[Step, bool], ...]:
        """Every UNet evaluation in order, each with whether it completes a step (for progress and interrupts)."""
        out: list[tuple[Step, bool]] = []
        for step in self.steps:
            evals = step.evaluations()
            out += [(e, k == len(evals) - 1) for k, e in enumerate(evals)]
        return tuple(out)

    @property
    def history(self) -> int:
        """History entries the plan reads (1 for the single-history samplers): the step graph's depth."""
        depth = 1
        for step, _ in self.evaluations():
            for lin in (step.next, step.denoised):
                used = [k + 1 for k, c in enumerate(lin.history) if c]
                depth = max(depth, *used) if used else depth
        return depth


class Schedule(Protocol):
    """What a sampler reads of the training noise schedule (engines/numerics/schedulers.py NoiseSchedule)."""

    @property
    def alphas_cumprod(self) -> np.ndarray: ...
    @property
    def prediction_type(self) -> str: ...
    @property
    def steps_offset(self) -> int: ...
    @property
    def set_alpha_to_one(self) -> bool: ...
    @property
    def num_train_timesteps(self) -> int: ...
    def spacing(self, default: str) -> str: ...
    def denoised(self, sigma: float, sample_scale: float) -> Lin:
        """x0 estimate at noise level ``sigma`` where the VP sample is ``sample_scale * sample``."""
        ...
