"""The flow samplers' plans (engines/numerics/flow_samplers.py) vs diffusers' flow schedulers stepped on fixed
inputs: the same sigmas, the same model (a fixed linear map of the sample), the same step noise; the sigma
schedules diffusers' flow schedulers make from Flux's sigmas and ``mu`` vs ours; and the sampler step graph run by
ONNX Runtime's CPU provider (onnxruntime/core/providers/cpu/math/matmul.cc) vs the plan's arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort
import pytest
import torch

from engines.numerics.flow_samplers import (
    FLOW_SAMPLERS,
    HISTORY,
    UNIPC_EPS,
    build_flow_sampler_graph,
    flow_plan,
    sampler_coefficients,
)
from engines.numerics.flow_schedule import FlowMatchConfig, FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.plan import Lin, SchedulePlan

SHAPE = (2, 4, 6, 6)
MU = 0.93
STATIC = FlowMatchConfig(shift=3.0)
DYNAMIC = FlowMatchConfig(use_dynamic_shifting=True, shift=3.0)


def _schedule(dynamic: bool, steps: int) -> FlowSchedule:
    return flow_schedule(DYNAMIC, steps, sigmas=flux_sigmas(steps), mu=MU) if dynamic else flow_schedule(STATIC, steps)


def _model() -> Callable[[np.ndarray, float], np.ndarray]:
    """A fixed velocity field: a channel mix of the sample plus a sigma-dependent bias."""
    weights = np.random.default_rng(5).standard_normal((4, 4)) * 0.4
    return lambda x, sigma: np.einsum("ij,bjhw->bihw", weights, x) + sigma * 0.3 - 0.1


def _run_plan(plan: SchedulePlan, x: np.ndarray, noise: list[np.ndarray]) -> np.ndarray:
    """Evaluate a plan in float64: each step's ``next`` and pushed ``denoised`` over the basis."""
    model = _model()
    sigmas = plan.sigmas
    history = [np.zeros_like(x) for _ in range(HISTORY)]
    for i, step in enumerate(plan.steps):
        basis = (x, model(x, sigmas[i]), history, noise[i])
        x, pushed = _value(step.next, basis), _value(step.denoised, basis)
        history = [pushed, *history[:-1]]
    return x


def _value(lin: Lin, basis: tuple[np.ndarray, np.ndarray, list[np.ndarray], np.ndarray]) -> np.ndarray:
    x, v, history, noise = basis
    earlier = sum((c * history[k + 1] for k, c in enumerate(lin.earlier)), np.zeros_like(x))
    return lin.sample * x + lin.model * v + lin.prev * history[0] + lin.noise * noise + earlier


