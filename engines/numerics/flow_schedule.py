"""Flow-matching sampling as diffusers' ``FlowMatchEulerDiscreteScheduler`` does it, in numpy (no torch).

A flow-matching model predicts the velocity ``v = noise - x0`` at noise level ``sigma`` in [0, 1]; the sample at
``sigma`` is ``(1 - sigma) * x0 + sigma * noise`` and one Euler step moves it to the next level:
``x <- x + (sigma_next - sigma) * v``. The schedule is a list of sigmas falling to 0, bent towards the noisy end by
a *shift*:

- static (SD 3 / 3.5, Flux schnell): ``sigma' = shift * sigma / (1 + (shift - 1) * sigma)``;
- dynamic (Flux dev, Qwen-Image): ``sigma' = e^mu / (e^mu + (1 / sigma - 1))``, with ``mu`` a linear function of
  the image's token count (``calculate_shift``), so larger images are shifted more;
- then, with ``shift_terminal`` (Qwen-Image: 0.02), stretched so the last sigma is that value:
  ``1 - (1 - sigma') / ((1 - sigma'_last) / (1 - shift_terminal))``.

The arithmetic follows diffusers' dtypes step for step (float64 where it works in numpy float64, float32 where it
works in float32 tensors), so the timesteps and sigmas here equal diffusers' bit for bit (tests/unit/test_flow.py).
Options of the diffusers scheduler that change the schedule in other ways (Karras/exponential/beta sigmas, inverted
sigmas, stochastic sampling) are refused by name rather than ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.errors import InvalidRequestError

UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
               "stochastic_sampling")
"""FlowMatchEulerDiscreteScheduler options this module does not implement: a config setting one is refused."""


@dataclass(frozen=True)
class FlowMatchConfig:
    """The FlowMatchEulerDiscreteScheduler config fields that shape the schedule (scheduler_config.json)."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float = 0.5
    max_shift: float = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    time_shift_type: str = "exponential"
    shift_terminal: float = 0.0
    """The last sigma the shifted schedule is stretched to end at (0: no stretch)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FlowMatchConfig:
        """From a scheduler config dict; ValueError naming an option this module does not implement."""
        used = [key for key in UNSUPPORTED if config.get(key)]
        if used:
            raise ValueError(f"flow-matching scheduler options not supported: {', '.join(used)}")
        kind = str(config.get("time_shift_type", "exponential"))
        if kind not in ("exponential", "linear"):
            raise ValueError(f"time_shift_type {kind!r}: expected 'exponential' or 'linear'")
        defaults = cls()
        return cls(
            num_train_timesteps=int(config.get("num_train_timesteps", defaults.num_train_timesteps)),
            shift=float(config.get("shift", defaults.shift)),
            use_dynamic_shifting=bool(config.get("use_dynamic_shifting", False)),
            base_shift=float(config.get("base_shift") or defaults.base_shift),
            max_shift=float(config.get("max_shift") or defaults.max_shift),
            base_image_seq_len=int(config.get("base_image_seq_len", defaults.base_image_seq_len)),
            max_image_seq_len=int(config.get("max_image_seq_len", defaults.max_image_seq_len)),
            time_shift_type=kind, shift_terminal=float(config.get("shift_terminal") or 0.0))

    def mu(self, image_seq_len: int) -> float:
        """The dynamic shift for an image of ``image_seq_len`` transformer tokens, from this config's line."""
        return calculate_shift(image_seq_len, self.base_image_seq_len, self.max_image_seq_len, self.base_shift,
                               self.max_shift)


@dataclass(frozen=True)
class FlowSchedule:
    """One request's schedule: ``timesteps`` [steps] and ``sigmas`` [steps + 1] (ending in 0), both float32."""

    timesteps: np.ndarray
    sigmas: np.ndarray

    def __len__(self) -> int:
        return int(self.timesteps.shape[0])


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096, base_shift: float = 0.5,
                    max_shift: float = 1.15) -> float:
    """``mu`` on the line through (base_seq_len, base_shift) and (max_seq_len, max_shift), as Flux's pipeline."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def flux_sigmas(steps: int) -> np.ndarray:
    """The sigmas Flux's pipeline hands the scheduler before shifting: 1 down to 1/steps, evenly (float64)."""
    return np.linspace(1.0, 1.0 / steps, steps)


def _static_shift(shift: float, sigmas: np.ndarray) -> np.ndarray:
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _time_shift(config: FlowMatchConfig, mu: float, sigmas: np.ndarray) -> np.ndarray:
    if config.time_shift_type == "linear":
        return mu / (mu + (1 / sigmas - 1) ** 1.0)
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)


def _sigma_range(config: FlowMatchConfig) -> tuple[float, float]:
    """(sigma_max, sigma_min) of the training schedule, in float32 as the scheduler's constructor has them."""
    n = config.num_train_timesteps
    train = np.linspace(1, n, n, dtype=np.float32)[::-1] / np.float32(n)
    if not config.use_dynamic_shifting:
        train = _static_shift(config.shift, train)
    return float(train[0]), float(train[-1])


def flow_schedule(config: FlowMatchConfig, steps: int, sigmas: Sequence[float] | np.ndarray | None = None,
                  mu: float | None = None) -> FlowSchedule:
    """The schedule ``set_timesteps(steps, sigmas=sigmas, mu=mu)`` gives: ``sigmas`` given (Flux) are shifted in
    float32; otherwise the training range is spaced evenly and shifted in float64. ``mu`` is required with dynamic
    shifting and ignored without it."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if config.use_dynamic_shifting and mu is None:
        raise ValueError("this scheduler shifts by resolution (use_dynamic_shifting): mu is required")
    n = config.num_train_timesteps
    if sigmas is None:
        sigma_max, sigma_min = _sigma_range(config)
        base = np.linspace(sigma_max * n, sigma_min * n, steps) / n
    else:
        base = np.asarray(sigmas).astype(np.float32)
        if base.shape != (steps,):
            raise ValueError(f"{base.shape[0]} sigmas given for {steps} steps")
    shifted = _time_shift(config, float(mu), base) if config.use_dynamic_shifting and mu is not None \
        else _static_shift(config.shift, base)
    if config.shift_terminal:  # in the shifted sigmas' dtype, as the scheduler's stretch_shift_to_terminal
        one_minus = 1 - np.asarray(shifted)
        if not one_minus[-1]:  # one step at sigma 1: the scheduler divides 0 by 0 (diffusers' sigmas are NaN)
            raise InvalidRequestError(f"this model's schedule is stretched to shift_terminal "
                                      f"{config.shift_terminal}: it needs at least 2 steps, got {steps}",
                                      param="steps")
        shifted = 1 - one_minus / (one_minus[-1] / (1 - config.shift_terminal))
    sig32 = np.asarray(shifted).astype(np.float32)
    timesteps = sig32 * np.float32(n)
    return FlowSchedule(timesteps.astype(np.float32), np.concatenate([sig32, np.zeros(1, np.float32)]))


def euler_step(sample: np.ndarray, velocity: np.ndarray, sigma: float | np.floating[Any],
               sigma_next: float | np.floating[Any]) -> np.ndarray:
    """``sample + (sigma_next - sigma) * velocity`` in float32, the scheduler's ``step``."""
    dt = np.float32(sigma_next) - np.float32(sigma)
    out: np.ndarray = sample.astype(np.float32, copy=False) + dt * velocity.astype(np.float32, copy=False)
    return out
