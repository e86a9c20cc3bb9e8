"""The step and decode-scaling graphs, run by ONNX Runtime on the CPU: dtypes at the boundary, float32 arithmetic."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines.numerics.schedulers import NoiseSchedule, make_plan
from engines.numerics.step_graph import build_scale_graph, build_step_graph, step_coefficients

B, SHAPE = 2, (2, 4, 8, 8)
FLOAT32_BOUND = 2e-6
"""Max error relative to the largest latent for float32 arithmetic (measured ~1e-7; fp16 arithmetic ~1e-3)."""


def _session(model: bytes) -> ort.InferenceSession:
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def _types(session: ort.InferenceSession) -> dict[str, str]:
    return {a.name: a.type for a in [*session.get_inputs(), *session.get_outputs()]}


def _step_inputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The first Euler step at sigma ~14.6 (the largest latents a request sees), CFG 7.5, fp16 model output."""
    step = make_plan("euler", NoiseSchedule.from_config({}), 20).steps[0]
    sample = (rng.standard_normal(SHAPE) * 14.6).astype(np.float32)
    return {"sample": sample, "model_out": rng.standard_normal((2 * B, *SHAPE[1:])).astype(np.float16),
            "prev": rng.standard_normal(SHAPE).astype(np.float32), "noise": np.zeros(SHAPE, np.float32),
            "coeffs": step_coefficients(step.next, step.denoised, np.full(B, 7.5)),
            "in_scale": np.array([step.input_scale], np.float32)}


def _reference(feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """next and denoised in float64 from the same (already rounded) inputs."""
    uncond, text = np.split(feeds["model_out"].astype(np.float64), 2)
    basis = [feeds["sample"], uncond, text, feeds["prev"], feeds["noise"]]
    flat = np.stack([np.asarray(b, np.float64).reshape(B, -1) for b in basis], axis=1)  # [B,5,N]
    combined = feeds["coeffs"].astype(np.float64) @ flat
    return combined[:, 0].reshape(SHAPE), combined[:, 1].reshape(SHAPE)


def test_fp32_unet_step_graph_has_no_casts() -> None:
    ops = [n.op_type for n in onnx.load_from_string(build_step_graph(np.float32, np.float32)).graph.node]
    assert "Cast" not in ops and "MatMul" in ops


def test_fp16_unet_step_graph_keeps_the_state_float32() -> None:
    types = _types(_session(build_step_graph(np.float16, np.float16)))
    assert types == {"sample": "tensor(float)", "model_out": "tensor(float16)", "prev": "tensor(float)",
                     "noise": "tensor(float)", "coeffs": "tensor(float)", "in_scale": "tensor(float)",
                     "next": "tensor(float)", "denoised": "tensor(float)", "model_in": "tensor(float16)"}


@pytest.mark.parametrize(("compute", "is_float32"), [(np.float32, True), (np.float16, False)])
def test_step_arithmetic_precision(compute: type[np.generic], is_float32: bool) -> None:
    """float32 arithmetic matches float64 to float32 rounding; the fp16 step (the old graph) misses by far more,
    so this test tells the two apart."""
    feeds = _step_inputs(np.random.default_rng(0))
    nxt, denoised, model_in = _session(build_step_graph(np.float16, np.float16, compute)).run(None, feeds)
    ref_next, ref_denoised = _reference(feeds)
    scale = float(np.abs(ref_next).max())
    error = max(float(np.abs(nxt - ref_next).max()), float(np.abs(denoised - ref_denoised).max())) / scale
    if is_float32:
        assert error < FLOAT32_BOUND
    else:
        assert error > 50 * FLOAT32_BOUND  # fp16 keeps ~3 digits: the float32 bound would catch an fp16 step
    assert model_in.dtype == np.float16
    expected_in = np.concatenate([ref_next * feeds["in_scale"][0]] * 2)
    np.testing.assert_allclose(model_in.astype(np.float64), expected_in, rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_scale_graph_writes_the_vae_input_dtype(out_dtype: type[np.generic]) -> None:
    latents = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    session = _session(build_scale_graph(1 / 0.18215, out_dtype))
    (scaled,) = session.run(None, {"latents": latents})
    assert scaled.dtype == out_dtype and scaled.shape == SHAPE
    expected = latents.astype(np.float64) / 0.18215
    np.testing.assert_allclose(scaled.astype(np.float64), expected, rtol=1e-3 if out_dtype == np.float16 else 1e-6)