def _run_diffusers(scheduler: object, sigmas: np.ndarray | None, x: np.ndarray,
                   noise: list[np.ndarray], monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """diffusers' step loop (its sigmas replaced by ``sigmas`` when given), step noise answered from ``noise``."""
    import diffusers.schedulers.scheduling_flow_match_euler_discrete as flow_module

    draws = iter(noise)
    monkeypatch.setattr(flow_module, "randn_tensor", lambda shape, **_: torch.from_numpy(next(draws)))
    if sigmas is not None:
        scheduler.sigmas = torch.from_numpy(sigmas.astype(np.float32))  # type: ignore[attr-defined]
    model = _model()
    sample = torch.from_numpy(x)
    for i, t in enumerate(scheduler.timesteps):  # type: ignore[attr-defined]
        sigma = float(scheduler.sigmas[i])  # type: ignore[attr-defined]
        v = torch.from_numpy(model(sample.numpy(), sigma))
        sample = scheduler.step(v, t, sample).prev_sample  # type: ignore[attr-defined]
    return sample.numpy()


@pytest.mark.parametrize("steps", [1, 2, 5, 9])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("sampler", ["euler_a", "dpmpp_2m", "unipc"])
def test_plan_steps_as_diffusers(sampler: str, dynamic: bool, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers

    schedule = _schedule(dynamic, steps)
    rng = np.random.default_rng(steps)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    noise = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(steps)]
    flow = {"use_flow_sigmas": True, "prediction_type": "flow_prediction"}
    replaced: np.ndarray | None = schedule.sigmas
    if sampler == "euler_a":
        config = DYNAMIC if dynamic else STATIC
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=config.shift, stochastic_sampling=True,
                                                              use_dynamic_shifting=dynamic)
        scheduler.set_timesteps(steps, sigmas=flux_sigmas(steps) if dynamic else None, mu=MU if dynamic else None)
        np.testing.assert_array_equal(scheduler.sigmas.numpy(), schedule.sigmas)  # the very schedule we serve
        replaced = None
    elif sampler == "dpmpp_2m":
        scheduler = diffusers.DPMSolverMultistepScheduler(**flow)
        scheduler.set_timesteps(steps)
    elif dynamic:  # UniPC takes Flux's sigmas and mu itself: its schedule is ours, first sigma lowered by 1e-6
        scheduler = diffusers.UniPCMultistepScheduler(**flow, use_dynamic_shifting=True)
        scheduler.set_timesteps(sigmas=flux_sigmas(steps), mu=MU)
        theirs = scheduler.sigmas.numpy()
        np.testing.assert_allclose(theirs[1:], schedule.sigmas[1:], rtol=1e-6, atol=1e-7)
        assert theirs[0] == np.float32(schedule.sigmas[0] - UNIPC_EPS)
        replaced = None
    else:
        scheduler = diffusers.UniPCMultistepScheduler(**flow, flow_shift=STATIC.shift)
        scheduler.set_timesteps(steps)
        replaced = schedule.sigmas.astype(np.float64)
        replaced[0] -= UNIPC_EPS if abs(replaced[0] - 1) < UNIPC_EPS else 0.0
    theirs = _run_diffusers(scheduler, replaced, x.copy(), noise, monkeypatch)
    ours = _run_plan(flow_plan(sampler, schedule.sigmas), x.astype(np.float64), [n.astype(np.float64) for n in noise])
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_the_samplers_differ_and_only_euler_a_draws_noise() -> None:
    sigmas = _schedule(True, 6).sigmas
    x = np.random.default_rng(1).standard_normal(SHAPE)
    noise = [np.random.default_rng(2 + i).standard_normal(SHAPE) for i in range(6)]
    results = {name: _run_plan(flow_plan(name, sigmas), x, noise) for name in ("euler_a", "dpmpp_2m", "unipc")}
    assert min(np.abs(a - b).max() for k, a in results.items() for j, b in results.items() if k < j) > 1e-3
    assert [bool(s.next.noise) for s in flow_plan("euler_a", sigmas).steps] == [True] * 5 + [False]
    assert not any(s.next.noise for name in ("dpmpp_2m", "unipc") for s in flow_plan(name, sigmas).steps)
    assert FLOW_SAMPLERS[0] == "euler"
    with pytest.raises(ValueError, match="dpmpp_2m_karras"):
        flow_plan("dpmpp_2m_karras", sigmas)


@pytest.mark.parametrize(("packed", "cfg"), [(True, False), (False, True)], ids=["packed", "cfg"])
def test_the_step_graph_computes_the_plan(packed: bool, cfg: bool) -> None:
    """The ONNX step (float16 transformer IO) writes the plan's next sample and x0 estimate, both rows apart."""
    rng = np.random.default_rng(9)
    shape = (2, 16, 12) if packed else (2, 4, 6, 6)
    plan = flow_plan("unipc", _schedule(False, 5).sigmas)
    guidance = np.array([4.0, 1.0])
    coeffs = sampler_coefficients(plan, guidance, cfg)
    assert coeffs.shape == (5, 2, 2, 6) and coeffs.dtype == np.float32
    session = ort.InferenceSession(build_flow_sampler_graph(np.float16, np.float16, cfg, packed),
                                   providers=["CPUExecutionProvider"])
    sample, prev, prev2, noise = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    out = rng.standard_normal(((2 if cfg else 1) * shape[0], *shape[1:])).astype(np.float16)
    nxt, denoised, model_in = session.run(None, {"sample": sample, "model_out": out, "prev": prev, "noise": noise,
                                                 "prev2": prev2, "coeffs": coeffs[2]})
    uncond, text = (out[:2], out[2:]) if cfg else (out, out)
    step = plan.steps[2]
    assert step.next.earlier[0] and step.next.prev  # both history inputs are read
    for row, w in enumerate(guidance if cfg else np.ones(2)):
        w = max(float(w), 1.0)
        v = (1 - w) * uncond[row].astype(np.float64) + w * text[row].astype(np.float64)
        for lin, got in ((step.next, nxt[row]), (step.denoised, denoised[row])):
            want = lin.sample * sample[row] + lin.model * v + lin.prev * prev[row] + (*lin.earlier, 0.0)[0] * prev2[row]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert model_in.dtype == np.float16 and model_in.shape[0] == (4 if cfg else 2)
    np.testing.assert_allclose(model_in[: shape[0]].astype(np.float32), nxt, rtol=1e-3, atol=1e-3)

