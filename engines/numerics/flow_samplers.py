"""A1111's Euler a, DPM++ 2M and UniPC on flow-matching models, as diffusers' flow formulations, in numpy (no torch).

A flow model predicts the velocity ``v`` at noise level ``sigma``; its clean estimate is ``x0 = x - sigma * v`` and
the sample at ``sigma`` is ``(1 - sigma) * x0 + sigma * noise``, so in the DPM-Solver notation ``alpha = 1 - sigma``
and ``lambda = log(alpha / sigma)``. Every sampler here runs on the model's own flow schedule (the sigmas Euler
takes: A1111's and Forge's "Simple" for these models) and is a linear plan over the step basis of
engines/numerics/plan.py with the model output being the velocity:

- euler_a: diffusers' ``FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)``: ``x0`` re-noised to the next
  level with fresh noise, ``next = (1 - sigma_next) * x0 + sigma_next * noise``. The noise is drawn per image from
  its seed's stream after its initial noise (``image_rng``), in the latents' own shape, so an image's noise is the
  same alone or joined with other requests.
- dpmpp_2m: ``DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")``
  (dpmsolver++, order 2, midpoint, first order at the first and the final step, the final one to sigma 0).
- unipc: ``UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction")`` (bh2, order 2,
  corrector on, lower order at both ends); a first sigma of 1 is lowered by 1e-6 as diffusers does (``lambda`` of
  sigma 1 is -inf).

Karras, exponential and beta sigmas are not served on flow models: diffusers' DPM-Solver computes them from a
VP training schedule these models do not have (``use_karras_sigmas`` ignores ``use_flow_sigmas`` there).

The step runs as a small ONNX graph on the transformer's provider (``build_flow_sampler_graph``), the latents
staying on the device; ``FlowSampler`` is one request's state (its coefficient table, its two-entry history ring,
its noise streams), so step-level batching keeps each row's sampler state with its row. CFG is folded into the
coefficients (``(1 - w) * uncond + w * text``) except where a family's CFG is not linear (Qwen-Image's norm-rescaled
true CFG): there the family's own CFG step graph writes the guided velocity first (``Guide``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from engines.numerics.plan import MODEL, NOISE, PREV, SAMPLE, Lin, SchedulePlan, Step, hist
from engines.numerics.step_graph import elem_type, serialize, step_coefficients

FLOW_SAMPLERS = ("euler", "euler_a", "dpmpp_2m", "unipc")
"""The samplers a flow-matching model serves (``euler`` is the pipeline's own step graph)."""
STATE = np.float32
UNIPC_EPS = 1e-6
"""UniPCMultistepScheduler.set_timesteps lowers a first flow sigma within this of 1 by it."""


def _lambda(sigma: float) -> float:
    """``log((1 - sigma) / sigma)``: -inf at sigma 1 (pure noise), +inf at 0."""
    if sigma <= 0.0:
        return math.inf
    if sigma >= 1.0:
        return -math.inf
    return math.log(1.0 - sigma) - math.log(sigma)


def clean(sigma: float) -> Lin:
    """The x0 estimate ``sample - sigma * velocity``."""
    return SAMPLE - MODEL * sigma


def euler_a(sigmas: Sequence[float]) -> tuple[Step, ...]:
    """FlowMatchEulerDiscreteScheduler.step with stochastic_sampling."""
    steps = []
    for i in range(len(sigmas) - 1):
        x0, nxt = clean(float(sigmas[i])), float(sigmas[i + 1])
        steps.append(Step(float(i), 1.0, x0 * (1.0 - nxt) + NOISE * nxt, x0))
    return tuple(steps)


def dpmpp_2m(sigmas: Sequence[float]) -> tuple[Step, ...]:
    """DPMSolverMultistepScheduler's dpmsolver++ (midpoint) updates with flow sigmas; the history holds x0."""
    n = len(sigmas) - 1
    steps = []
    for i in range(n):
        s0, t = float(sigmas[i]), float(sigmas[i + 1])
        m0 = clean(s0)
        lam_t, lam_s0 = _lambda(t), _lambda(s0)
        h = lam_t - lam_s0
        decay = math.exp(-h) - 1.0  # exp(-h) - 1: -1 when h is inf (from sigma 1, or to sigma 0)
        ratio = t / s0
        nxt = SAMPLE * ratio - m0 * ((1.0 - t) * decay)
        if 0 < i < n - 1:  # second order: D1 = (m0 - m1) / r0, r0 = h_0 / h
            h_0 = lam_s0 - _lambda(float(sigmas[i - 1]))
            inv_r0 = h / h_0
            nxt = nxt - (m0 - PREV) * (0.5 * (1.0 - t) * decay * inv_r0)
        steps.append(Step(float(i), 1.0, nxt, m0))
    return tuple(steps)


def _unipc_terms(sigmas: Sequence[float], target: int, source: int, older: int | None,
                 corrector: bool) -> tuple[float, float, float, float]:
    """UniPC's bh2 update from ``source`` to ``target`` (sigma indices) with flow alphas: coefficients of (the
    sample at source, the x0 estimate at source, the one at ``older`` (order 2), the one at target (corrector))."""
    s_t, s_s = float(sigmas[target]), float(sigmas[source])
    if s_t == 0.0:  # the final step to sigma 0 (first order): the x0 estimate itself
        return 0.0, 1.0, 0.0, 0.0
    a_t = 1.0 - s_t
    h = _lambda(s_t) - _lambda(s_s)
    b_h = math.expm1(-h)  # bh2; also h * phi_1(h)
    if older is None:
        rho_older, rho_t = 0.0, (0.5 if corrector else 0.0)
    else:
        rk = (_lambda(float(sigmas[older])) - _lambda(s_s)) / h
        if corrector:
            phi_k = b_h / -h - 1
            b = [phi_k / b_h, (phi_k / -h - 0.5) * 2 / b_h]
            rho_older, rho_t = np.linalg.solve(np.array([[1.0, 1.0], [rk, 1.0]]), np.array(b)).tolist()
        else:
            rho_older, rho_t = 0.5, 0.0
        rho_older /= rk  # D1 = (m_older - m_src) / rk
    scale = -a_t * b_h
    return s_t / s_s, scale + scale * (-rho_older - rho_t), scale * rho_older, scale * rho_t


def unipc(sigmas: Sequence[float]) -> tuple[Step, ...]:
    """UniPCMultistepScheduler (bh2, order 2, corrector) with flow sigmas. The history holds x0 (two entries);
    the corrected previous sample the corrector starts from is recovered from the current (predicted) sample."""
    sig = [float(s) for s in sigmas]
    if abs(sig[0] - 1.0) < UNIPC_EPS:
        sig[0] -= UNIPC_EPS
    n = len(sig) - 1
    orders = [min(2, n - i, i + 1) for i in range(n)]  # lower-order warm-up and final step
    steps = []
    predicted = (1.0, 0.0, 0.0)  # how step i-1 made this sample from (corrected sample, m_{i-1}, m_{i-2})
    for i in range(n):
        m_i = clean(sig[i])
        corrected = SAMPLE
        if i > 0:
            ps, q1, q2 = predicted
            last = (SAMPLE - PREV * q1 - hist(2) * q2) * (1.0 / ps)
            cs, c_src, c_older, c_t = _unipc_terms(sig, i, i - 1, i - 2 if orders[i - 1] == 2 else None, True)
            corrected = last * cs + PREV * c_src + hist(2) * c_older + m_i * c_t
        ps, p_src, p_older, _ = _unipc_terms(sig, i + 1, i, i - 1 if orders[i] == 2 else None, False)
        steps.append(Step(float(i), 1.0, corrected * ps + m_i * p_src + PREV * p_older, m_i))
        predicted = (ps, p_src, p_older)
    return tuple(steps)


PLANS: dict[str, Callable[[Sequence[float]], tuple[Step, ...]]] = {
    "euler_a": euler_a, "dpmpp_2m": dpmpp_2m, "unipc": unipc}
"""The samplers run through ``FlowSampler`` (``euler`` keeps the pipeline's own step graph)."""
HISTORY = 2
"""History entries the sampler graph carries (UniPC's corrector reads the x0 estimate two evaluations back)."""


def flow_plan(name: str, sigmas: Sequence[float] | np.ndarray) -> SchedulePlan:
    """The plan of sampler ``name`` over a flow schedule's sigmas (steps + 1 of them, ending in 0)."""
    if name not in PLANS:
        raise ValueError(f"flow sampler {name!r}: expected one of {sorted(PLANS)}")
    values = [float(s) for s in sigmas]
    return SchedulePlan(1.0, PLANS[name](values), tuple(values), ve=False)


def _dims(packed: bool, rows: str = "B") -> list[str]:
    return [rows, "T", "D"] if packed else [rows, "C", "H", "W"]


def build_flow_sampler_graph(model_in: type[np.generic], model_out: type[np.generic], cfg: bool,
                             packed: bool, copies: int | None = None) -> bytes:
    """Serialized ONNX model of one sampler step over the basis (sample, uncond, text, prev, noise, prev2):
    inputs ``sample``, ``prev``, ``noise``, ``prev2`` (float32, the latents' shape: Flux's packed [B,T,D] or
    [B,C,H,W]), ``model_out`` (the transformer's output, 2B rows with CFG) and ``coeffs`` [B,2,6] float32; outputs
    ``next``, ``denoised`` (float32) and ``model_in`` (``next``, twice with CFG, in the transformer's input
    dtype; ``copies`` rows of it per image, default 2 with CFG). Arithmetic in float32."""
    f32, out_elem, in_elem = TensorProto.FLOAT, elem_type(model_out), elem_type(model_in)
    copies = copies or (2 if cfg else 1)
    rows, in_rows = "B2" if cfg else "B", "B2" if copies == 2 else "B"
    names = ("sample", "uncond", "text", "prev", "noise", "prev2")
    nodes = [helper.make_node("Shape", ["sample"], ["shape"])]
    source = "model_out"
    if out_elem != f32:
        nodes.append(helper.make_node("Cast", ["model_out"], ["model_out_f"], to=f32))
        source = "model_out_f"
    nodes += [helper.make_node("Split", [source], ["uncond", "text"], axis=0)] if cfg else \
        [helper.make_node("Identity", [source], ["uncond"]), helper.make_node("Identity", [source], ["text"])]
    nodes += [helper.make_node("Reshape", [name, "flat_shape"], [f"{name}_flat"]) for name in names]
    nodes += [
        helper.make_node("Concat", [f"{name}_flat" for name in names], ["stack"], axis=1),  # [B,6,N]
        helper.make_node("MatMul", ["coeffs", "stack"], ["combined"]),  # [B,2,N]
        helper.make_node("Split", ["combined"], ["next_flat", "denoised_flat"], axis=1),
        helper.make_node("Reshape", ["next_flat", "shape"], ["next"]),
        helper.make_node("Reshape", ["denoised_flat", "shape"], ["denoised"]),
        helper.make_node("Concat", ["next"] * copies, ["model_in_f"], axis=0),
        helper.make_node("Cast", ["model_in_f"], ["model_in"], to=in_elem)]
    inputs = [helper.make_tensor_value_info("sample", f32, _dims(packed)),
              helper.make_tensor_value_info("model_out", out_elem, _dims(packed, rows)),
              helper.make_tensor_value_info("prev", f32, _dims(packed)),
              helper.make_tensor_value_info("noise", f32, _dims(packed)),
              helper.make_tensor_value_info("prev2", f32, _dims(packed)),
              helper.make_tensor_value_info("coeffs", f32, ["B", 2, len(names)])]
    outputs = [helper.make_tensor_value_info("next", f32, _dims(packed)),
               helper.make_tensor_value_info("denoised", f32, _dims(packed)),
               helper.make_tensor_value_info("model_in", in_elem, _dims(packed, in_rows))]
    flat = numpy_helper.from_array(np.array([0, 1, -1], dtype=np.int64), "flat_shape")
    return serialize(nodes, "sdserve_flow_sampler", inputs, outputs, [flat])


def sampler_coefficients(plan: SchedulePlan, guidance: np.ndarray, cfg: bool) -> np.ndarray:
    """[steps, B, 2, 6] float32: each step's (next, denoised) over the graph's basis, the velocity being
    ``(1 - w) * uncond + w * text`` with w the image's guidance under CFG (1 for images at guidance <= 1, as a
    batch of their own would run) and the text rows alone without CFG."""
    w = np.where(guidance > 1.0, guidance, 1.0).astype(np.float64) if cfg else np.ones(len(guidance))
    return np.stack([step_coefficients(step.next, step.denoised, w, HISTORY) for step in plan.steps])


@dataclass
class FlowSampler:
    """One request's sampler state on the device beside its DitDenoising: the per-step coefficients, the ring of
    ``HISTORY + 1`` x0 estimates (entries not yet pushed are zeros, read with coefficient 0: never stale values,
    as 0 * NaN is NaN) and each image's noise stream (Euler a)."""

    graph: Any
    coeffs: list[ort.OrtValue]
    ring: list[ort.OrtValue]
    rngs: list[np.random.Generator]
    noisy: tuple[bool, ...]
    upload: Callable[[str, np.ndarray], ort.OrtValue]
    guide: Guide | None = None
    """A nonlinear CFG's pass writing the guided velocity first, or None (CFG folded into the coefficients)."""

    def advance(self, state: Any) -> bool:
        """The step graph writes the next latents, the x0 estimate into the ring and the next transformer input
        (state: the pipeline's DitDenoising). Every evaluation is a step."""
        i, ring, depth = state.next_eval, self.ring, len(self.ring)
        noise = state.lat[0]  # a step without noise reads it with coefficient 0 (finite: the sample)
        if self.noisy[i]:  # each image's next draw from its own stream, in the latents' shape
            shape = tuple(state.lat[0].shape())[1:]
            noise = self.upload("flow_noise", np.stack([r.standard_normal(shape, dtype=np.float32)
                                                        for r in self.rngs]))
        model_out = state.model_out
        if self.guide is not None:
            model_out = self.guide.run(state.model_out)
        self.graph.run({"sample": state.lat[0], "model_out": model_out, "prev": ring[i % depth],
                        "prev2": ring[(i - 1) % depth], "noise": noise, "coeffs": self.coeffs[i]},
                       {"next": state.lat[1], "denoised": ring[(i + 1) % depth], "model_in": state.model_in})
        state.lat.reverse()
        state.next_eval += 1
        state.done += 1
        return True


@dataclass
class Guide:
    """The pipeline's own CFG step graph run as ``0 + 1 * guided`` (sigma 0 to 1): the guided velocity of a CFG
    its coefficients cannot fold in (Qwen-Image's norm-rescaled true CFG), written into ``velocity``."""

    step: Any
    zeros: ort.OrtValue
    coeffs: ort.OrtValue
    velocity: ort.OrtValue
    scratch: ort.OrtValue

    def run(self, model_out: ort.OrtValue) -> ort.OrtValue:
        self.step.run({"sample": self.zeros, "model_out": model_out, "coeffs": self.coeffs},
                      {"next": self.velocity, "model_in": self.scratch})
        return self.velocity


_GRAPHS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
"""Per pipeline, its sampler graphs ("cfg", "plain", "guided": float32 velocity in, two copies out), built on
first use."""


def _graph(pipe: Any, kind: str) -> Any:
    graphs = _GRAPHS.setdefault(pipe, {})
    if kind not in graphs:
        model = pipe.transformer
        in_dtype = model.input_dtype("hidden_states")
        out_dtype = STATE if kind == "guided" else model.output_dtype()
        graph = build_flow_sampler_graph(in_dtype, out_dtype, kind == "cfg", pipe.packed, 2 if kind != "plain" else 1)
        graphs[kind] = pipe._make(graph, f"flow_sampler_{kind}")
    return graphs[kind]


def start_sampler(pipe: Any, name: str, sigmas: np.ndarray, guidance: np.ndarray, cfg: bool,
                  rngs: list[np.random.Generator], state: Any) -> FlowSampler | None:
    """The sampler state for a request of ``pipe`` (a FlowPipeline) whose DitDenoising ``state`` was just made
    on the schedule's ``sigmas``; None for Euler (the pipeline's own step). A pipeline whose CFG step is not a
    linear combination (its ``coefficients`` hook overridden: Qwen-Image) gets its guided velocity from its own CFG
    step graph first (``Guide``), then the sampler step on it."""
    if name == "euler":
        return None
    plan = flow_plan(name, sigmas)
    rt, shape = pipe.runtime, tuple(state.lat[0].shape())
    nonlinear = cfg and type(pipe).coefficients.__qualname__ != "FlowPipeline.coefficients"
    guide = None
    if nonlinear:
        guide = Guide(pipe.step_cfg, rt.upload("flow_guide_zeros", np.zeros(shape, STATE)),
                      rt.upload("flow_guide_coeffs", pipe.coefficients(0.0, 1.0, guidance, True)),
                      rt.buffer("flow_velocity", shape, STATE), state.model_in)
    ring = [rt.buffer("flow_x0_1", shape, STATE) if k == 1 else rt.upload(f"flow_x0_{k}", np.zeros(shape, STATE))
            for k in range(HISTORY + 1)]
    coeffs = rt.upload_steps("flow_sampler_coeffs", sampler_coefficients(plan, guidance, cfg and not nonlinear))
    graph = _graph(pipe, "guided" if nonlinear else "cfg" if cfg else "plain")
    return FlowSampler(graph, coeffs, ring, rngs, tuple(bool(s.next.noise) for s in plan.steps), rt.upload, guide)
