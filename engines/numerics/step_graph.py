"""The scheduler step and the decode scaling as small ONNX graphs, run by the same provider as the UNet.

Step inputs: ``sample`` [B,C,H,W], ``model_out`` [2B,C,H,W] (uncond first, then text; the UNet's output dtype),
``prev`` [B,C,H,W] (previous denoised estimate), ``noise`` [B,C,H,W], ``coeffs`` [B,2,5] (per image: rows
next/denoised over the basis sample, uncond, text, prev, noise) and ``in_scale`` [1]. Multistep samplers use the
graph with ``history`` K > 1: inputs ``prev2`` .. ``prevK`` (the entries pushed 2..K evaluations back, a ring of
device buffers the pipeline rotates) and K - 1 more coefficient columns. Outputs: ``next`` and
``denoised`` [B,C,H,W], and ``model_in`` [2B,C,H,W] = next * in_scale twice, in the UNet's input dtype: the UNet
input of the following step.

The latents and the scheduler state are float32 whatever the UNet's dtype, and so is every step's arithmetic:
diffusers upcasts the sample before the step for the same reason (``sample = sample.to(torch.float32)`` in
diffusers/schedulers/scheduling_euler_discrete.py and scheduling_dpmsolver_multistep.py, ``step``). fp16 carries
about three significant digits; latents start at sigma ~14.6 and the x0 estimates subtract nearly equal terms.
Unlike diffusers, the state is not cast back to the model dtype after the step: only ``model_in`` is.

On a GPU every node here has a CUDA kernel for float and float16 (Cast: onnxruntime/core/providers/cuda/tensor/
cast_op.cc; Mul, MatMul: cuda/math/binary_elementwise_ops.cc, cuda/math/matmul.cc), so the arithmetic stays on
the device; only ``Shape`` feeds the CPU, as a shape value.

Without CFG (every image's guidance <= 1, e.g. Turbo at guidance 0) the UNet runs on the B conditional rows only:
``build_step_graph(..., cfg=False)`` takes ``model_out`` [B,C,H,W] as both the uncond and text basis terms (their
coefficients then sum to the model coefficient) and writes ``model_in`` [B,C,H,W].
"""

from __future__ import annotations

import numpy as np
from onnx import NodeProto, TensorProto, ValueInfoProto, helper, numpy_helper

from engines.numerics.schedulers import Lin

BASIS = ("sample", "uncond", "text", "prev", "noise")
STATE_DTYPE = np.float32
"""The dtype of latents, scheduler state, noise and coefficients on the device."""


def elem_type(dtype: type[np.generic]) -> int:
    return TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT


def serialize(nodes: list[NodeProto], name: str, inputs: list[ValueInfoProto], outputs: list[ValueInfoProto],
           initializers: list[TensorProto]) -> bytes:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sdserve")
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _to_compute(inputs: dict[str, int], calc: int) -> tuple[list[NodeProto], dict[str, str]]:
    """For each graph input, the name holding it in the compute type: the input itself or a Cast of it."""
    names = {name: name if elem == calc else f"{name}_c" for name, elem in inputs.items()}
    nodes = [helper.make_node("Cast", [name], [names[name]], to=calc) for name, elem in inputs.items() if elem != calc]
    return nodes, names


def _from_compute(outputs: dict[str, int], calc: int) -> tuple[list[NodeProto], dict[str, str]]:
    """For each graph output, the name the computing node writes: the output itself or a value Cast into it."""
    names = {name: name if elem == calc else f"{name}_c" for name, elem in outputs.items()}
    nodes = [helper.make_node("Cast", [names[name]], [name], to=elem) for name, elem in outputs.items() if elem != calc]
    return nodes, names


def basis(history: int = 1) -> tuple[str, ...]:
    """The step graph's basis, in coefficient-column order: the single-history layout, then earlier entries."""
    return (*BASIS, *(f"prev{k}" for k in range(2, history + 1)))


