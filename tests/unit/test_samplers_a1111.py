"""The A1111 samplers and schedule types vs diffusers' schedulers of the same name and config, step by step on random
model outputs (and, for the stochastic ones, the same per-step noise); the A1111 name mapping over HTTP."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.config import SCHEDULER_NAMES
from engines.numerics.schedulers import SCHEDULERS, SIGMA_SCHEDULES, NoiseSchedule, make_plan
from server.app import create_app
from server.routes.a1111 import SCHEDULES, UNSERVED, resolve_sampler
from server.settings import load_settings
from tests.unit.fakes import FakeEngine
from tests.unit.scheduler_oracle import trajectory_errors

BASE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
        "steps_offset": 1, "set_alpha_to_one": False, "clip_sample": False}
SAMPLER_CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {}),
    "dpmpp_2m_sde": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    "dpmpp_2m_sde_heun": ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++", "solver_type": "heun"}),
}
SCHEDULE_CONFIGS: dict[str, dict[str, object]] = {
    # diffusers docs/source/en/api/schedulers/overview.md, "Noise schedules and schedule types"
    "": {},
    "karras": {"use_karras_sigmas": True},
    "exponential": {"use_exponential_sigmas": True, "timestep_spacing": "linspace"},
    "uniform": {"timestep_spacing": "linspace"},
    "sgm_uniform": {"timestep_spacing": "trailing"},
}
NEW = [(s, k) for s in SAMPLER_CONFIGS for k in SCHEDULE_CONFIGS if k or s.startswith("dpmpp_2m_sde")]
"""Every (sampler, schedule) this module adds; tests/unit/test_schedulers.py covers the four plain originals."""
STEP_TOLERANCE = 2e-5
"""Per step, relative to the sample's magnitude, as in tests/unit/test_schedulers.py: float32 (diffusers) vs float64
(ours) agree to ~1e-6; a sigma 0.2% off moves a step by ~1e-3."""


def _name(sampler: str, schedule: str) -> str:
    return f"{sampler}_{schedule}" if schedule else sampler


def _diffusers(sampler: str, schedule: str, config: dict[str, object], steps: int) -> Any:
    """diffusers' scheduler for (sampler, schedule), timesteps set. EulerAncestralDiscreteScheduler has no Karras or
    exponential option: it gets the sigmas and timesteps EulerDiscreteScheduler computes for that option."""
    import diffusers

    cls, extra = SAMPLER_CONFIGS[sampler]
    full = {**config, **extra, **SCHEDULE_CONFIGS[schedule]}
    if sampler == "euler_a" and schedule in ("karras", "exponential"):
        theirs = diffusers.EulerAncestralDiscreteScheduler.from_config(
            {k: v for k, v in full.items() if not k.startswith("use_")})
        theirs.set_timesteps(steps)
        euler = diffusers.EulerDiscreteScheduler.from_config(full)
        euler.set_timesteps(steps)
        assert euler.config.use_karras_sigmas or euler.config.use_exponential_sigmas
        theirs.sigmas, theirs.timesteps = euler.sigmas, euler.timesteps
        return theirs
    theirs = getattr(diffusers, cls).from_config(full)
    theirs.set_timesteps(steps)
    return theirs


@pytest.mark.parametrize(("sampler", "schedule"), NEW)
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps", [7, 20])
def test_trajectory_matches_diffusers_at_every_step(sampler: str, schedule: str, spacing: str, prediction: str,
                                                    steps: int) -> None:
    """``spacing`` is the model's scheduler_config; a schedule suffix may override it, as its diffusers config does."""
    config = {**BASE, "timestep_spacing": spacing, "prediction_type": prediction}
    plan = make_plan(_name(sampler, schedule), NoiseSchedule.from_config(config), steps)
    errors = trajectory_errors(_diffusers(sampler, schedule, config, steps), plan)
    worst = max(range(len(errors)), key=errors.__getitem__)
    assert errors[worst] < STEP_TOLERANCE, f"entry {worst} of {len(errors)} off by {errors[worst]:.2e}"


@pytest.mark.parametrize(("sampler", "schedule"), NEW)
def test_a_sigma_off_by_0_2_percent_fails_the_comparison(sampler: str, schedule: str) -> None:
    """The bound above is tight enough to matter: the same comparison with every training sigma 0.2% too large (so
    every Karras/exponential/spaced sigma too) fails for every new sampler and schedule."""
    config = {**BASE, "timestep_spacing": "leading"}
    schedule_ = NoiseSchedule.from_config(config)
    sigmas = schedule_.sigmas() * 1.002
    off = dataclasses.replace(schedule_, alphas_cumprod=(1.0 / (1.0 + sigmas**2)).astype(np.float32))
    plan = SCHEDULERS[_name(sampler, schedule)](off, 20)
    assert max(trajectory_errors(_diffusers(sampler, schedule, config, 20), plan)) > 10 * STEP_TOLERANCE


