"""Qwen-Image txt2img and img2img on ONNX Runtime (no torch), as diffusers' ``QwenImagePipeline`` and
``QwenImageImg2ImgPipeline`` (0.42) do it. A ``DitOnnx`` whose begin (text, schedule, start, transformer feeds),
CFG step and decode are Qwen-Image's; the denoising loop, step-level batching (rows joined on the device), the
output-level step cache, ``finish`` and the checks are DitOnnx's.

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

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from engines.errors import InferenceError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.flow_graph import build_flow_decode_graph, build_flow_step_graph, flow_coefficients, flow_start
from engines.numerics.flow_schedule import FlowMatchConfig, FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.qwen_tokenizer import TEMPLATE_DROP, QwenTokenizer
from engines.numerics.rows import RowPacker, shape_feed
from engines.numerics.step_cache import OutputCache, Probe
from engines.numerics.step_graph import elem_type, serialize
from engines.pipelines.flow import NATIVE_SIZE_KEY, SAMPLERS, DitDenoising, DitOnnx, pack_latents, run
from engines.pipelines.flow_edits import DitEditor
from engines.pipelines.flow_family import QWEN_VARIANT_KEYS, detect_dit
from engines.pipelines.unet import Begun, Feed, OrtModel, image_rng
from engines.pipelines.unet_family import read_json
from engines.runtime.sessions import Runtime
from engines.types.model import ModelInfo
from engines.types.request import CACHE_MIN_STEPS, Batch

ROPE_THETA = 10000
"""QwenEmbedRope(theta=10000)."""
PARTS = ("text_encoder", "transformer", "vae_decoder")
ROW_FEEDS = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask")


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


@dataclass(frozen=True)
class QwenConditioning:
    states: np.ndarray
    """[rows, max_sequence_length, width]: negatives first under CFG, zero past each row's kept tokens."""
    mask: np.ndarray
    """[rows, max_sequence_length] float32: 1 for a kept token, 0 for padding."""
    truncated: tuple[bool, ...]
    negative_truncated: tuple[bool, ...]


@dataclass(frozen=True)
class QwenGeometry:
    vae_scale_factor: int
    latent_channels: int

    @property
    def size_multiple(self) -> int:
        return self.vae_scale_factor * 2