def build_step_graph(unet_in: type[np.generic], unet_out: type[np.generic],
                     compute: type[np.generic] = STATE_DTYPE, cfg: bool = True, history: int = 1) -> bytes:
    """Serialized ONNX model of the step. State inputs/outputs are float32; ``model_out`` is ``unet_out`` and
    ``model_in`` is ``unet_in`` (the UNet's output and sample input dtypes). ``compute`` is the arithmetic precision:
    always float32 in the pipeline; float16 reproduces the old all-fp16 step, kept for the drift test. ``cfg``
    False: the UNet ran on the conditional rows only (model_out and model_in have B rows, not 2B). ``history`` > 1
    adds inputs ``prev2`` .. ``prev{history}`` (earlier history entries, multistep samplers) and coefficient columns
    for them after ``noise``."""
    unet, out, state, calc = elem_type(unet_in), elem_type(unet_out), elem_type(STATE_DTYPE), elem_type(compute)
    latent = ["B", "C", "H", "W"]
    rows = "B2" if cfg else "B"
    names = basis(history)
    earlier = names[len(BASIS):]
    inputs = [helper.make_tensor_value_info("sample", state, latent),
              helper.make_tensor_value_info("model_out", out, [rows, "C", "H", "W"]),
              helper.make_tensor_value_info("prev", state, latent),
              helper.make_tensor_value_info("noise", state, latent),
              helper.make_tensor_value_info("coeffs", state, ["B", 2, len(names)]),
              helper.make_tensor_value_info("in_scale", state, [1]),
              *[helper.make_tensor_value_info(name, state, latent) for name in earlier]]
    outputs = [helper.make_tensor_value_info("next", state, latent),
               helper.make_tensor_value_info("denoised", state, latent),
               helper.make_tensor_value_info("model_in", unet, [rows, "C", "H", "W"])]
    flat = numpy_helper.from_array(np.array([0, 1, -1], dtype=np.int64), "flat_shape")
    cast_in, x = _to_compute({"sample": state, "model_out": out, "prev": state, "noise": state,
                              "coeffs": state, "in_scale": state, **dict.fromkeys(earlier, state)}, calc)
    cast_out, y = _from_compute({"next": state, "denoised": state, "model_in": unet}, calc)
    nodes = [
        *cast_in,
        helper.make_node("Shape", ["sample"], ["shape"]),
        *([helper.make_node("Split", [x["model_out"]], ["uncond", "text"], axis=0)] if cfg else
          [helper.make_node("Identity", [x["model_out"]], ["uncond"]),
           helper.make_node("Identity", [x["model_out"]], ["text"])]),
        *[helper.make_node("Reshape", [x.get(name, name), "flat_shape"], [f"{name}_flat"]) for name in names],
        helper.make_node("Concat", [f"{name}_flat" for name in names], ["stack"], axis=1),  # [B,4+history,N]
        helper.make_node("MatMul", [x["coeffs"], "stack"], ["combined"]),  # [B,2,N]
        helper.make_node("Split", ["combined"], ["next_flat", "denoised_flat"], axis=1),
        helper.make_node("Reshape", ["next_flat", "shape"], [y["next"]]),
        helper.make_node("Reshape", ["denoised_flat", "shape"], [y["denoised"]]),
        helper.make_node("Mul", [y["next"], x["in_scale"]], ["scaled"]),
        helper.make_node("Concat", ["scaled", "scaled"] if cfg else ["scaled"], [y["model_in"]], axis=0),
        *cast_out,
    ]
    return serialize(nodes, "sdserve_scheduler_step", inputs, outputs, [flat])