def test_the_sde_samplers_add_noise_every_step_but_the_last() -> None:
    for name in ("dpmpp_2m_sde", "dpmpp_2m_sde_heun_karras"):
        plan = make_plan(name, NoiseSchedule.from_config(BASE), 10)
        assert all(s.next.noise > 0 for s in plan.steps[:-1]) and plan.steps[-1].next.noise == 0, name


def test_the_config_names_are_the_implemented_names_in_order() -> None:
    assert tuple(SCHEDULERS) == SCHEDULER_NAMES
    assert {k for k in SCHEDULE_CONFIGS if k} == set(SIGMA_SCHEDULES)


def test_the_module_docstring_says_why_each_unserved_sampler_is_refused() -> None:
    import engines.numerics.schedulers as module

    doc = module.__doc__ or ""
    for name in ("lms", "plms", "unipc", "heun", "dpm2", "dpmpp_sde", "dpmpp_2s_a", "dpmpp_3m_sde", "dpm_fast",
                 "restart", "ddim_cfgpp", "lcm"):
        assert f"- {name}" in doc or f"/ {name}" in doc, name


# The A1111 route.


@pytest.fixture
def client() -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    with TestClient(create_app(engine, load_settings("dev"))) as c:
        deadline = time.monotonic() + 10  # the engine loads in the background; a generous bound
        while c.get("/ready").json()["state"] != "ready":
            assert time.monotonic() < deadline, "the fake engine never became ready"
            time.sleep(0.02)
        yield c, engine


def test_every_listed_sampler_and_schedule_maps_to_a_plan(client: tuple[TestClient, FakeEngine]) -> None:
    http, _ = client
    listed = http.get("/sdapi/v1/samplers").json()
    assert [s["name"] for s in listed][:4] == ["Euler", "Euler a", "DDIM", "DPM++ 2M"]
    schedule = NoiseSchedule.from_config(BASE)
    for entry in listed:
        for name in (entry["name"], *entry["aliases"]):
            for label in (["Automatic"] if entry["name"] in ("DDIM", "PLMS") else list(SCHEDULES)):
                ours = resolve_sampler(name, label)
                assert len(make_plan(ours, schedule, 5).steps) == 5, (name, label, ours)


@pytest.mark.parametrize(("sampler", "scheduler", "ours", "label"), [
    ("DPM++ 2M", "Automatic", "dpmpp_2m_karras", "DPM++ 2M"),  # A1111's default schedule for DPM++ 2M
    ("DPM++ 2M", None, "dpmpp_2m_karras", "DPM++ 2M"),
    ("DPM++ 2M", "Uniform", "dpmpp_2m_uniform", "DPM++ 2M"),
    ("DPM++ 2M Karras", None, "dpmpp_2m_karras", "DPM++ 2M"),  # the legacy combined name
    ("DPM++ 2M SDE", "automatic", "dpmpp_2m_sde_exponential", "DPM++ 2M SDE"),
    ("DPM++ 2M SDE Karras", "Exponential", "dpmpp_2m_sde_karras", "DPM++ 2M SDE"),  # the name's schedule wins
    ("DPM++ 2M SDE Heun", "karras", "dpmpp_2m_sde_heun_karras", "DPM++ 2M SDE Heun"),
    ("Euler", "Automatic", "euler", "Euler"),
    ("Euler a", "SGM Uniform", "euler_a_sgm_uniform", "Euler a"),
    ("k_euler_a", "Exponential", "euler_a_exponential", "Euler a"),
    ("Euler Karras", None, "euler_karras", "Euler"),
    ("DDIM", "Automatic", "ddim", "DDIM"),
    ("LMS", "Karras", "lms_karras", "LMS"),
    ("k_heun", None, "heun", "Heun"),
    ("UniPC", "SGM Uniform", "unipc_sgm_uniform", "UniPC"),
    ("PLMS", "Automatic", "plms", "PLMS"),
])
def test_a1111_names_reach_the_engine_as_our_scheduler(client: tuple[TestClient, FakeEngine], sampler: str,
                                                      scheduler: str | None, ours: str, label: str) -> None:
    http, engine = client
    body: dict[str, object] = {"prompt": "a", "steps": 3, "width": 64, "height": 64, "sampler_name": sampler}
    if scheduler is not None:
        body["scheduler"] = scheduler
    response = http.post("/sdapi/v1/txt2img", json=body)
    assert response.status_code == 200, response.text
    assert engine.batches[-1].scheduler == ours
    assert json.loads(response.json()["info"])["sampler_name"] == label


