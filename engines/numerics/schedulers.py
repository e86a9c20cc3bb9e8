"""Samplers without torch: each step is a linear combination of device tensors.

For Euler, Euler ancestral, DDIM and DPM-Solver++ 2M / 2M SDE (as diffusers implements them), one denoising step is

    next     = a*sample + b*model_output + c*prev_denoised + d*noise
    denoised = e*sample + f*model_output + g*prev_denoised

with scalars that depend only on the step. The host computes those scalars here (a :class:`SchedulePlan`); the
pipeline applies them on the device with one small ONNX graph, so latents never leave the device between UNet calls.
Classifier-free guidance is linear too: ``model_output = (1 - w)*uncond + w*text``, expanded per image by the pipeline.

A plan is computed per request and holds no mutable state, so concurrent requests never share scheduler state.

Names: a sampler (``euler``, ``euler_a``, ``ddim``, ``dpmpp_2m``, ``dpmpp_2m_sde``, ``dpmpp_2m_sde_heun``, ``plms``,
``lms``, ``unipc``, ``heun``), then optionally a sigma schedule as diffusers' scheduler-overview table maps A1111's
schedule types (docs/source/en/api/schedulers/overview.md): ``_karras`` (``use_karras_sigmas=True``),
``_exponential`` (``use_exponential_sigmas=True``, ``timestep_spacing="linspace"``), ``_uniform``
(``timestep_spacing="linspace"``), ``_sgm_uniform`` (``timestep_spacing="trailing"``). Without a suffix the model's
own ``scheduler_config.json`` decides. DDIM and PLMS take no suffix. diffusers' EulerAncestralDiscreteScheduler has no
Karras/exponential option: ``euler_a_karras`` and ``euler_a_exponential`` run its ancestral step on the sigmas
EulerDiscreteScheduler computes for that option.

Served by engines/numerics/multistep.py, reading up to 3 earlier history entries (``Lin.earlier``) or running a
second UNet evaluation within a step (``Step.then``):
- plms / lms / unipc / heun: PNDMScheduler (skip_prk_steps), LMSDiscreteScheduler, UniPCMultistepScheduler, Heun.

Every sampler here serves edits (img2img, inpainting) as diffusers' pipelines run it from a later step.

Not served (yet), and why:
- dpm2 / dpm2_a: KDPM2(Ancestral)DiscreteScheduler evaluate at a midpoint sigma (servable like heun; not done yet).
- dpmpp_sde: DPMSolverSDEScheduler draws its noise from a torchsde Brownian tree, which parity would need.
- dpmpp_2s_a: DPM++ 2S ancestral (single-step, second order) calls the model twice per step (not done yet).
- dpmpp_3m_sde: third order, needs the x0 estimates of the two previous steps (servable; not done yet).
- dpm_fast / dpm_adaptive / restart: variable or repeated model calls per step (adaptive step size, restarts).
- ddim_cfgpp: DDIM CFG++ re-noises with the unconditional prediction alone, a basis coefficient outside ``Lin``.
- lcm: linear, but meaningful only for LCM-distilled weights, which the served model families do not include.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from engines.errors import InvalidRequestError
from engines.numerics import multistep
from engines.numerics.plan import NOISE, PREV, SAMPLE
from engines.numerics.plan import Lin as Lin  # re-exported: callers and tests import the plan types from here
from engines.numerics.plan import SchedulePlan as SchedulePlan
from engines.numerics.plan import Step as Step


@dataclass(frozen=True)
class NoiseSchedule:
    """The training noise schedule and spacing options read from ``scheduler/scheduler_config.json``."""

    alphas_cumprod: np.ndarray
    prediction_type: str
    timestep_spacing: str | None
    """None when the config does not set it: each sampler then uses its own default, as diffusers does."""
    steps_offset: int
    set_alpha_to_one: bool

    @property
    def num_train_timesteps(self) -> int:
        return len(self.alphas_cumprod)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NoiseSchedule:
        # diffusers' from_config treats keys listed in _use_default_values as unset (the saving class's
        # defaults, not a choice), so the loading scheduler's own default applies. Same here.
        defaulted = set(config.get("_use_default_values", ()))
        config = {k: v for k, v in config.items() if k not in defaulted}
        n = int(config.get("num_train_timesteps", 1000))
        b0, b1 = float(config.get("beta_start", 0.00085)), float(config.get("beta_end", 0.012))
        kind = config.get("beta_schedule", "scaled_linear")
        # float32 throughout, as diffusers computes it, so sigmas match to the last bit or two.
        if kind == "scaled_linear":
            betas = np.linspace(b0**0.5, b1**0.5, n, dtype=np.float32) ** 2
        elif kind == "linear":
            betas = np.linspace(b0, b1, n, dtype=np.float32)
        else:
            raise ValueError(f"scheduler_config.json: beta_schedule {kind!r} is not supported "
                             "(use 'scaled_linear' or 'linear')")
        prediction = config.get("prediction_type", "epsilon")
        if prediction not in ("epsilon", "v_prediction"):
            raise ValueError(f"scheduler_config.json: prediction_type {prediction!r} is not supported")
        spacing = config.get("timestep_spacing")
        if spacing not in (None, "leading", "linspace", "trailing"):
            raise ValueError(f"scheduler_config.json: timestep_spacing {spacing!r} is not supported")
        acp = np.cumprod(np.float32(1.0) - betas, dtype=np.float32)
        return cls(acp, prediction, spacing, int(config.get("steps_offset", 0)),
                   bool(config.get("set_alpha_to_one", False)))

    def spacing(self, default: str) -> str:
        return self.timestep_spacing or default

    def sigmas(self) -> np.ndarray:
        acp = self.alphas_cumprod
        return np.asarray(((1 - acp) / acp) ** 0.5)

    def denoised(self, sigma: float, sample_scale: float) -> Lin:
        """x0 estimate at noise level ``sigma`` where the VP sample is ``sample_scale * sample``."""
        a = 1.0 / math.sqrt(sigma * sigma + 1.0)
        s = sigma * a
        if self.prediction_type == "epsilon":
            return Lin(sample=sample_scale / a, model=-s / a)
        return Lin(sample=a * sample_scale, model=-s)  # v_prediction


def _float_timesteps(schedule: NoiseSchedule, n: int) -> np.ndarray:
    """Euler-family spacing (float timesteps, descending)."""
    total = schedule.num_train_timesteps
    spacing = schedule.spacing("linspace")
    if spacing == "linspace":
        return np.linspace(0, total - 1, n, dtype=np.float32)[::-1].copy()
    if spacing == "leading":
        ratio = total // n
        return (np.arange(0, n) * ratio).round()[::-1].astype(np.float32) + schedule.steps_offset
    return np.arange(total, 0, -total / n).round().astype(np.float32) - 1


def _karras(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """Karras et al. (2022) eq. 5 with rho 7, as diffusers' ``_convert_to_karras``."""
    ramp = np.linspace(0, 1, n)
    lo, hi = sigma_min ** (1 / 7.0), sigma_max ** (1 / 7.0)
    return np.asarray((hi + ramp * (lo - hi)) ** 7.0)


