"""The flow-matching Euler step and the DiT decode preparation as small ONNX graphs, run by the transformer's
provider, so the latents stay on the device between transformer calls (the DESIGN's step-on-device rule).

Step: ``sample`` [B, ...] float32 (SD 3's [B,C,h,w] latents or Flux's packed [B,tokens,4C]: ``packed``),
``model_out`` [2B, ...] (uncond rows first, then text; the transformer's output dtype) with CFG or [B, ...]
without, and ``coeffs`` [B,1,3] float32: per image the weights of (sample, uncond, text). Outputs ``next`` (float32,
the sample's shape) and ``model_in`` (the transformer's next input in its dtype: ``next`` twice with CFG). A flow
Euler step with guidance w and ``dt = sigma_next - sigma`` is ``next = sample + dt * ((1 - w) * uncond + w * text)``,
so the coefficients are (1, dt (1 - w), dt w); without CFG they are (1, 0, dt) and ``model_out`` fills both
basis terms (``flow_coefficients``).

Decode: ``latents / scaling_factor + shift_factor`` in the VAE's input dtype; for Flux after unpacking the 2×2
tokens back to [B,C,h,w] (Reshape/Transpose with the shapes as inputs: only the request knows h and w).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from engines.numerics.step_graph import elem_type, serialize

STATE = np.float32


def _dims(packed: bool, rows: str = "B") -> list[str]:
    """Declared shapes (TensorRT's parser needs every input's rank): Flux's tokens or SD 3's latents."""
    return [rows, "T", "D"] if packed else [rows, "C", "H", "W"]


def build_flow_step_graph(model_in: type[np.generic], model_out: type[np.generic], cfg: bool,
                          packed: bool = False) -> bytes:
    """Serialized ONNX model of one flow Euler step (see the module docstring); arithmetic in float32."""
    f32 = TensorProto.FLOAT
    out_elem, in_elem = elem_type(model_out), elem_type(model_in)
    flat = numpy_helper.from_array(np.array([0, 1, -1], dtype=np.int64), "flat_shape")
    nodes = [helper.make_node("Shape", ["sample"], ["shape"])]
    source = "model_out"
    if out_elem != f32:
        nodes.append(helper.make_node("Cast", ["model_out"], ["model_out_f"], to=f32))
        source = "model_out_f"
    nodes += [helper.make_node("Split", [source], ["uncond", "text"], axis=0)] if cfg else \
        [helper.make_node("Identity", [source], ["uncond"]), helper.make_node("Identity", [source], ["text"])]
    for name in ("sample", "uncond", "text"):
        nodes.append(helper.make_node("Reshape", [name, "flat_shape"], [f"{name}_flat"]))
    nodes += [
        helper.make_node("Concat", ["sample_flat", "uncond_flat", "text_flat"], ["stack"], axis=1),  # [B,3,N]
        helper.make_node("MatMul", ["coeffs", "stack"], ["combined"]),  # [B,1,N]
        helper.make_node("Reshape", ["combined", "shape"], ["next"]),
        helper.make_node("Concat", ["next", "next"] if cfg else ["next"], ["model_in_f"], axis=0),
        helper.make_node("Cast", ["model_in_f"], ["model_in"], to=in_elem),
    ]
    rows = "B2" if cfg else "B"
    inputs = [helper.make_tensor_value_info("sample", f32, _dims(packed)),
              helper.make_tensor_value_info("model_out", out_elem, _dims(packed, rows)),
              helper.make_tensor_value_info("coeffs", f32, ["B", 1, 3])]
    outputs = [helper.make_tensor_value_info("next", f32, _dims(packed)),
               helper.make_tensor_value_info("model_in", in_elem, _dims(packed, rows))]
    return serialize(nodes, "sdserve_flow_step", inputs, outputs, [flat])


def flow_coefficients(sigma: float, sigma_next: float, guidance: np.ndarray, cfg: bool) -> np.ndarray:
    """[B,1,3] float32 weights of (sample, uncond, text) for one step; images with guidance <= 1 in a CFG batch
    take the text prediction alone (as a batch of their own would, without CFG)."""
    dt = float(np.float32(sigma_next) - np.float32(sigma))
    w = np.where(guidance > 1.0, guidance, 1.0).astype(np.float64) if cfg else np.ones(len(guidance))
    rows = np.stack([np.ones(len(w)), dt * (1.0 - w) if cfg else np.zeros(len(w)), dt * w], axis=-1)
    return rows.reshape(len(w), 1, 3).astype(STATE)


def build_flow_decode_graph(scaling: float, shift: float, vae_in: type[np.generic], packed: bool) -> bytes:
    """Serialized ONNX model ``scaled = Cast(unpack(latents) / scaling + shift)``. ``packed`` (Flux): inputs
    ``unpacked_shape`` [6] = (B, h/2, w/2, C, 2, 2) and ``image_shape`` [4] = (B, C, h, w), int64."""
    f32, out = TensorProto.FLOAT, elem_type(vae_in)
    consts = [numpy_helper.from_array(np.array([scaling], dtype=STATE), "scaling"),
              numpy_helper.from_array(np.array([shift], dtype=STATE), "shift")]
    inputs = [helper.make_tensor_value_info("latents", f32, ["B", "T", "D"] if packed else ["B", "C", "H", "W"])]
    nodes = []
    source = "latents"
    if packed:
        inputs += [helper.make_tensor_value_info("unpacked_shape", TensorProto.INT64, [6]),
                   helper.make_tensor_value_info("image_shape", TensorProto.INT64, [4])]
        nodes += [helper.make_node("Reshape", ["latents", "unpacked_shape"], ["patches"]),
                  helper.make_node("Transpose", ["patches"], ["ordered"], perm=[0, 3, 1, 4, 2, 5]),
                  helper.make_node("Reshape", ["ordered", "image_shape"], ["unpacked"])]
        source = "unpacked"
    nodes += [helper.make_node("Div", [source, "scaling"], ["divided"]),
              helper.make_node("Add", ["divided", "shift"], ["shifted"]),
              helper.make_node("Cast", ["shifted"], ["scaled"], to=out)]
    outputs = [helper.make_tensor_value_info("scaled", out, ["B", "C", "H", "W"])]
    return serialize(nodes, "sdserve_flow_decode", inputs, outputs, consts)


def flow_start(steps: int, strength: float) -> int:
    """The first step an edit of ``strength`` runs, as the Flux and SD 3 img2img pipelines' ``get_timesteps``:
    ``int(steps - steps * strength)`` (not the UNet pipelines' ``steps - int(steps * strength)``); ValueError
    outside (0, 1]."""
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"strength {strength} must be in (0, 1]")
    return int(max(steps - min(steps * strength, steps), 0))


def build_flow_noise_graph(scaling: float, shift: float, model_in: type[np.generic], copies: int,
                           packed: bool) -> bytes:
    """Serialized ONNX model of an edit's start: the VAE sample ``sample`` [B,C,h,w] becomes the model's latents
    ``(sample - shift) * scaling``, noised to the first step's level as the flow scheduler's ``scale_noise``:
    ``next = sigma * noise + (1 - sigma) * latents`` (``sigma`` [1] float32, ``noise`` [B,C,h,w]). ``packed`` (Flux):
    then 2×2-packed with the shape inputs ``patch_shape`` [6] = (B, C, h/2, 2, w/2, 2) and ``token_shape`` [3] =
    (B, h*w/4, 4C). Outputs ``next`` float32 and ``model_in`` (``copies`` rows in the transformer's dtype)."""
    f32, in_elem = TensorProto.FLOAT, elem_type(model_in)
    consts = [numpy_helper.from_array(np.array([v], dtype=STATE), n)
              for n, v in (("scaling", scaling), ("shift", shift), ("one", 1.0))]
    latent = ["B", "C", "H", "W"]
    inputs = [helper.make_tensor_value_info("sample", f32, latent), helper.make_tensor_value_info("noise", f32, latent),
              helper.make_tensor_value_info("sigma", f32, [1])]
    nodes = [helper.make_node("Sub", ["sample", "shift"], ["centered"]),
             helper.make_node("Mul", ["centered", "scaling"], ["latents"]),
             helper.make_node("Mul", ["sigma", "noise"], ["noisy"]),
             helper.make_node("Sub", ["one", "sigma"], ["keep"]),
             helper.make_node("Mul", ["keep", "latents"], ["kept"]),
             helper.make_node("Add", ["noisy", "kept"], ["noised"])]
    result = "noised"
    if packed:
        inputs += [helper.make_tensor_value_info("patch_shape", TensorProto.INT64, [6]),
                   helper.make_tensor_value_info("token_shape", TensorProto.INT64, [3])]
        nodes += [helper.make_node("Reshape", ["noised", "patch_shape"], ["patches"]),
                  helper.make_node("Transpose", ["patches"], ["ordered"], perm=[0, 2, 4, 1, 3, 5]),
                  helper.make_node("Reshape", ["ordered", "token_shape"], ["tokens"])]
        result = "tokens"
    nodes += [helper.make_node("Identity", [result], ["next"]),
              helper.make_node("Concat", [result] * copies, ["rows"], axis=0),
              helper.make_node("Cast", ["rows"], ["model_in"], to=in_elem)]
    outputs = [helper.make_tensor_value_info("next", f32, _dims(packed)),
               helper.make_tensor_value_info("model_in", in_elem, _dims(packed, "R"))]
    return serialize(nodes, "sdserve_flow_noise", inputs, outputs, consts)