@pytest.mark.parametrize(("body", "param", "fragments"), [
    ({"sampler_name": "DPM2"}, "sampler_name", ["'DPM2'", "does not implement", "'DPM++ 2M SDE'", "'Heun'"]),
    ({"sampler_name": "DPM2 a Karras"}, "sampler_name", ["unknown sampler 'DPM2 a Karras'", "'Euler a'"]),
    ({"sampler_name": "DPM++ 3M SDE"}, "sampler_name", ["'DPM++ 3M SDE'", "'DDIM'", "'UniPC'"]),
    ({"sampler_name": "Restart"}, "sampler_name", ["varying number of times per step", "'Euler'"]),
    ({"sampler_name": "DPM++ SDE Karras"}, "sampler_name", ["'DPM++ SDE Karras'", "'DPM++ 2M'"]),
    ({"scheduler": "Karras"}, "scheduler", ["needs a sampler_name"]),
])
def test_a1111_refuses_unserved_samplers_with_422_listing_the_served(
        client: tuple[TestClient, FakeEngine], body: dict[str, object], param: str, fragments: list[str]) -> None:
    http, engine = client
    before = len(engine.batches)
    response = http.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 3, "width": 64, "height": 64, **body})
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"][-1] == param
    for fragment in fragments:
        assert fragment in detail["msg"]
    assert len(engine.batches) == before


@pytest.mark.parametrize(("body", "ours", "fragments"), [
    ({"sampler_name": "PLMS", "scheduler": "Karras"}, "plms", ["for PLMS", "takes no schedule type"]),
    ({"sampler_name": "Euler", "scheduler": "Beta"}, "euler", ["'Beta'", "'SGM Uniform'"]),
    ({"sampler_name": "DPM++ 2M Align Your Steps"}, "dpmpp_2m_karras", ["'Align Your Steps'", "'Karras'"]),
    ({"sampler_name": "DDIM", "scheduler": "Karras"}, "ddim", ["for DDIM", "used Automatic"]),
])
def test_a1111_schedules_a_sampler_cannot_use_fall_back_to_automatic_named(
        client: tuple[TestClient, FakeEngine], body: dict[str, object], ours: str, fragments: list[str]) -> None:
    """As A1111's get_sampler_and_scheduler: a schedule it cannot use means Automatic; sdserve says so."""
    http, engine = client
    response = http.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 3, "width": 64, "height": 64, **body})
    assert response.status_code == 200, response.text
    assert engine.batches[-1].scheduler == ours
    warning = next(w for w in json.loads(response.json()["info"])["warnings"] if "ignored for" in w)
    assert all(fragment in warning for fragment in fragments), warning


def test_every_unserved_a1111_sampler_is_refused_not_mapped() -> None:
    from engines.errors import InvalidRequestError

    for name in UNSERVED:
        with pytest.raises(InvalidRequestError, match="does not implement") as info:
            resolve_sampler(name)
        assert info.value.param == "sampler_name"


@pytest.mark.parametrize("name", ["dpm2", "pndm", "dpmpp_3m_sde", "plms_karras", "dpmpp_sde", "ddim_karras"])
def test_openai_route_refuses_unserved_schedulers_with_400_listing_the_served(
        client: tuple[TestClient, FakeEngine], name: str) -> None:
    http, engine = client
    before = len(engine.batches)
    response = http.post("/v1/images/generations", json={"prompt": "a", "size": "64x64", "scheduler": name})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "scheduler" and repr(name) in error["message"]
    assert "'dpmpp_2m_sde_heun_karras'" in error["message"] and "'euler'" in error["message"]
    assert len(engine.batches) == before


def test_openai_route_accepts_every_scheduler_name(client: tuple[TestClient, FakeEngine]) -> None:
    http, engine = client
    for name in SCHEDULER_NAMES:
        response = http.post("/v1/images/generations", json={"prompt": "a", "size": "64x64", "scheduler": name,
                                                             "steps": 2})
        assert response.status_code == 200, (name, response.text)
        assert engine.batches[-1].scheduler == name