def _exponential(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """Evenly spaced in log sigma, as diffusers' ``_convert_to_exponential``."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


SIGMA_KINDS: dict[str, Callable[[float, float, int], np.ndarray]] = {"karras": _karras, "exponential": _exponential}


def _sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timesteps of ``sigmas``, linear in log sigma between neighbours (diffusers' _sigma_to_t)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return np.asarray((1 - w) * low + w * (low + 1))


def _euler_sigmas(schedule: NoiseSchedule, n: int, kind: str | None) -> tuple[np.ndarray, np.ndarray, float]:
    """Timesteps, sigmas (final 0 appended) and the initial noise scale, as EulerDiscreteScheduler.set_timesteps:
    a Karras/exponential ``kind`` spans the spaced sigmas' range and maps each sigma back to a fractional timestep."""
    timesteps = _float_timesteps(schedule, n)
    base = schedule.sigmas()
    sigmas = np.interp(timesteps, np.arange(0, len(base)), base)
    if kind is not None:
        sigmas = SIGMA_KINDS[kind](float(sigmas[-1]), float(sigmas[0]), n)
        timesteps = _sigma_to_t(sigmas, np.log(base)).astype(np.float32)
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
    max_sigma = float(sigmas.max())
    init = (max_sigma**2 + 1) ** 0.5 if schedule.spacing("linspace") == "leading" else max_sigma
    return timesteps, sigmas, init


def euler(schedule: NoiseSchedule, n: int, kind: str | None = None) -> SchedulePlan:
    """Euler discrete (Karras et al. algorithm 2 without churn), as diffusers' EulerDiscreteScheduler."""
    timesteps, sigmas, init = _euler_sigmas(schedule, n, kind)
    steps = []
    for i, t in enumerate(timesteps):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        x0 = schedule.denoised(sigma, 1.0 / math.sqrt(sigma * sigma + 1.0))
        derivative = (SAMPLE - x0) * (1.0 / sigma)
        steps.append(Step(float(t), 1.0 / math.sqrt(sigma * sigma + 1.0),
                          SAMPLE + derivative * (sigma_next - sigma), x0))
    return SchedulePlan(init, tuple(steps), tuple(float(s) for s in sigmas), ve=True)


def euler_ancestral(schedule: NoiseSchedule, n: int, kind: str | None = None) -> SchedulePlan:
    """Euler ancestral (eta 1), as diffusers' EulerAncestralDiscreteScheduler; needs fresh noise per step."""
    timesteps, sigmas, init = _euler_sigmas(schedule, n, kind)
    steps = []
    for i, t in enumerate(timesteps):
        sigma, sigma_to = float(sigmas[i]), float(sigmas[i + 1])
        sigma_up = (sigma_to**2 * (sigma**2 - sigma_to**2) / sigma**2) ** 0.5
        sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
        x0 = schedule.denoised(sigma, 1.0 / math.sqrt(sigma * sigma + 1.0))
        derivative = (SAMPLE - x0) * (1.0 / sigma)
        nxt = SAMPLE + derivative * (sigma_down - sigma) + NOISE * sigma_up
        steps.append(Step(float(t), 1.0 / math.sqrt(sigma * sigma + 1.0), nxt, x0))
    return SchedulePlan(init, tuple(steps), tuple(float(s) for s in sigmas), ve=True)


def ddim(schedule: NoiseSchedule, n: int) -> SchedulePlan:
    """DDIM with eta 0, as diffusers' DDIMScheduler (no clipping, no thresholding)."""
    total = schedule.num_train_timesteps
    ratio = total // n
    spacing = schedule.spacing("leading")
    if spacing == "leading":
        timesteps = (np.arange(0, n) * ratio).round()[::-1].astype(np.int64) + schedule.steps_offset
    elif spacing == "linspace":
        timesteps = np.linspace(0, total - 1, n).round()[::-1].astype(np.int64)
    else:
        timesteps = np.round(np.arange(total, 0, -total / n)).astype(np.int64) - 1
    acp = schedule.alphas_cumprod
    final = 1.0 if schedule.set_alpha_to_one else float(acp[0])
    steps, levels = [], []
    for t in timesteps:
        alpha = float(acp[t])
        prev_t = int(t) - ratio
        alpha_prev = float(acp[prev_t]) if prev_t >= 0 else final
        sigma = math.sqrt((1 - alpha) / alpha)
        levels.append(sigma)
        x0 = schedule.denoised(sigma, 1.0)
        # eps from x and x0 in VP form: eps = (x - sqrt(a) x0) / sqrt(1 - a)
        eps = (SAMPLE - x0 * math.sqrt(alpha)) * (1.0 / math.sqrt(1 - alpha))
        nxt = x0 * math.sqrt(alpha_prev) + eps * math.sqrt(1 - alpha_prev)
        steps.append(Step(float(t), 1.0, nxt, x0))
    return SchedulePlan(1.0, tuple(steps), (*levels, 0.0))


def _dpm_sigmas(schedule: NoiseSchedule, n: int, kind: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Integer timesteps and sigmas (final 0 appended), as DPMSolverMultistepScheduler.set_timesteps. A
    Karras/exponential ``kind`` spans the whole training range whatever the spacing; diffusers rounds the Karras
    timesteps but truncates the exponential ones (its int64 cast), and so do we."""
    total = schedule.num_train_timesteps
    spacing = schedule.spacing("linspace")
    base = schedule.sigmas()
    if kind is not None:
        sigmas = SIGMA_KINDS[kind](float(base[0]), float(base[-1]), n)
        t = _sigma_to_t(sigmas, np.log(base))
        timesteps = (t.round() if kind == "karras" else t).astype(np.int64)
    else:
        if spacing == "linspace":
            timesteps = np.linspace(0, total - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        elif spacing == "leading":
            ratio = total // (n + 1)
            timesteps = (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64) + schedule.steps_offset
        else:
            timesteps = np.arange(total, 0, -total / n).round().astype(np.int64) - 1
        sigmas = np.interp(timesteps, np.arange(0, len(base)), base)
    return timesteps, np.concatenate([sigmas, [0.0]]).astype(np.float32)


def _alpha_sigma(sigma: float) -> tuple[float, float]:
    """VP (alpha_t, sigma_t) of the VE noise level ``sigma``."""
    a = 1.0 / math.sqrt(sigma * sigma + 1.0)
    return a, sigma * a


def dpmpp_2m(schedule: NoiseSchedule, n: int, kind: str | None = None, variant: str = "ode",
             start: int = 0) -> SchedulePlan:
    """DPM-Solver++ (2M), as diffusers' DPMSolverMultistepScheduler with its defaults (midpoint solver, lower-order
    final step, final sigma zero). ``variant`` "sde" is ``algorithm_type="sde-dpmsolver++"`` (fresh noise each step)
    and "sde_heun" adds ``solver_type="heun"``. ``start``: an edit begins there (``set_begin_index``): its first
    step is first order, as diffusers' empty model-output history makes it."""
    timesteps, sigmas = _dpm_sigmas(schedule, n, kind)
    steps = []
    for i, t in enumerate(timesteps):
        a_t, s_t = _alpha_sigma(float(sigmas[i + 1]))
        a_s0, s_s0 = _alpha_sigma(float(sigmas[i]))
        x0 = schedule.denoised(float(sigmas[i]), 1.0)
        exp_neg_h = (a_s0 * s_t) / (s_s0 * a_t)  # exp(lambda_s0 - lambda_t), finite when sigma_t == 0
        second_order = start < i < len(timesteps) - 1  # else no history yet, or the final step (final sigma zero)
        d1 = Lin()
        if second_order:
            a_s1, s_s1 = _alpha_sigma(float(sigmas[i - 1]))
            lam = [math.log(a) - math.log(s) for a, s in ((a_t, s_t), (a_s0, s_s0), (a_s1, s_s1))]
            d1 = (x0 - PREV) * ((lam[0] - lam[1]) / (lam[1] - lam[2]))  # (m0 - m1) / r0
        if variant == "ode":
            nxt = SAMPLE * (s_t / s_s0) - (x0 + d1 * 0.5) * (a_t * (exp_neg_h - 1.0))
        else:
            damp = 1.0 - exp_neg_h**2  # 1 - exp(-2h)
            heun = variant == "sde_heun" and second_order  # -2h = 2 log(exp(-h))
            c1 = a_t * (damp / (2 * math.log(exp_neg_h)) + 1) if heun else 0.5 * a_t * damp
            nxt = (SAMPLE * (s_t / s_s0 * exp_neg_h) + x0 * (a_t * damp) + d1 * c1
                   + NOISE * (s_t * math.sqrt(damp)))
        steps.append(Step(float(t), 1.0, nxt, x0))
    return SchedulePlan(1.0, tuple(steps), tuple(float(s) for s in sigmas))


SAMPLERS: dict[str, Callable[..., SchedulePlan]] = {
    "euler": euler,
    "euler_a": euler_ancestral,
    "dpmpp_2m": dpmpp_2m,
    "dpmpp_2m_sde": partial(dpmpp_2m, variant="sde"),
    "dpmpp_2m_sde_heun": partial(dpmpp_2m, variant="sde_heun"),
}
"""Samplers that take a sigma schedule suffix (DDIM does not)."""

SIGMA_SCHEDULES: dict[str, tuple[str | None, str | None]] = {
    "karras": ("karras", None),
    "exponential": ("exponential", "linspace"),
    "uniform": (None, "linspace"),
    "sgm_uniform": (None, "trailing"),
}
"""Schedule suffix -> (sigma kind, timestep_spacing override), per diffusers' A1111 schedule-type table."""


def _scheduled(sampler: Callable[..., SchedulePlan], kind: str | None, spacing: str | None,
               schedule: NoiseSchedule, n: int, **options: int) -> SchedulePlan:
    if spacing is not None:
        schedule = dataclasses.replace(schedule, timestep_spacing=spacing)
    return sampler(schedule, n, kind, **options)


def lms(schedule: NoiseSchedule, n: int, kind: str | None = None, start: int = 0) -> SchedulePlan:
    return multistep.lms(schedule, *_euler_sigmas(schedule, n, kind), start=start)


def heun(schedule: NoiseSchedule, n: int, kind: str | None = None) -> SchedulePlan:
    return multistep.heun(schedule, *_euler_sigmas(schedule, n, kind))


def unipc(schedule: NoiseSchedule, n: int, kind: str | None = None, start: int = 0) -> SchedulePlan:
    return multistep.unipc(schedule, *_dpm_sigmas(schedule, n, kind), start=start)


MULTISTEP: dict[str, Callable[..., SchedulePlan]] = {"lms": lms, "unipc": unipc, "heun": heun}
"""The multistep and two-call samplers (engines/numerics/multistep.py) on this module's sigma schedules; they take
a schedule suffix (PLMS, like DDIM, does not)."""

SCHEDULERS: dict[str, Callable[[NoiseSchedule, int], SchedulePlan]] = {
    "euler": euler, "euler_a": euler_ancestral, "ddim": ddim, "dpmpp_2m": dpmpp_2m,
    "dpmpp_2m_sde": SAMPLERS["dpmpp_2m_sde"], "dpmpp_2m_sde_heun": SAMPLERS["dpmpp_2m_sde_heun"],
    **{f"{name}_{suffix}": partial(_scheduled, sampler, kind, spacing)
       for name, sampler in SAMPLERS.items() for suffix, (kind, spacing) in SIGMA_SCHEDULES.items()},
    "plms": multistep.plms, **MULTISTEP,
    **{f"{name}_{suffix}": partial(_scheduled, sampler, kind, spacing)
       for name, sampler in MULTISTEP.items() for suffix, (kind, spacing) in SIGMA_SCHEDULES.items()},
}
"""Scheduler names as the API accepts them (engines.config.SCHEDULER_NAMES lists the same, in this order)."""


EDIT_SCHEDULERS = tuple(SCHEDULERS)
"""Samplers that serve edits (img2img, inpainting): all of them. Their plans carry noise levels per evaluation and
restart their history where an edit begins, as diffusers' img2img and inpainting pipelines run them
(``timesteps[start * order:]``, ``set_begin_index``, an empty history at the first step they run)."""
RESTART = ("dpmpp_2m", "lms", "unipc")
"""Samplers whose plan needs the start step (history that restarts there); the others are sliced as they are,
but PLMS, whose plan begins at the start (its first two evaluations there make one step)."""


def make_plan(name: str, schedule: NoiseSchedule, num_steps: int, start: int = 0,
              edit: bool = False) -> SchedulePlan:
    """The plan for ``num_steps`` steps of the named scheduler, from step ``start`` on (an ``edit``'s strength
    skips the first steps: diffusers' ``get_timesteps``); raises on an unknown name."""
    try:
        factory = SCHEDULERS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown scheduler {name!r}; expected one of {list(SCHEDULERS)}",
                                  param="scheduler") from None
    if not edit:
        return factory(schedule, num_steps)
    if name == "plms":
        return multistep.plms(schedule, num_steps, start)
    restart = {"start": start} if start and name.startswith(RESTART) else {}
    return factory(schedule, num_steps, **restart).sliced(start)
