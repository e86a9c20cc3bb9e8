"""Scheduler plans vs diffusers' schedulers, step by step, on random model outputs (no network needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engines.diffusion.schedulers import NoiseSchedule, make_plan

BASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
        "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False}
CLASSES = {"euler": "EulerDiscreteScheduler", "ddim": "DDIMScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler"}


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps", [7, 20])
def test_trajectory_matches_diffusers(name: str, spacing: str, prediction: str, steps: int) -> None:
    import diffusers

    config = {**BASE, "timestep_spacing": spacing, "prediction_type": prediction}
    theirs = getattr(diffusers, CLASSES[name]).from_config(config)
    theirs.set_timesteps(steps)
    plan = make_plan(name, NoiseSchedule.from_config(config), steps)
    assert [s.timestep for s in plan.steps] == pytest.approx(theirs.timesteps.numpy().astype(float).tolist())
    assert plan.init_noise_sigma == pytest.approx(float(theirs.init_noise_sigma), rel=1e-5)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 8, 8)) * plan.init_noise_sigma
    prev = np.zeros_like(x)
    x_t = torch.from_numpy(x.astype(np.float32))
    for i, step in enumerate(plan.steps):
        out = rng.standard_normal(x.shape)
        scaled = theirs.scale_model_input(x_t, theirs.timesteps[i])
        assert (scaled.numpy() / x_t.numpy()).mean() == pytest.approx(step.input_scale, rel=1e-5)
        x_t = theirs.step(torch.from_numpy(out.astype(np.float32)), theirs.timesteps[i], x_t).prev_sample
        nxt, den = step.next, step.denoised
        x, prev = nxt.sample * x + nxt.model * out + nxt.prev * prev, den.sample * x + den.model * out
    assert np.abs(x - x_t.numpy()).max() < 1e-3 * max(1.0, float(np.abs(x).max()))


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
