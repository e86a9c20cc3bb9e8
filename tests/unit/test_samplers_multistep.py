"""PLMS, LMS, UniPC and Heun (engines/numerics/multistep.py) vs diffusers' schedulers of the same config, evaluation
by evaluation on the same random model outputs; the history-carrying step graph vs a float64 reference."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engines.numerics.multistep import MAX_HISTORY
from engines.numerics.schedulers import SCHEDULERS, Lin, NoiseSchedule, SchedulePlan, Step, make_plan
from engines.numerics.step_graph import build_step_graph, step_coefficients
from tests.unit.scheduler_oracle import apply, trajectory_errors

BASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
        "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False}
CLASSES: dict[str, tuple[str, dict[str, object]]] = {
    "plms": ("PNDMScheduler", {"skip_prk_steps": True}),
    "lms": ("LMSDiscreteScheduler", {}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
}
SCHEDULE_CONFIGS: dict[str, dict[str, object]] = {
    # diffusers docs/source/en/api/schedulers/overview.md, "Noise schedules and schedule types"
    "": {}, "karras": {"use_karras_sigmas": True},
    "exponential": {"use_exponential_sigmas": True, "timestep_spacing": "linspace"},
    "uniform": {"timestep_spacing": "linspace"}, "sgm_uniform": {"timestep_spacing": "trailing"},
}
CASES = [(s, k) for s in CLASSES for k in SCHEDULE_CONFIGS if s != "plms" or not k]
"""PNDMScheduler has no Karras/exponential sigmas: PLMS, like DDIM, takes no schedule suffix."""
STEP_TOLERANCE = 2e-5
"""Per evaluation, relative to the sample's magnitude, as tests/unit/test_schedulers.py: float32 (diffusers) vs
float64 (ours) agree to ~1e-6; a coefficient 0.2% off moves a step by ~1e-3."""


def _name(sampler: str, schedule: str) -> str:
    return f"{sampler}_{schedule}" if schedule else sampler


def _diffusers(sampler: str, schedule: str, config: dict[str, object], steps: int) -> Any:
    import diffusers

    cls, extra = CLASSES[sampler]
    theirs = getattr(diffusers, cls).from_config({**config, **extra, **SCHEDULE_CONFIGS[schedule]})
    theirs.set_timesteps(steps)
    return theirs


@pytest.mark.parametrize(("sampler", "schedule"), CASES)
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps", [7, 20])
def test_trajectory_matches_diffusers_at_every_evaluation(sampler: str, schedule: str, spacing: str,
                                                          prediction: str, steps: int) -> None:
    config = {**BASE, "timestep_spacing": spacing, "prediction_type": prediction}
    plan = make_plan(_name(sampler, schedule), NoiseSchedule.from_config(config), steps)
    errors = trajectory_errors(_diffusers(sampler, schedule, config, steps), plan)
    worst = max(range(len(errors)), key=errors.__getitem__)
    assert errors[worst] < STEP_TOLERANCE, f"entry {worst} of {len(errors)} off by {errors[worst]:.2e}"


@pytest.mark.parametrize(("sampler", "schedule"), CASES)
def test_a_sigma_off_by_0_2_percent_fails_the_comparison(sampler: str, schedule: str) -> None:
    config = {**BASE, "timestep_spacing": "leading"}
    base = NoiseSchedule.from_config(config)
    sigmas = base.sigmas() * 1.002
    off = dataclasses.replace(base, alphas_cumprod=(1.0 / (1.0 + sigmas**2)).astype(np.float32))
    plan = SCHEDULERS[_name(sampler, schedule)](off, 20)
    assert max(trajectory_errors(_diffusers(sampler, schedule, config, 20), plan)) > 10 * STEP_TOLERANCE


def _history_off(step: Step) -> Step:
    """``step`` with its next-sample coefficients on the history entries 0.2% too large (recursively)."""
    lin = step.next
    nxt = dataclasses.replace(lin, prev=lin.prev * 1.002, earlier=tuple(c * 1.002 for c in lin.earlier))
    then = _history_off(step.then) if step.then is not None else None
    return dataclasses.replace(step, next=nxt, then=then)


@pytest.mark.parametrize("sampler", sorted(CLASSES))
def test_history_coefficients_off_by_0_2_percent_fail_the_comparison(sampler: str) -> None:
    """The multistep part has teeth too: the history terms alone, 0.2% off, fail for every sampler."""
    config = {**BASE, "timestep_spacing": "leading"}
    plan = make_plan(sampler, NoiseSchedule.from_config(config), 20)
    assert max(trajectory_errors(_diffusers(sampler, "", config, 20), plan)) < STEP_TOLERANCE
    off = SchedulePlan(plan.init_noise_sigma, tuple(_history_off(s) for s in plan.steps))
    assert max(trajectory_errors(_diffusers(sampler, "", config, 20), off)) > 10 * STEP_TOLERANCE


@pytest.mark.parametrize(("sampler", "evaluations", "history"),
                         [("plms", 11, 3), ("lms", 10, 3), ("unipc", 10, 2), ("heun", 19, 1)])
def test_plans_have_one_step_per_requested_step(sampler: str, evaluations: int, history: int) -> None:
    """Progress counts steps, not UNet calls: PLMS's first step and Heun's steps hold a second evaluation."""
    plan = make_plan(sampler, NoiseSchedule.from_config(BASE), 10)
    assert len(plan.steps) == 10
    assert len(plan.evaluations()) == evaluations
    assert [done for _, done in plan.evaluations()].count(True) == 10
    assert plan.history == history <= MAX_HISTORY


def test_single_history_samplers_keep_the_original_graph() -> None:
    for name in ("euler", "euler_a", "ddim", "dpmpp_2m", "dpmpp_2m_sde_heun_karras"):
        assert make_plan(name, NoiseSchedule.from_config(BASE), 10).history == 1, name


def test_step_coefficients_refuse_history_deeper_than_the_graph() -> None:
    with pytest.raises(ValueError, match="history entry 3"):
        step_coefficients(Lin(earlier=(0.0, 0.5)), Lin(), np.ones(1), history=2)


@pytest.mark.parametrize("cfg", [True, False])
def test_history_step_graph_matches_a_float64_reference(cfg: bool) -> None:
    """The K-history graph on ORT's CPU provider: every history input lands in its coefficient column."""
    rng = np.random.default_rng(3)
    b, shape = 2, (2, 4, 8, 8)
    lin = Lin(0.9, -0.3, 0.2, 0.0, (-0.15, 0.05))
    den = Lin(1.1, -0.5, 0.0, 0.0, (0.0, 0.25))
    guidance = np.array([7.5, 3.0]) if cfg else np.ones(b)
    rows = 2 * b if cfg else b
    feeds = {"sample": rng.standard_normal(shape), "model_out": rng.standard_normal((rows, *shape[1:])),
             **{name: rng.standard_normal(shape) for name in ("prev", "prev2", "prev3")}, "noise": np.zeros(shape)}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    session = ort.InferenceSession(build_step_graph(np.float32, np.float32, cfg=cfg, history=3),
                                   providers=["CPUExecutionProvider"])
    nxt, pushed, _ = session.run(None, {**feeds, "coeffs": step_coefficients(lin, den, guidance, 3),
                                        "in_scale": np.ones(1, np.float32)})
    parts = np.split(feeds["model_out"].astype(np.float64), 2) if cfg else [feeds["model_out"]] * 2
    model = (1 - guidance[:, None, None, None]) * parts[0] + guidance[:, None, None, None] * parts[1]
    history = [feeds[k].astype(np.float64) for k in ("prev", "prev2", "prev3")]
    for got, want in ((nxt, lin), (pushed, den)):
        ref = apply(want, feeds["sample"].astype(np.float64), model, history, np.zeros_like(model))
        assert float(np.abs(got - ref).max()) < 1e-5 * float(np.abs(ref).max())
