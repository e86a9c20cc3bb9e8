"""Qwen-Image txt2img and img2img on ONNX Runtime (no torch), as diffusers' ``QwenImagePipeline`` and
``QwenImageImg2ImgPipeline`` (0.42) do it, on the flow-matching base (engines/pipelines/flow.py): its hooks give
the text (template, key mask), the geometry of its VAE, the rotary tables and the norm-rescaled true-CFG step; the
denoising loop, step-level batching (rows joined on the device), the output-level step cache, ``finish`` and the
checks are the base's.

The folder is the layout engines/build/qwen_export.py writes. Per batch:

1. Text: each prompt in the chat template (engines/numerics/qwen_tokenizer.py), the Qwen2.5-VL language model's
   last hidden states, the system prefix's 34 tokens dropped, at most ``max_sequence_length`` (512) kept; rows are
   zero-padded to that length with a key mask (``encoder_hidden_states_mask``): diffusers pads a batch to its
   longest prompt and masks the rest, a lone prompt unpadded; a masked key changes nothing, and a fixed length
   lets the rows of any requests share a transformer call.
2. Latents: 16 channels, 2×2-packed as Flux's; the schedule is Flux's evenly spaced sigmas, shifted by ``mu`` of
   the packed token count and stretched to ``shift_terminal`` (engines/numerics/flow_schedule.py).
3. Transformer: timestep ``t / 1000``; rotary tables computed here (``qwen_rope``) as ``QwenEmbedRope`` computes
   them in float32 (``scale_rope``: image rows and columns centred on 0, text positions after the image's largest
   half-side, the same on the three axes).
4. True CFG (``true_cfg_scale`` > 1: the request's guidance; the negative prompt, empty by default, as diffusers
   given ``negative_prompt=""``): ``comb = neg + s (cond - neg)`` rescaled per token to the conditional
   prediction's norm, ``comb * |cond| / |comb|``, then the Euler step: one small graph (``build_qwen_cfg_graph``).
5. Decode: unpack; the VAE decoder (one frame) applies the latents' per-channel mean/std itself (folded in at
   export), so the decode graph scales by 1.

img2img (engines/pipelines/flow_edits.py): the encoder's moments are those of the normalised latents (folded in at
export), sampled with the image's stream and noised by ``scale_noise``; ``strength`` picks the first step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from engines.lora.active import Adapters
from engines.numerics.flow_graph import flow_coefficients
from engines.numerics.flow_schedule import FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.qwen_tokenizer import TEMPLATE_DROP, QwenTokenizer
from engines.numerics.step_graph import elem_type, serialize
from engines.pipelines.flow import DitConditioning, FlowPipeline, Geometry, run
from engines.pipelines.ort_model import OrtModel
from engines.pipelines.unet_family import read_json
from engines.types.request import Batch

ROPE_THETA = 10000
"""QwenEmbedRope(theta=10000)."""


def _axis_angles(positions: np.ndarray, dim: int) -> np.ndarray:
    """``rope_params`` in float32: ``outer(pos, 1 / theta^(arange(0, dim, 2) / dim))``."""
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / np.power(np.float32(ROPE_THETA), exponent)).astype(np.float32)
    return np.outer(positions.astype(np.float32), inv).astype(np.float32)


def qwen_rope(grid_h: int, grid_w: int, text: int, axes_dim: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Rotary (cos, sin) tables [text + grid_h * grid_w, sum(axes_dim)] float32 over the joint sequence (text
    first), each angle twice (interleaved pairs); positions as ``QwenEmbedRope(scale_rope=True)`` for one frame."""
    rows = np.arange(grid_h) - (grid_h - grid_h // 2)
    cols = np.arange(grid_w) - (grid_w - grid_w // 2)
    image = np.stack([np.zeros(grid_h * grid_w, np.int64), np.repeat(rows, grid_w), np.tile(cols, grid_h)], 1)
    start = max(grid_h // 2, grid_w // 2)
    words = np.repeat(np.arange(start, start + text)[:, None], 3, axis=1)
    positions = np.concatenate([words, image])
    angles = np.concatenate([_axis_angles(positions[:, a], d) for a, d in enumerate(axes_dim)], axis=1)
    return np.repeat(np.cos(angles), 2, axis=1), np.repeat(np.sin(angles), 2, axis=1)


def build_qwen_cfg_graph(model_in: type[np.generic], model_out: type[np.generic]) -> bytes:
    """Serialized ONNX model of one true-CFG Euler step on packed tokens: ``model_out`` [2B,T,D] (negatives
    first), ``coeffs`` [B,1,2] = (dt, scale) per image; ``comb = neg + scale (cond - neg)``, rescaled per token to
    ``|cond| / |comb|`` (L2 over D), ``next = sample + dt * guided`` in float32; ``model_in`` is ``next`` twice."""
    f32, out_elem, in_elem = TensorProto.FLOAT, elem_type(model_out), elem_type(model_in)
    nodes, source = [], "model_out"
    if out_elem != f32:
        nodes.append(helper.make_node("Cast", ["model_out"], ["model_out_f"], to=f32))
        source = "model_out_f"
    nodes += [
        helper.make_node("Split", [source], ["neg", "cond"], axis=0),
        helper.make_node("Split", ["coeffs"], ["dt", "scale"], axis=2),
        helper.make_node("Sub", ["cond", "neg"], ["delta"]),
        helper.make_node("Mul", ["delta", "scale"], ["scaled"]),
        helper.make_node("Add", ["neg", "scaled"], ["comb"]),
        helper.make_node("ReduceL2", ["cond"], ["cond_norm"], axes=[-1], keepdims=1),
        helper.make_node("ReduceL2", ["comb"], ["comb_norm"], axes=[-1], keepdims=1),
        helper.make_node("Div", ["cond_norm", "comb_norm"], ["ratio"]),
        helper.make_node("Mul", ["comb", "ratio"], ["guided"]),
        helper.make_node("Mul", ["dt", "guided"], ["moved"]),
        helper.make_node("Add", ["sample", "moved"], ["next"]),
        helper.make_node("Concat", ["next", "next"], ["model_in_f"], axis=0),
        helper.make_node("Cast", ["model_in_f"], ["model_in"], to=in_elem),
    ]
    inputs = [helper.make_tensor_value_info("sample", f32, ["B", "T", "D"]),
              helper.make_tensor_value_info("model_out", out_elem, ["B2", "T", "D"]),
              helper.make_tensor_value_info("coeffs", f32, ["B", 1, 2])]
    outputs = [helper.make_tensor_value_info("next", f32, ["B", "T", "D"]),
               helper.make_tensor_value_info("model_in", in_elem, ["B2", "T", "D"])]
    return serialize(nodes, "sdserve_qwen_cfg_step", inputs, outputs, [])


def cfg_coefficients(sigma: float, sigma_next: float, guidance: np.ndarray) -> np.ndarray:
    """[B,1,2] float32 (dt, scale) of one true-CFG step; an image with guidance <= 1 in a CFG batch takes scale 1
    (its conditional prediction, rescaled by 1)."""
    dt = np.float32(sigma_next) - np.float32(sigma)
    scale = np.where(guidance > 1.0, guidance, 1.0).astype(np.float32)
    return np.stack([np.full(len(scale), dt, np.float32), scale], axis=-1).reshape(len(scale), 1, 2)


class QwenPipeline(FlowPipeline):
    """Qwen-Image txt2img and img2img: true CFG with norm rescaling, a fixed-length masked text sequence."""

    FIRST_BLOCK = False
    """The first-block cache's parts are not exported for Qwen-Image."""

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        self.text_encoder, self.tokenizer = models["text_encoder"], QwenTokenizer(folder / "tokenizer")
        self.text_encoders.append(self.text_encoder)

    def read_geometry(self, folder: Path) -> Geometry:
        """The causal 3D VAE: one 2x downsample per ``temperal_downsample`` entry, ``z_dim`` channels; its
        per-channel mean/std are folded into the exported halves, so the decode graph scales by 1."""
        vae = read_json(folder / "vae_decoder" / "config.json")
        scale = 2 ** len(vae.get("temperal_downsample", (False, True, True)))
        return Geometry(scale, int(vae.get("z_dim", 16)), 1.0, 0.0, scale * 2)

    def schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        """Flux's evenly spaced sigmas, shifted by ``mu`` of the packed token count (and stretched to
        ``shift_terminal`` by the flow config)."""
        return flow_schedule(self.flow, steps, sigmas=flux_sigmas(steps), mu=self.flow.mu(h * w // 4))

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """The template's states, system prefix dropped, zero-padded to the fixed length with a key mask."""
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        k = len(negatives)
        tokens = self.tokenizer(negatives + [s.prompt for s in batch.images], length)
        ids = self.checked_tokens(batch, "text encoder (max_sequence_length)", tokens.ids, tokens.truncated, length, k)
        hidden = run(self.text_encoder, {next(iter(self.text_encoder.inputs)): ids}, ["last_hidden_state"],
                     adapters)[0]
        states = np.zeros((len(ids), length, hidden.shape[-1]), dtype=np.float32)
        mask = np.zeros((len(ids), length), dtype=np.float32)
        for row, kept in enumerate(tokens.kept):
            states[row, :kept] = hidden[row, TEMPLATE_DROP:TEMPLATE_DROP + kept]
            mask[row, :kept] = 1.0
        cut = tokens.truncated
        return DitConditioning(states, None, cut[k:], cut[:k] if cfg else (False,) * len(batch.images), mask)

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """The rotary tables of this size over the joint sequence (text then image tokens)."""
        cos, sin = qwen_rope(h // 2, w // 2, cond.states.shape[1], self.axes_dim)
        return {"rope_cos": cos, "rope_sin": sin}

    def step_graphs(self, model_in: type[np.generic], model_out: type[np.generic]) -> tuple[OrtModel, OrtModel]:
        """The flow Euler step, and the norm-rescaling true-CFG step."""
        plain, _ = super().step_graphs(model_in, model_out)
        return plain, self._make(build_qwen_cfg_graph(model_in, model_out), "qwen_cfg_step")

    def coefficients(self, sigma: float, sigma_next: float, guidance: np.ndarray, cfg: bool) -> np.ndarray:
        return cfg_coefficients(sigma, sigma_next, guidance) if cfg else \
            flow_coefficients(sigma, sigma_next, guidance, False)
