"""Samplers that keep more than one previous estimate, or call the UNet twice per step, as linear plans.

Each evaluation pushes one history entry (``Step.denoised``) into a ring the step graph reads (``prev`` and
``Lin.earlier``: up to :data:`MAX_HISTORY` entries). Anything else a sampler keeps between evaluations is a linear
combination of the current sample and those entries, so the plan recovers it exactly: UniPC's corrector needs the
previous corrected sample, which is ``(sample - predictor terms) / predictor sample coefficient``.

- plms: diffusers' PNDMScheduler with ``skip_prk_steps=True`` (SD's original scheduler): n + 1 UNet calls for n steps
  (the first step is re-run with the average of two model outputs), then Adams-Bashforth over up to 4 model outputs.
  The history holds the raw (CFG-combined) model outputs: diffusers converts v-prediction to epsilon after combining.
- lms: LMSDiscreteScheduler (order 4): the derivatives of the last 4 steps, weighted by the integrals of their
  Lagrange polynomials over the step; the polynomials are integrated in closed form (diffusers uses scipy's quad,
  exact to rounding on a cubic).
- unipc: UniPCMultistepScheduler with its defaults (bh2, order 2, predict x0, lower-order final step, corrector on).
- heun: HeunDiscreteScheduler: Euler to the next sigma, a second UNet call there, the trapezoid average; the last
  step (to sigma 0) is a plain Euler step, as in diffusers.
"""

from __future__ import annotations

import math

import numpy as np

from engines.numerics.plan import MODEL, PREV, SAMPLE, Lin, Schedule, SchedulePlan, Step, hist

MAX_HISTORY = 3
"""History entries the multistep step graph carries (LMS order 4 and PLMS: the current output plus 3)."""
PLMS_WEIGHTS = ((1.0,), (1.5, -0.5), (23 / 12, -16 / 12, 5 / 12), (55 / 24, -59 / 24, 37 / 24, -9 / 24))
"""Adams-Bashforth weights over (this output, the previous ones...), as PNDMScheduler.step_plms."""


def _pndm_update(schedule: Schedule, t: int, prev_t: int, sample: Lin, output: Lin) -> Lin:
    """PNDM's ``_get_prev_sample`` (formula 9 of the PNDM paper), v-prediction converted to epsilon first."""
    acp = schedule.alphas_cumprod
    a_t = float(acp[t])
    a_prev = float(acp[prev_t]) if prev_t >= 0 else (1.0 if schedule.set_alpha_to_one else float(acp[0]))
    b_t, b_prev = 1 - a_t, 1 - a_prev
    eps = output if schedule.prediction_type == "epsilon" else output * math.sqrt(a_t) + sample * math.sqrt(b_t)
    denom = a_t * math.sqrt(b_prev) + math.sqrt(a_t * b_t * a_prev)
    return sample * math.sqrt(a_prev / a_t) - eps * ((a_prev - a_t) / denom)


