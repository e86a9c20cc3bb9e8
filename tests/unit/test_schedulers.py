"""Scheduler plans vs diffusers' schedulers, step by step, on random model outputs (no network needed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engines.numerics.schedulers import NoiseSchedule, make_plan
from tests.unit.scheduler_oracle import trajectory_errors

BASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
        "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False}
CLASSES = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler", "ddim": "DDIMScheduler",
           "dpmpp_2m": "DPMSolverMultistepScheduler"}
STEP_TOLERANCE = 2e-5
"""Per step, relative to the sample's magnitude. Float32 (diffusers) vs float64 (ours) agree to ~1.5e-6; a sigma
0.2% off moves a step by ~1e-3, so this bound fails it (test_a_sigma_off_by_0_2_percent_fails_the_comparison)."""


def _step_errors(name: str, config: dict[str, object], steps: int,
                 schedule: NoiseSchedule | None = None) -> list[float]:
    """Run our plan and diffusers' scheduler side by side on the same random model outputs and, for Euler ancestral,
    the same per-step noise (twin torch generators: diffusers draws it with randn_tensor -> torch.randn); return
    each step's max |ours - theirs| over max(1, |ours|). Also checks timesteps, init sigma and input scales."""
    import diffusers

    theirs = getattr(diffusers, CLASSES[name]).from_config(config)
    theirs.set_timesteps(steps)
    plan = make_plan(name, schedule or NoiseSchedule.from_config(config), steps)
    assert [s.timestep for s in plan.steps] == pytest.approx(theirs.timesteps.numpy().astype(float).tolist())
    return trajectory_errors(theirs, plan)


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps", [7, 20])
def test_trajectory_matches_diffusers_at_every_step(name: str, spacing: str, prediction: str, steps: int) -> None:
    config = {**BASE, "timestep_spacing": spacing, "prediction_type": prediction}
    errors = _step_errors(name, config, steps)
    worst = max(range(len(errors)), key=errors.__getitem__)
    assert errors[worst] < STEP_TOLERANCE, f"entry {worst} of {len(errors)} off by {errors[worst]:.2e}"


def test_euler_ancestral_adds_noise_every_step_but_the_last() -> None:
    plan = make_plan("euler_a", NoiseSchedule.from_config(BASE), 10)
    assert all(s.next.noise > 0 for s in plan.steps[:-1]) and plan.steps[-1].next.noise == 0  # final sigma is 0


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_sigma_off_by_0_2_percent_fails_the_comparison(name: str) -> None:
    """The bound above is tight enough to matter: the same comparison on a schedule whose sigmas are 0.2% too
    large fails for every sampler."""
    config = {**BASE, "timestep_spacing": "leading"}
    schedule = NoiseSchedule.from_config(config)
    sigmas = schedule.sigmas() * 1.002
    off = dataclasses.replace(schedule, alphas_cumprod=(1.0 / (1.0 + sigmas**2)).astype(np.float32))
    assert max(_step_errors(name, config, 20, off)) > 10 * STEP_TOLERANCE


def test_defaulted_config_keys_use_each_samplers_default() -> None:
    """A config key listed in _use_default_values is unset: Euler falls back to linspace, DDIM to leading."""
    config = {**BASE, "timestep_spacing": "trailing", "_use_default_values": ["timestep_spacing"]}
    schedule = NoiseSchedule.from_config(config)
    assert make_plan("euler", schedule, 10).steps[0].timestep == pytest.approx(999.0)
    assert make_plan("ddim", schedule, 10).steps[0].timestep == pytest.approx(901.0)


def test_unknown_scheduler_names_the_field() -> None:
    from engines.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown scheduler 'pndm'") as info:
        make_plan("pndm", NoiseSchedule.from_config(BASE), 10)
    assert info.value.param == "scheduler"