class QwenOnnx(DitOnnx):
    """Loads an exported Qwen-Image folder and runs txt2img and img2img batches (engines.protocol.Batch)."""

    def __init__(self, folder: Path, runtime: Runtime, label: str = "", sources: dict[str, Path] | None = None) -> None:
        """ModelLoadError (exit 11) when the folder is no Qwen-Image export or misses a component. ``sources``:
        per component, the model to load instead of ``<component>/model.onnx``."""
        given = sources or {}
        self.family = detect_dit(folder)
        if self.family.base != "qwen-image":
            raise ModelLoadError(f"{folder} is {self.family.name}, not Qwen-Image")
        for part in PARTS:
            if not (folder / part / "model.onnx").is_file():
                raise ModelLoadError(f"{folder} has no {part}/model.onnx (the ONNX layout of a Qwen-Image model: "
                                     "`sdserve engines export`)")
        self.runtime = runtime

        def make(model: Path | bytes, name: str) -> OrtModel:
            return OrtModel(runtime, model, name + label)

        models = {part: make(given.get(part, folder / part / "model.onnx"), part) for part in PARTS}
        self.text_encoder, self.transformer, self.vae_decoder = (models[p] for p in PARTS)
        self.tokenizer = QwenTokenizer(folder / "tokenizer")
        self.flow = FlowMatchConfig.from_config(read_json(folder / "scheduler" / "scheduler_config.json"))
        config = read_json(folder / "transformer" / "config.json")
        if any(config.get(key) for key in QWEN_VARIANT_KEYS):
            raise ModelLoadError(f"{folder}: an Edit/Layered Qwen-Image transformer is not served")
        self.axes_dim = tuple(int(a) for a in config.get("axes_dims_rope", (16, 56, 56)))
        vae = read_json(folder / "vae_decoder" / "config.json")
        self.shape = QwenGeometry(2 ** len(vae.get("temperal_downsample", (False, True, True))),
                                  int(vae.get("z_dim", 16)))
        native = read_json(folder / "model_index.json").get(NATIVE_SIZE_KEY)
        self._native = int(native) if native else 1024  # QwenImagePipeline: default_sample_size 128 x 8
        self.max_sequence_length = self.family.max_sequence_length
        self.guidance_input = False
        in_dtype, out_dtype = self.transformer.input_dtype("hidden_states"), self.transformer.output_dtype()
        self.step = make(build_flow_step_graph(in_dtype, out_dtype, cfg=False, packed=True), "flow_step")
        self.step_cfg = make(build_qwen_cfg_graph(in_dtype, out_dtype), "qwen_cfg_step")
        kinds = [(self.transformer.input_dtype(name), len(arg.shape)) for name, arg in self.transformer.inputs.items()
                 if name in ROW_FEEDS]
        self.rows = RowPacker(runtime, make, kinds, (out_dtype, len(self.transformer.session.get_outputs()[0].shape)))
        self.cache_probe = Probe.build(make, [in_dtype, out_dtype])
        self.first_block = None
        vae_in = next(iter(self.vae_decoder.inputs))
        self.decode_scale = make(build_flow_decode_graph(1.0, 0.0, self.vae_decoder.input_dtype(vae_in), True),
                                 "flow_decode")
        encoder = folder / "vae_encoder" / "model.onnx"
        self.editor = DitEditor(runtime, make(given.get("vae_encoder", encoder), "vae_encoder"), make, 1.0, 0.0,
                                in_dtype, True) if encoder.is_file() else None
        self.edits_unavailable = "" if self.editor else (
            f"{folder.name} has no vae_encoder/model.onnx: it serves txt2img only (re-export it with "
            "`sdserve engines export` to serve img2img)")

    @property
    def size_multiple(self) -> int:
        """The VAE factor × the 2×2 pack: 16."""
        return self.shape.size_multiple

    @property
    def default_size(self) -> int:
        """QwenImagePipeline's default (``default_sample_size`` 128 × the VAE factor 8: 1024)."""
        return self._native

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """What the engine reports and validates requests against (``/v1/models``, ``/capabilities``)."""
        f = self.family
        return ModelInfo(name=name, size_multiple=self.size_multiple, default_size=self.default_size,
                         schedulers=SAMPLERS, max_prompt_tokens=self.max_sequence_length, digest=digest,
                         family=f.name, prediction_type="flow", text_encoders=1, vae_scaling_factor=1.0,
                         cfg_default=True, default_steps=f.steps, default_guidance=f.guidance,
                         modes=("txt2img", "img2img") if self.editor else ("txt2img",),
                         edits_unavailable=self.edits_unavailable, edit_schedulers=SAMPLERS if self.editor else ())

    def adaptable(self) -> list[OrtModel]:
        return [self.transformer, self.text_encoder]

    def begin(self, batch: Batch, latents: np.ndarray | None = None, adapters: Adapters | None = None,
              max_sequence_length: int | None = None) -> Begun:
        """Encode the prompts (negatives first under CFG), draw each image's noise, prepare an img2img batch's start
        and the denoising state (every buffer under the runtime's current scope)."""
        self.check_inputs(batch)
        t0 = time.perf_counter()
        length = max_sequence_length or self.max_sequence_length
        guidance = np.array([s.guidance_scale for s in batch.images], dtype=np.float32)
        cfg = bool((guidance > 1.0).any())
        # 1. Text: the template's states, system prefix dropped, padded to the fixed length with a key mask.
        cond = self._encode_qwen(batch, length, cfg, adapters)
        t1 = time.perf_counter()
        # 2. Noise per image from its seed; the schedule (an edit's strength skips the first steps); the start.
        f = self.shape.vae_scale_factor
        h, w = batch.height // f, batch.width // f
        rngs = [image_rng(s.seed) for s in batch.images]
        seeded = np.stack([r.standard_normal((self.shape.latent_channels, h, w), dtype=np.float32) for r in rngs])
        x = seeded if latents is None else latents.astype(np.float32)  # the streams advance either way
        full = flow_schedule(self.flow, batch.steps, sigmas=flux_sigmas(batch.steps), mu=self.flow.mu(h * w // 4))
        first = flow_start(batch.steps, batch.strength) if batch.mode == "img2img" else 0
        schedule = FlowSchedule(full.timesteps[first:], full.sigmas[first:])
        start, model_in = self._qwen_start(batch, x, rngs, float(schedule.sigmas[0]), 2 if cfg else 1)
        t2 = time.perf_counter()
        # 3. The denoising state on the device (DitOnnx runs the loop).
        state = self._qwen_denoise(start, model_in, self._qwen_feeds(cond, h, w), guidance, schedule, cfg,
                                   adapters, (h, w))
        if batch.cache is not None and batch.steps >= CACHE_MIN_STEPS and batch.cache.method == "output":
            state.cache = OutputCache.start(batch.cache, state.evaluations, self.cache_probe, state.model_in,
                                            state.model_out, self.runtime.buffer)
        return Begun(batch, state, cond, None, len(schedule), (t0, t1, t2))

    def _encode_qwen(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> QwenConditioning:
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        k = len(negatives)
        tokens = self.tokenizer(negatives + [s.prompt for s in batch.images], length)
        ids = self._tokens(batch, "text encoder (max_sequence_length)", tokens.ids, tokens.truncated, length, k)
        hidden = run(self.text_encoder, {next(iter(self.text_encoder.inputs)): ids}, ["last_hidden_state"],
                     adapters)[0]
        states = np.zeros((len(ids), length, hidden.shape[-1]), dtype=np.float32)
        mask = np.zeros((len(ids), length), dtype=np.float32)
        for row, kept in enumerate(tokens.kept):
            states[row, :kept] = hidden[row, TEMPLATE_DROP:TEMPLATE_DROP + kept]
            mask[row, :kept] = 1.0
        cut = tokens.truncated
        return QwenConditioning(states, mask, cut[k:], cut[:k] if cfg else (False,) * len(batch.images))

    def _qwen_feeds(self, cond: QwenConditioning, h: int, w: int) -> dict[str, Feed]:
        """The per-request transformer inputs, on the device once: text states and key mask (a row each), the
        rotary tables of this size (text then image tokens)."""
        up, model = self.runtime.upload, self.transformer
        feeds: dict[str, Feed] = {
            "encoder_hidden_states": up("qwen_states", cond.states.astype(model.input_dtype("encoder_hidden_states"))),
            "encoder_hidden_states_mask": up("qwen_mask", cond.mask.astype(
                model.input_dtype("encoder_hidden_states_mask")))}
        tables = qwen_rope(h // 2, w // 2, cond.states.shape[1], self.axes_dim)
        for name, table in zip(("rope_cos", "rope_sin"), tables, strict=True):
            feeds[name] = up(f"qwen_{name}", table.astype(model.input_dtype(name)))
        return feeds

    def _qwen_start(self, batch: Batch, noise: np.ndarray, rngs: list[np.random.Generator], sigma: float,
                    copies: int) -> tuple[ort.OrtValue, ort.OrtValue]:
        """(start latents, first transformer input) on the device: the packed noise, or an img2img batch's encoded
        images noised to ``sigma`` (and packed)."""
        if batch.mode == "img2img" and self.editor is not None:
            return self.editor.prepare(batch, noise, rngs, sigma, copies)
        x = pack_latents(noise)
        in_dtype = self.transformer.input_dtype("hidden_states")
        return (self.runtime.upload("dit_latents0", x),
                self.runtime.upload("dit_in", np.concatenate([x] * copies).astype(in_dtype)))

    def _qwen_denoise(self, start: ort.OrtValue, model_in: ort.OrtValue, feeds: dict[str, Feed],
                      guidance: np.ndarray, schedule: FlowSchedule, cfg: bool, adapters: Adapters | None,
                      latent_size: tuple[int, int]) -> DitDenoising:
        """Per-step timesteps (``t / 1000`` per row) and step coefficients uploaded once; CFG steps through the
        norm-rescaling graph, plain ones through the flow Euler graph."""
        rt, shape = self.runtime, tuple(start.shape())
        n, copies = shape[0], 2 if cfg else 1
        lat = [start, rt.buffer("dit_latents1", shape, np.float32)]
        model_out = rt.buffer("dit_out", (copies * n, *shape[1:]), self.transformer.output_dtype())
        times = np.stack([np.full(copies * n, t, dtype=np.float32) / np.float32(1000.0) for t in schedule.timesteps])
        timesteps = rt.upload_steps("dit_timesteps", times.astype(self.transformer.input_dtype("timestep")))
        sig = schedule.sigmas
        table = [cfg_coefficients(sig[i], sig[i + 1], guidance) if cfg else
                 flow_coefficients(sig[i], sig[i + 1], guidance, False) for i in range(len(schedule))]
        coeffs = rt.upload_steps("dit_coeffs", np.stack(table))
        return DitDenoising(len(schedule), self.step_cfg if cfg else self.step, lat, model_in, model_out, feeds,
                            timesteps, coeffs, adapters, latent_size)

    def _decode(self, latents: ort.OrtValue, n: int, h: int, w: int) -> np.ndarray:
        """Unpack on the device, the VAE (normalisation inside), the image down once."""
        c, f = self.shape.latent_channels, self.shape.vae_scale_factor
        vae_in = next(iter(self.vae_decoder.inputs))
        scaled = self.runtime.buffer("dit_vae_in", (n, c, h, w), self.vae_decoder.input_dtype(vae_in))
        self.decode_scale.run({"latents": latents, "unpacked_shape": shape_feed([n, h // 2, w // 2, c, 2, 2]),
                               "image_shape": shape_feed([n, c, h, w])}, {"scaled": scaled})
        host, out = self.runtime.staging("dit_image", (n, 3, h * f, w * f), self.vae_decoder.output_dtype())
        self.vae_decoder.run({vae_in: scaled}, {self.vae_decoder.outputs[0]: out})
        decoded = host.astype(np.float32)
        if not np.isfinite(decoded).all():
            raise InferenceError("the VAE produced NaN/inf values (fp16 overflow or corrupted weights)")
        image = np.clip(decoded / 2 + 0.5, 0.0, 1.0)
        return np.ascontiguousarray((image.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8))