def _pndm_timesteps(schedule: Schedule, n: int) -> np.ndarray:
    """PNDMScheduler.set_timesteps with skip_prk_steps: the spaced timesteps with the second-to-last repeated."""
    total = schedule.num_train_timesteps
    spacing = schedule.spacing("leading")
    if spacing == "linspace":
        ts = np.linspace(0, total - 1, n).round().astype(np.int64)
    elif spacing == "leading":
        ts = (np.arange(0, n) * (total // n)).round().astype(np.int64) + schedule.steps_offset
    else:
        ts = np.round(np.arange(total, 0, -total / n))[::-1].astype(np.int64) - 1
    return np.concatenate([ts[:-1], ts[-2:-1], ts[-1:]])[::-1].copy()


def plms(schedule: Schedule, n: int, start: int = 0) -> SchedulePlan:
    """PLMS as diffusers' PNDMScheduler(skip_prk_steps=True). Evaluations 0 and 1 make the first step; diffusers
    drops evaluation 1's output from its history, so evaluation 1 pushes evaluation 0's again. ``start``: an edit's
    first step; the plan returned begins there (not to be sliced): diffusers' img2img runs ``timesteps[start:]``
    and PNDM's counter starts afresh at its first, so the first two evaluations there make one step as above."""
    timesteps = _pndm_timesteps(schedule, n)[start:]
    ratio = schedule.num_train_timesteps // n
    evals: list[Step] = []
    first = Lin()
    for k, t in enumerate(int(t) for t in timesteps):
        if k == 1:  # re-run step 0 from its input sample with the mean of both outputs
            origin = (SAMPLE - PREV * first.model) * (1.0 / first.sample)
            nxt = _pndm_update(schedule, t + ratio, t, origin, (MODEL + PREV) * 0.5)
            evals.append(Step(float(t), 1.0, nxt, PREV))
            continue
        weights = PLMS_WEIGHTS[max(min(k, 4), 1) - 1]
        output = sum((hist(j) * w for j, w in enumerate(weights[1:], 1)), MODEL * weights[0])
        nxt = _pndm_update(schedule, t, t - ratio, SAMPLE, output)
        first = nxt if k == 0 else first
        evals.append(Step(float(t), 1.0, nxt, MODEL))
    head = (Step(evals[0].timestep, 1.0, evals[0].next, MODEL, evals[1]),) if len(evals) > 1 else (evals[0],)
    acp = schedule.alphas_cumprod  # add_noise at each evaluation's timestep (DDPM form)
    sigmas = (*(math.sqrt((1 - float(acp[t])) / float(acp[t])) for t in timesteps), 0.0)
    return SchedulePlan(1.0, head + tuple(evals[2:]), sigmas)


def _lagrange_integral(nodes: list[float], j: int, lo: float, hi: float) -> float:
    """The integral over [lo, hi] of the Lagrange basis polynomial of ``nodes[j]`` (exact: a polynomial)."""
    poly = np.polynomial.Polynomial([1.0])
    for k, node in enumerate(nodes):
        if k != j:
            poly = poly * np.polynomial.Polynomial([-node, 1.0]) / (nodes[j] - node)
    antiderivative = poly.integ()
    return float(antiderivative(hi) - antiderivative(lo))


def lms(schedule: Schedule, timesteps: np.ndarray, sigmas: np.ndarray, init: float, order: int = 4,
        start: int = 0) -> SchedulePlan:
    """LMS as diffusers' LMSDiscreteScheduler (order 4) on Euler's timesteps and sigmas (final 0 appended): the
    history holds each step's derivative. ``start``: an edit begins there (``set_begin_index``) with no
    derivatives kept; diffusers still takes the coefficients of order ``min(step + 1, 4)`` and pairs them with
    the derivatives it has (its ``zip``), so the first steps there use the leading coefficients only."""
    steps = []
    for i, t in enumerate(timesteps):
        sigma = float(sigmas[i])
        scale = 1.0 / math.sqrt(sigma * sigma + 1.0)
        derivative = (SAMPLE - schedule.denoised(sigma, scale)) * (1.0 / sigma)
        used = min(i + 1, order)
        nodes = [float(sigmas[i - k]) for k in range(used)]
        coeffs = [_lagrange_integral(nodes, j, sigma, float(sigmas[i + 1])) for j in range(used)]
        coeffs = coeffs[:max(1, i - start + 1)]
        nxt = SAMPLE + derivative * coeffs[0] + sum((hist(j) * c for j, c in enumerate(coeffs[1:], 1)), Lin())
        steps.append(Step(float(t), scale, nxt, derivative))
    return SchedulePlan(init, tuple(steps), tuple(float(s) for s in sigmas), ve=True)


def _unipc_terms(sigmas: np.ndarray, target: int, source: int, older: int | None,
                 corrector: bool) -> tuple[float, float, float, float]:
    """UniPC's bh2 update from ``source`` to ``target`` (sigma indices): coefficients of (the sample at source,
    the x0 estimate at source, the one at ``older`` (order 2; None for order 1), the one at target (corrector))."""
    s_t, s_s = float(sigmas[target]), float(sigmas[source])
    a_t = 1.0 / math.sqrt(s_t * s_t + 1.0)
    if s_t == 0.0:  # the final step to sigma 0 (first order): the x0 estimate itself
        return 0.0, 1.0, 0.0, 0.0
    ratio = (s_t * a_t) / (s_s / math.sqrt(s_s * s_s + 1.0))
    hh = math.log(s_t / s_s)  # -h, h = lambda_t - lambda_s, lambda = -log(sigma)
    b_h = math.expm1(hh)  # bh2; also h * phi_1(h)
    coef_sample, coef_src = ratio, -a_t * b_h
    if older is None:
        rho_older, rho_t = 0.0, (0.5 if corrector else 0.0)
    else:
        rk = math.log(s_s / float(sigmas[older])) / -hh  # (lambda_older - lambda_s) / h
        if corrector:
            phi_k = b_h / hh - 1
            b = [phi_k / b_h, (phi_k / hh - 0.5) * 2 / b_h]
            rho_older, rho_t = np.linalg.solve(np.array([[1.0, 1.0], [rk, 1.0]]), np.array(b)).tolist()
        else:
            rho_older, rho_t = 0.5, 0.0
        rho_older /= rk  # D1 = (m_older - m_src) / rk
    scale = -a_t * b_h
    src = coef_src + scale * (-rho_older - rho_t)
    return coef_sample, src, scale * rho_older, scale * rho_t


def unipc(schedule: Schedule, timesteps: np.ndarray, sigmas: np.ndarray, start: int = 0) -> SchedulePlan:
    """UniPC (bh2, order 2) as diffusers' UniPCMultistepScheduler on DPM-Solver's timesteps and sigmas. The history
    holds the x0 estimates; the corrected previous sample the corrector starts from is recovered from the current
    (predicted) sample. ``start``: an edit begins there (``set_begin_index``): no corrector at that step (no last
    sample yet) and a first-order predictor, as diffusers' empty history makes them."""
    n = len(timesteps)
    orders = [max(1, min(2, n - i, i - start + 1)) for i in range(n)]  # lower-order warm-up and final step
    steps = []
    predicted = (1.0, 0.0, 0.0)  # how step i-1 made this sample from (corrected sample, m_{i-1}, m_{i-2})
    for i, t in enumerate(timesteps):
        m_i = schedule.denoised(float(sigmas[i]), 1.0)
        corrected = SAMPLE
        if i > start:
            ps, q1, q2 = predicted
            last = (SAMPLE - PREV * q1 - hist(2) * q2) * (1.0 / ps)
            cs, c_src, c_older, c_t = _unipc_terms(sigmas, i, i - 1, i - 2 if orders[i - 1] == 2 else None, True)
            corrected = last * cs + PREV * c_src + hist(2) * c_older + m_i * c_t
        ps, p_src, p_older, _ = _unipc_terms(sigmas, i + 1, i, i - 1 if orders[i] == 2 else None, False)
        steps.append(Step(float(t), 1.0, corrected * ps + m_i * p_src + PREV * p_older, m_i))
        predicted = (ps, p_src, p_older)
    return SchedulePlan(1.0, tuple(steps), tuple(float(s) for s in sigmas))


def heun(schedule: Schedule, timesteps: np.ndarray, sigmas: np.ndarray, init: float) -> SchedulePlan:
    """Heun as diffusers' HeunDiscreteScheduler on Euler's timesteps and sigmas: per step an Euler predictor, then
    (but for the final step to sigma 0) a second evaluation whose derivative is averaged with the first. The
    predictor pushes its input sample. Its noise levels are per evaluation, as diffusers interleaves them (the
    corrector's is the next sigma): an edit's start and inpainting's blend after each evaluation read them."""
    steps, levels = [], []
    for i, t in enumerate(timesteps):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        scale = 1.0 / math.sqrt(sigma * sigma + 1.0)
        x0 = schedule.denoised(sigma, scale)
        predictor = SAMPLE + (SAMPLE - x0) * ((sigma_next - sigma) / sigma)
        levels.append(sigma)
        if sigma_next == 0.0:
            steps.append(Step(float(t), scale, predictor, x0))
            continue
        levels.append(sigma_next)
        scale_next = 1.0 / math.sqrt(sigma_next * sigma_next + 1.0)
        x0_next = schedule.denoised(sigma_next, scale_next)
        # x_{i+1} = x_i + (d_i + d') / 2 * dt with d_i * dt = predictor - x_i: x_i is the pushed entry (PREV)
        derivative = (SAMPLE - x0_next) * (1.0 / sigma_next)
        corrector = (SAMPLE + PREV) * 0.5 + derivative * (0.5 * (sigma_next - sigma))
        second = Step(float(timesteps[i + 1]), scale_next, corrector, x0_next)
        steps.append(Step(float(t), scale, predictor, SAMPLE, second))
    return SchedulePlan(init, tuple(steps), (*levels, 0.0), ve=True)