def build_scale_graph(scale: float, out_dtype: type[np.generic]) -> bytes:
    """Serialized ONNX model ``scaled = Cast(latents * scale)``: float32 latents in, ``out_dtype`` out. The decode
    step's ``latents / scaling_factor`` on the device, written straight in the VAE's input dtype."""
    latent = ["B", "C", "H", "W"]
    factor = numpy_helper.from_array(np.array([scale], dtype=STATE_DTYPE), "scale")
    nodes = [helper.make_node("Mul", ["latents", "scale"], ["product"]),
             helper.make_node("Cast", ["product"], ["scaled"], to=elem_type(out_dtype))]
    return serialize(nodes, "sdserve_latent_scale",
                  [helper.make_tensor_value_info("latents", elem_type(STATE_DTYPE), latent)],
                  [helper.make_tensor_value_info("scaled", elem_type(out_dtype), latent)], [factor])


def build_text_join_graph(h1: type[np.generic], h2: type[np.generic], pooled: type[np.generic],
                          hidden_out: type[np.generic], pooled_out: type[np.generic]) -> bytes:
    """Serialized ONNX model of SDXL's conditioning on the device: ``hidden = concat(h1, h2, axis=-1) * keep`` and
    ``text_embeds = pooled * keep``, where ``keep`` [B,1] float32 is 0 for rows conditioned on zeros (an empty
    negative prompt under force_zeros_for_empty_prompt) and 1 otherwise; inputs in the encoders' output dtypes,
    outputs in the UNet's input dtypes (float32 in between)."""
    state = elem_type(STATE_DTYPE)
    elems = {"h1": elem_type(h1), "h2": elem_type(h2), "pooled": elem_type(pooled), "keep": state}
    cast_in, x = _to_compute(elems, state)
    cast_out, y = _from_compute({"hidden": elem_type(hidden_out), "text_embeds": elem_type(pooled_out)}, state)
    shape3 = numpy_helper.from_array(np.array([-1, 1, 1], dtype=np.int64), "keep_shape")
    nodes = [*cast_in,
             helper.make_node("Concat", [x["h1"], x["h2"]], ["joined"], axis=2),
             helper.make_node("Reshape", [x["keep"], "keep_shape"], ["keep3"]),
             helper.make_node("Mul", ["joined", "keep3"], [y["hidden"]]),
             helper.make_node("Mul", [x["pooled"], x["keep"]], [y["text_embeds"]]),
             *cast_out]
    inputs = [helper.make_tensor_value_info("h1", elems["h1"], ["B", "T", "D1"]),
              helper.make_tensor_value_info("h2", elems["h2"], ["B", "T", "D2"]),
              helper.make_tensor_value_info("pooled", elems["pooled"], ["B", "P"]),
              helper.make_tensor_value_info("keep", state, ["B", 1])]
    outputs = [helper.make_tensor_value_info("hidden", elem_type(hidden_out), ["B", "T", "D"]),
               helper.make_tensor_value_info("text_embeds", elem_type(pooled_out), ["B", "P"])]
    return serialize(nodes, "sdserve_text_join", inputs, outputs, [shape3])


def step_coefficients(next_: Lin, denoised: Lin, guidance: np.ndarray, history: int = 1) -> np.ndarray:
    """[B,2,4+history] float32 coefficients: the model output ``(1 - w)*uncond + w*text`` expanded per image's
    guidance w. Raises ValueError when a coefficient needs a history entry deeper than ``history``."""
    rows = np.zeros((len(guidance), 2, 4 + history), dtype=np.float64)
    for k, lin in enumerate((next_, denoised)):
        if any(lin.earlier[history - 1:]):
            raise ValueError(f"a step reads history entry {len(lin.earlier) + 1}; the graph carries {history}")
        rows[:, k, 0] = lin.sample
        rows[:, k, 1] = lin.model * (1.0 - guidance)
        rows[:, k, 2] = lin.model * guidance
        rows[:, k, 3] = lin.prev
        rows[:, k, 4] = lin.noise
        for j, c in enumerate(lin.earlier[:history - 1]):
            rows[:, k, 5 + j] = c
    return rows.astype(STATE_DTYPE)
