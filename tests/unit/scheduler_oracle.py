"""The one step-parity oracle for every sampler: our SchedulePlan and a diffusers scheduler run side by side on the
same random model outputs and, for stochastic samplers, the same per-step noise (twin torch generators: diffusers
draws it with randn_tensor -> torch.randn). Used by test_schedulers.py, test_samplers_a1111.py and
test_samplers_multistep.py."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from engines.numerics.plan import Lin, SchedulePlan


def apply(lin: Lin, x: np.ndarray, out: np.ndarray, history: list[np.ndarray], noise: np.ndarray) -> np.ndarray:
    """One linear combination of the step basis, history entries most recent first (``prev`` first)."""
    total = lin.sample * x + lin.model * out + lin.noise * noise
    for coeff, entry in zip(lin.history, history, strict=False):
        total = total + coeff * entry
    return np.asarray(total)


def trajectory_errors(theirs: Any, plan: SchedulePlan) -> list[float]:
    """Every entry a relative error: timesteps, init sigma, then per UNet evaluation the input scale and
    max |ours - theirs| over max(1, |ours|). ``[inf]`` when the evaluation counts differ."""
    evals = plan.evaluations()
    their_t = theirs.timesteps.numpy().astype(np.float64)
    ours_t = np.array([s.timestep for s, _ in evals])
    if len(ours_t) != len(their_t):
        return [float("inf")]
    errors = [float(np.abs(ours_t - their_t).max() / max(1.0, float(np.abs(their_t).max()))),
              abs(plan.init_noise_sigma - float(theirs.init_noise_sigma)) / float(theirs.init_noise_sigma)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 8, 8)) * plan.init_noise_sigma
    history: list[np.ndarray] = []
    x_t = torch.from_numpy(x.astype(np.float32))
    their_noise, our_noise = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    takes_generator = "generator" in inspect.signature(theirs.step).parameters
    for i, (step, _) in enumerate(evals):
        out = rng.standard_normal(x.shape)
        scaled = theirs.scale_model_input(x_t, theirs.timesteps[i])
        errors.append(abs(float((scaled.numpy() / x_t.numpy()).mean()) - step.input_scale) / step.input_scale)
        extra = {"generator": their_noise} if takes_generator else {}
        x_t = theirs.step(torch.from_numpy(out.astype(np.float32)), theirs.timesteps[i], x_t, **extra).prev_sample
        noise = (torch.randn(x.shape, generator=our_noise, dtype=torch.float32).numpy().astype(np.float64)
                 if step.next.noise else np.zeros_like(x))
        x, pushed = apply(step.next, x, out, history, noise), apply(step.denoised, x, out, history, noise)
        history.insert(0, pushed)
        errors.append(float(np.abs(x - x_t.numpy()).max()) / max(1.0, float(np.abs(x).max())))
    return errors
