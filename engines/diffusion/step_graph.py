"""The scheduler step as a small ONNX graph, run by the same provider as the UNet.

Inputs: ``sample`` [B,C,H,W], ``model_out`` [2B,C,H,W] (uncond first, then text), ``prev`` [B,C,H,W] (previous
denoised estimate), ``noise`` [B,C,H,W], ``coeffs`` [B,2,5] (per image: rows next/denoised over the basis
sample, uncond, text, prev, noise) and ``in_scale`` [1]. Outputs: ``next`` and ``denoised`` [B,C,H,W], and
``model_in`` [2B,C,H,W] = next * in_scale twice, the UNet input of the following step.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from engines.diffusion.schedulers import Lin

BASIS = ("sample", "uncond", "text", "prev", "noise")


def build_step_graph(dtype: type[np.generic]) -> bytes:
    """Serialized ONNX model of the step for float32 or float16 latents."""
    elem = TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT
    latent = ["B", "C", "H", "W"]
    inputs = [helper.make_tensor_value_info("sample", elem, latent),
              helper.make_tensor_value_info("model_out", elem, ["B2", "C", "H", "W"]),
              helper.make_tensor_value_info("prev", elem, latent),
              helper.make_tensor_value_info("noise", elem, latent),
              helper.make_tensor_value_info("coeffs", elem, ["B", 2, 5]),
              helper.make_tensor_value_info("in_scale", elem, [1])]
    outputs = [helper.make_tensor_value_info("next", elem, latent),
               helper.make_tensor_value_info("denoised", elem, latent),
               helper.make_tensor_value_info("model_in", elem, ["B2", "C", "H", "W"])]
    flat = numpy_helper.from_array(np.array([0, 1, -1], dtype=np.int64), "flat_shape")
    nodes = [
        helper.make_node("Shape", ["sample"], ["shape"]),
        helper.make_node("Split", ["model_out"], ["uncond", "text"], axis=0),
        *[helper.make_node("Reshape", [name, "flat_shape"], [f"{name}_flat"]) for name in BASIS],
        helper.make_node("Concat", [f"{name}_flat" for name in BASIS], ["stack"], axis=1),  # [B,5,N]
        helper.make_node("MatMul", ["coeffs", "stack"], ["combined"]),  # [B,2,N]
        helper.make_node("Split", ["combined"], ["next_flat", "denoised_flat"], axis=1),
        helper.make_node("Reshape", ["next_flat", "shape"], ["next"]),
        helper.make_node("Reshape", ["denoised_flat", "shape"], ["denoised"]),
        helper.make_node("Mul", ["next", "in_scale"], ["scaled"]),
        helper.make_node("Concat", ["scaled", "scaled"], ["model_in"], axis=0),
    ]
    graph = helper.make_graph(nodes, "sdserve_scheduler_step", inputs, outputs, initializer=[flat])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sdserve")
    model.ir_version = 8
    return bytes(model.SerializeToString())


def step_coefficients(next_: Lin, denoised: Lin, guidance: np.ndarray, dtype: type[np.generic]) -> np.ndarray:
    """[B,2,5] coefficients: the model output ``(1 - w)*uncond + w*text`` expanded per image's guidance w."""
    rows = np.empty((len(guidance), 2, 5), dtype=np.float64)
    for k, lin in enumerate((next_, denoised)):
        rows[:, k, 0] = lin.sample
        rows[:, k, 1] = lin.model * (1.0 - guidance)
        rows[:, k, 2] = lin.model * guidance
        rows[:, k, 3] = lin.prev
        rows[:, k, 4] = lin.noise
    return rows.astype(dtype)
