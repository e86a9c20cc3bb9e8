"""Stable Diffusion txt2img on ONNX Runtime, every session call through IO binding.

Text embeddings, latents, noise predictions and the UNet input live in device buffers reused across steps
(device ``cpu`` when the policy allows only the CPU). Only the initial noise (and Euler-ancestral step noise) goes
up and the image comes down: the latents are scaled for the VAE on the device too. Latents and scheduler state are
float32 even for fp16 UNets (see step_graph.py); only the UNet's input is cast to its dtype.

The model family (engines/pipelines/unet_family.py) decides what differs between SD 1.x, SD 2.x, SDXL and Turbo: one or
two text encoders, SDXL's extra UNet inputs, the CFG default; the loop is shared. When every image of a batch has
guidance <= 1 (Turbo's 0 included) the UNet runs on the conditional rows only: n rows, not 2n.

Edits (img2img, inpainting; engines/pipelines/unet_edits.py) need the folder's vae_encoder: they encode the image on the
device and enter the same loop at the step their strength picks. Without a vae_encoder the folder serves txt2img
only (``edits_unavailable`` says why).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engines.errors import InferenceError, InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.multistep import MAX_HISTORY
from engines.numerics.plan import Step
from engines.numerics.rows import RowPacker
from engines.numerics.schedulers import EDIT_SCHEDULERS, SCHEDULERS, NoiseSchedule, SchedulePlan, make_plan
from engines.numerics.step_cache import OutputCache, Probe, cache_use, partition, record
from engines.numerics.step_graph import (
    STATE_DTYPE,
    build_scale_graph,
    build_step_graph,
    build_text_join_graph,
    step_coefficients,
)
from engines.numerics.tokenizer import ClipTokenizer
from engines.pipelines import controlnet
from engines.pipelines import unet_family as families
from engines.pipelines.contract import Begun, PipelineOutput, check_common, image_rng
from engines.pipelines.ort_model import Feed, OrtModel, built_fp16, tensorrt_fp16
from engines.pipelines.unet_edits import Editor, Mixer, Prepared, paste_back, rows_of, strength_start
from engines.pipelines.unet_family import Family, read_json
from engines.runtime.sessions import Runtime, numpy_dtype
from engines.types.model import ModelInfo
from engines.types.request import CACHE_MIN_STEPS, Batch, Mode, StepHook, Timings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Conditioning:
    """The UNet's text conditioning for one batch: rows [uncond..., text...] with CFG, [text...] without."""

    hidden: ort.OrtValue
    text_embeds: ort.OrtValue | None
    """SDXL's pooled embeddings (None for SD 1.x/2.x)."""
    truncated: tuple[bool, ...]
    negative_truncated: tuple[bool, ...]


@dataclass(frozen=True)
class SecondEncoder:
    """SDXL's second tokenizer and encoder, each encoder's penultimate-state output, and the join graph."""

    tokenizer: ClipTokenizer
    model: OrtModel
    penultimate: tuple[str, str]
    join: OrtModel
    text_embeds_input: str


@dataclass
class Denoising:
    """The denoising stage of one batch between evaluations (StableDiffusionOnnx.start_denoise / denoise_step): every
    buffer on the device, so a driver outside the pipeline can run it one evaluation at a time."""

    evals: tuple[tuple[Step, bool], ...]
    depth: int
    step_graph: OrtModel
    lat: list[ort.OrtValue]
    """[current latents, next latents] (swapped after each evaluation)."""
    ring: list[ort.OrtValue]
    model_in: ort.OrtValue
    step_in: ort.OrtValue
    model_out: ort.OrtValue
    zeros: ort.OrtValue
    feeds: dict[str, Feed]
    timesteps: list[ort.OrtValue]
    coeffs: list[ort.OrtValue]
    in_scales: list[ort.OrtValue]
    rngs: list[np.random.Generator]
    mixer: Mixer | None
    """Inpainting's blend after every step; None otherwise."""
    adapters: Adapters | None
    done: int = 0
    """Sampler steps completed."""
    next_eval: int = 0
    """The evaluation the next tick runs (``len(evals)`` when the denoising is over)."""
    timestep_values: tuple[float, ...] = ()
    """Each evaluation's timestep on the host: rows of a UNet with one timestep per call share a call only at
    equal timesteps."""
    cache: OutputCache | None = None
    """The request's output-level step cache (engines/numerics/step_cache.py), or None: every evaluation runs."""
    control: controlnet.ControlRun | None = None
    """The request's ControlNet units (engines/pipelines/controlnet.py), or None: the plain UNet."""

    @property
    def evaluations(self) -> int:
        return len(self.evals)


class StableDiffusionOnnx:
    """Loads an optimum-layout folder of a served family and runs txt2img batches."""

    def __init__(self, folder: Path, runtime: Runtime, sources: dict[str, Path] | None = None,
                 label: str = "") -> None:
        """``sources`` replaces a component's model.onnx (e.g. a TensorRT EP-context model with prebuilt engines);
        ``label`` (e.g. "@512x512") tells one size's sessions from another's in the runtime's reports.
        ModelLoadError (exit 11) names what was found when the folder is no family sdserve serves."""
        self.family: Family = families.detect(folder)
        parts = ["text_encoder", "unet", "vae_decoder"] + (["text_encoder_2"] if self.family.xl else [])
        for part in parts:
            if not (folder / part / "model.onnx").is_file():
                raise ModelLoadError(f"{folder} has no {part}/model.onnx (expected the optimum ONNX layout of a "
                                     f"{self.family.name} model)")
        paths = {part: (sources or {}).get(part, folder / part / "model.onnx") for part in parts}
        self.runtime = runtime
        self.tokenizer = ClipTokenizer(folder / "tokenizer")
        self.text_encoder = OrtModel(runtime, paths["text_encoder"], "text_encoder" + label)
        self.unet = OrtModel(runtime, paths["unet"], "unet" + label)
        self.io = families.unet_io(self.family, {n: a.shape for n, a in self.unet.inputs.items()}, self.unet.outputs)
        upcast = self.family.vae_force_upcast  # never fp16 kernels, whatever the ONNX dtype (TensorRT's fp16 flag)
        self.vae_decoder = OrtModel(runtime, paths["vae_decoder"], "vae_decoder" + label, fp32=upcast)
        encoder = (sources or {}).get("vae_encoder", folder / "vae_encoder" / "model.onnx")
        self.vae_encoder = OrtModel(runtime, encoder, "vae_encoder" + label, fp32=upcast) if encoder.is_file() \
            else None
        self.edits_unavailable = "" if self.vae_encoder else (
            f"{folder.name} has no vae_encoder/model.onnx: it serves txt2img only (re-export it with "
            "`sdserve engines export` to serve edits)")
        if self.vae_encoder is None and self.family.inpainting:
            raise ModelLoadError(f"{folder}: a 9-channel inpainting UNet needs vae_encoder/model.onnx (the masked "
                                 "image's latents are one of its inputs)")
        self.schedule = NoiseSchedule.from_config(read_json(folder / "scheduler" / "scheduler_config.json"))
        self.latent_dtype = self.unet.input_dtype(self.io.sample)
        out_dtype = self.unet.output_dtype()
        self.step = OrtModel(runtime, build_step_graph(self.latent_dtype, out_dtype), "scheduler_step" + label)
        self.step_cond = OrtModel(runtime, build_step_graph(self.latent_dtype, out_dtype, cfg=False),
                                  "scheduler_step_cond" + label)
        # PLMS, LMS, UniPC read earlier history entries: the same step with MAX_HISTORY of them.
        self.step_multi, self.step_multi_cond = (
            OrtModel(runtime, build_step_graph(self.latent_dtype, out_dtype, cfg=cfg, history=MAX_HISTORY),
                     f"scheduler_step_multi{'' if cfg else '_cond'}" + label) for cfg in (True, False))
        # Step-level batching joins every UNet input of several requests and splits the output (rows.py).
        kinds = [(self.unet.input_dtype(name), len(arg.shape)) for name, arg in self.unet.inputs.items()
                 if len(arg.shape) > 0]
        self.rows = RowPacker(runtime, lambda m, name: OrtModel(runtime, m, name + label), kinds,
                              (out_dtype, len(self.unet.session.get_outputs()[0].shape)))
        self.cache_probe = Probe.build(lambda m, name: OrtModel(runtime, m, name + label),
                                       [self.latent_dtype, out_dtype])
        self._load_geometry(folder, label)
        self._load_second_encoder(folder, paths, label)
        self.editor: Editor | None = None
        self.controls: controlnet.ControlNets | None = None
        """The ControlNets served with this model (controlnet.attach), None without."""
        if self.vae_encoder is not None:
            self._check_encoder(folder, self.vae_encoder)
            self.editor = Editor(runtime, self.vae_encoder, lambda m, name: OrtModel(runtime, m, name + label),
                                 self.scaling_factor, self.latent_dtype, self.vae_scale_factor,
                                 self.family.inpainting)

    def _check_encoder(self, folder: Path, encoder: OrtModel) -> None:
        channels = encoder.session.get_outputs()[0].shape[1]
        if isinstance(channels, int) and channels != 2 * self.latent_channels:
            raise ModelLoadError(f"{folder}: vae_encoder outputs {channels} channels; the latent distribution's "
                                 f"moments are 2 x {self.latent_channels} (mean and log-variance)")
        if self.family.vae_force_upcast and encoder.input_dtype(next(iter(encoder.inputs))) == np.float16:
            raise ModelLoadError(f"{folder}: the {self.family.name} VAE encoder is fp16 but its config says "
                                 "force_upcast: export it in fp32 (diffusers upcasts it to encode)")

    def _load_geometry(self, folder: Path, label: str) -> None:
        channels = self.unet.inputs[self.io.sample].shape[1]
        unet_cfg = read_json(folder / "unet" / "config.json")
        vae_cfg = read_json(folder / "vae_decoder" / "config.json")
        self.latent_channels = int(vae_cfg.get("latent_channels", 4)) if self.family.inpainting else (
            channels if isinstance(channels, int) else int(unet_cfg.get("in_channels", 4)))
        self.vae_scale_factor = 2 ** (len(vae_cfg.get("block_out_channels", [0] * 4)) - 1)
        self.size_multiple = self.vae_scale_factor * 2 ** (len(unet_cfg.get("block_out_channels", [0] * 4)) - 1)
        self.scaling_factor = self.family.vae_scaling_factor
        vae_in = next(iter(self.vae_decoder.inputs))
        for part, vae in (("vae_decoder", self.vae_decoder), ("vae_encoder", self.vae_encoder)):
            if vae is not None and self.family.vae_force_upcast and (
                    tensorrt_fp16(vae.session) or built_fp16(vae.source, part)):
                raise ModelLoadError(f"{folder}: the {self.family.name} {vae.name} runs on TensorRT in fp16 "
                                     "(trt_fp16_enable, or an engine built with it): its VAE overflows in fp16 "
                                     "(force_upcast); rebuild with `sdserve engines build`, which keeps it fp32")
        if self.family.vae_force_upcast and self.vae_decoder.input_dtype(vae_in) == np.float16:
            # SDXL's VAE overflows in fp16 (NaN images): decode in fp32, or use a VAE fixed for fp16.
            raise ModelLoadError(f"{folder}: the {self.family.name} VAE decoder is fp16 but its config says "
                                 "force_upcast (it overflows in fp16): export it in fp32 (`sdserve engines optimize` "
                                 "without --vae-fp16) or use an fp16-fixed VAE whose config sets force_upcast false")
        self.vae_scale = OrtModel(self.runtime, build_scale_graph(1.0 / self.scaling_factor,
                                                                  self.vae_decoder.input_dtype(vae_in)),
                                  "vae_scale" + label)
        self.default_size = self.family.native_size
        width = [self.unet.inputs[self.io.hidden].shape[2], self.text_encoder.session.get_outputs()[0].shape[-1]]
        known = [w for w in width if isinstance(w, int)]
        if not known:
            raise ModelLoadError("cannot tell the text embedding width from the unet or text_encoder inputs")
        self.hidden_width = known[0]

    def _load_second_encoder(self, folder: Path, paths: dict[str, Path], label: str) -> None:
        """SDXL: the second tokenizer and encoder, whose outputs join the first's on the device."""
        self.second: SecondEncoder | None = None
        if not self.family.xl or self.io.text_embeds is None:
            return
        model = OrtModel(self.runtime, paths["text_encoder_2"], "text_encoder_2" + label)
        penultimate = (families.penultimate_output(self.text_encoder.outputs,
                                                   read_json(folder / "text_encoder" / "config.json")),
                       families.penultimate_output(model.outputs, read_json(folder / "text_encoder_2" /
                                                                            "config.json")))
        if "text_embeds" not in model.outputs:
            raise ModelLoadError(f"{folder}: text_encoder_2 has no text_embeds output (outputs {model.outputs}): "
                                 "SDXL's pooled projection comes from it")
        dtypes = [_output_dtype(self.text_encoder, penultimate[0]), _output_dtype(model, penultimate[1]),
                  _output_dtype(model, "text_embeds"), self.unet.input_dtype(self.io.hidden),
                  self.unet.input_dtype(self.io.text_embeds)]
        join = OrtModel(self.runtime, build_text_join_graph(*dtypes), "text_join" + label)
        self.second = SecondEncoder(ClipTokenizer(folder / "tokenizer_2"), model, penultimate, join,
                                    self.io.text_embeds)

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """What the engine reports and validates requests against (``/v1/models``, ``/capabilities``)."""
        f, edits = self.family, self.editor is not None
        modes: tuple[Mode, ...] = ("txt2img", "img2img", "inpaint") if edits else ("txt2img",)
        return ModelInfo(name, self.size_multiple, self.default_size, tuple(SCHEDULERS), self.tokenizer.max_length,
                         digest, f.name, f.prediction_type, f.text_encoders, f.vae_scaling_factor, f.cfg_default,
                         f.default_steps, f.default_guidance, modes, self.edits_unavailable, f.inpainting,
                         EDIT_SCHEDULERS if edits else (),
                         reads_negative=lambda g: families.effective_guidance(g) > 1.0)  # as __call__'s CFG decides

    def describe(self) -> str:
        return self.family.describe()

    @property
    def denoiser(self) -> OrtModel:
        return self.unet

    def adaptable(self) -> list[OrtModel]:
        return [self.text_encoder, self.unet, *([self.second.model] if self.second is not None else [])]

    def check_inputs(self, batch: Batch) -> None:
        """Refuse (never clamp) what this model cannot serve; the server validates first, this is the backstop."""
        check_common(batch, self.size_multiple)
        if batch.scheduler not in SCHEDULERS:
            raise InvalidRequestError(f"unknown scheduler {batch.scheduler!r}; expected one of "
                                      f"{sorted(SCHEDULERS)}", param="scheduler")
        if batch.cache is not None and batch.cache.method != "output":
            raise InvalidRequestError(f"step cache {batch.cache.method!r} is not served for {self.family.name}: "
                                      "the UNet families cache at the output (method 'output')", param="cache")
        if any(not spec.prompt.strip() for spec in batch.images) and batch.mode == "txt2img":
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        self._check_edit(batch)

    def _check_edit(self, batch: Batch) -> None:
        if len({(s.edit is None, s.edit is not None and s.edit.mask is None) for s in batch.images}) > 1:
            raise InvalidRequestError("a batch mixes txt2img, img2img and inpainting images", param="image")
        if batch.mode == "txt2img" and not self.family.inpainting:
            return
        if self.editor is None:
            raise InvalidRequestError(f"edits are not served by this model: {self.edits_unavailable}",
                                      param="image")
        if batch.scheduler not in EDIT_SCHEDULERS:
            raise InvalidRequestError(f"scheduler {batch.scheduler!r} does not serve edits (img2img, inpainting) "
                                      f"here; use one of {list(EDIT_SCHEDULERS)}", param="scheduler")
        if batch.mode != "txt2img":
            strength_start(batch.steps, batch.strength)

    def __call__(self, batch: Batch, latents: np.ndarray | None = None,
                 on_step: StepHook | None = None, adapters: Adapters | None = None) -> PipelineOutput:
        """Generate ``batch``: uint8 images, per-image prompt truncation (prompts are tokenized once, here) and
        phase timings: ``begin``, one evaluation at a time, ``finish`` -- the stages step-level batching runs for
        many requests at once.
        ``latents`` (float32 [B,C,h,w], unscaled unit noise) replaces the seeded initial noise, for parity tests.
        ``on_step(done, total)`` runs after every step; False stops there and the current latents are decoded.
        ``adapters``: the batch's LoRA weights, handed to the text encoders and the UNet."""
        run = self.begin(batch, latents, adapters)
        while not run.finished:
            t = time.perf_counter()
            completes = self.denoise_step(run.state, run.state.next_eval)
            run.denoise_s += time.perf_counter() - t
            if completes and on_step is not None and not on_step(run.state.done, run.steps_total) \
                    and not run.finished:
                run.stopped = True
        return self.finish(run)

    def begin(self, batch: Batch, latents: np.ndarray | None = None, adapters: Adapters | None = None) -> Begun:
        """Encode the prompts, draw each image's noise, prepare an edit's start latents and the denoising state
        (every buffer under the runtime's current scope)."""
        self.check_inputs(batch)
        t0 = time.perf_counter()
        n = len(batch.images)
        shape = (n, self.latent_channels, batch.height // self.vae_scale_factor, batch.width // self.vae_scale_factor)
        # 1. Encode negative and positive prompts in one call: rows [uncond..., text...]; without CFG (every
        #    guidance <= 1, as diffusers decides) the prompts alone.
        guidance = np.array([families.effective_guidance(s.guidance_scale) for s in batch.images], dtype=np.float64)
        cfg = bool((guidance > 1.0).any())
        cond = self._encode(batch, cfg, adapters)
        t1 = time.perf_counter()
        # 2. Per-request schedule (an edit's strength skips the first steps) and per-image noise streams.
        edit = batch.mode != "txt2img" or self.family.inpainting
        start, _ = strength_start(batch.steps, batch.strength) if batch.mode != "txt2img" else (0, batch.steps)
        plan = make_plan(batch.scheduler, self.schedule, batch.steps, start, edit=edit)
        rngs = [image_rng(spec.seed) for spec in batch.images]
        seeded = np.stack([rng.standard_normal(shape[1:], dtype=np.float32) for rng in rngs])
        latents = seeded if latents is None else latents  # the stream advances either way
        # 3. Edits: encode the images on the device and noise them to the first step.
        prepared = None
        if edit and self.editor is not None:
            prepared = self.editor.prepare(batch, plan, latents, rngs, 2 if cfg else 1, start == 0)
        t2 = time.perf_counter()
        state = self.start_denoise(plan, latents, cond, guidance, rngs, batch, prepared, adapters)
        state.control = controlnet.start(self, batch, state)
        if batch.cache is not None and batch.steps >= CACHE_MIN_STEPS:
            state.cache = OutputCache.start(batch.cache, state.evaluations, self.cache_probe, state.model_in,
                                            state.model_out, self.runtime.buffer)
        return Begun(batch, state, cond, prepared, len(plan.steps), (t0, t1, t2))

    def decode(self, run: Begun, images: int) -> None:
        """Decode up to ``images`` more of the batch's images where the denoising is, on the device (their rows of
        the latents taken there); the images come down once (inpainting: the init image pasted back outside the
        mask)."""
        start, stop = run.next_rows(images)
        if start >= stop:
            return
        t3 = time.perf_counter()
        part = self.rows.take("latents", run.state.lat[0], start, stop)
        out = self._decode(part, run.batch)
        if run.prepared is not None:
            out = paste_back(out, rows_of(run.prepared.inputs, start, stop))
        run.decoded.append(out)
        run.decode_s += time.perf_counter() - t3

    def finish(self, run: Begun) -> PipelineOutput:
        """Decode what ``decode`` did not yet (all of it, when it was not called) and return the batch."""
        final = run.state.lat[0]
        kept = np.array(final.numpy(), dtype=np.float32) if any(s.keep_latents for s in run.batch.images) else None
        self.decode(run, len(run.batch.images))
        images = run.all_decoded()
        t0, t1, t2 = run.started
        # Compute seconds of this batch (under step-level batching its share of the ticks, not its wall time).
        timings = Timings(text_encoder=t1 - t0, denoise=run.denoise_s, vae_decode=run.decode_s,
                          total=(t2 - t0) + run.denoise_s + run.decode_s, vae_encode=t2 - t1)
        return PipelineOutput(images, run.cond.truncated, run.cond.negative_truncated, timings, run.state.done,
                              run.steps_total, kept, cache_use(run.state))

    def _unet_feeds(self, cond: Conditioning, batch: Batch, rows: int) -> dict[str, Feed]:
        """The conditioning inputs of every step: hidden states, and SDXL's pooled embeddings and time ids."""
        feeds: dict[str, Feed] = {self.io.hidden: cond.hidden}
        if self.io.text_embeds is not None and self.io.time_ids is not None and cond.text_embeds is not None:
            ids = families.time_ids(batch.height, batch.width, batch.original_size, batch.crops_coords_top_left)
            feeds[self.io.text_embeds] = cond.text_embeds
            feeds[self.io.time_ids] = self.runtime.upload(  # once per request, not a host feed every step
                "time_ids", np.array([ids] * rows, dtype=self.unet.input_dtype(self.io.time_ids)))
        return feeds

    def _step_tables(self, evals: tuple[tuple[Step, bool], ...], guidance: np.ndarray, depth: int,
                     rows: int) -> tuple[list[ort.OrtValue], list[ort.OrtValue], list[ort.OrtValue]]:
        """Every evaluation's timestep, step coefficients and next input scale, on the device before the loop:
        one copy each per request instead of three host feeds (pageable bind_cpu_input) per step. The values are
        the ones a per-step feed would carry, so the CPU path stays bit-identical. A UNet that takes a timestep per
        row gets ``rows`` copies (the value it would broadcast), so requests' timesteps join like their samples."""
        t_dtype = self.unet.input_dtype(self.io.timestep)
        t_shape = (rows,) if self.io.timestep_rows else self.io.timestep_shape
        timesteps = np.stack([np.full(t_shape, step.timestep, dtype=t_dtype) for step, _ in evals])
        coeffs = np.stack([step_coefficients(step.next, step.denoised, guidance, depth) for step, _ in evals])
        scales = [evals[i + 1][0].input_scale if i + 1 < len(evals) else 1.0 for i in range(len(evals))]
        return (self.runtime.upload_steps("timesteps", timesteps), self.runtime.upload_steps("coeffs", coeffs),
                self.runtime.upload_steps("in_scales", np.array(scales, dtype=STATE_DTYPE).reshape(-1, 1)))

    def start_denoise(self, plan: SchedulePlan, latents: np.ndarray, cond: Conditioning, guidance: np.ndarray,
                      rngs: list[np.random.Generator], batch: Batch, edit: Prepared | None = None,
                      adapters: Adapters | None = None) -> Denoising:
        """The denoising stage's state on the device, before its first evaluation: latents, the history ring,
        the UNet's input and output buffers, the per-request feeds and the per-step tables. The UNet batch is 2n
        with CFG and n without. A step may hold two UNet evaluations (Heun, PLMS's first); each evaluation pushes
        one entry into a ring of ``history + 1`` device buffers, and the step graph reads the last ``history``."""
        shape, n = latents.shape, len(latents)
        copies = 2 if (guidance > 1.0).any() else 1
        depth = 1 if plan.history == 1 else MAX_HISTORY
        if depth == 1:
            step_graph = self.step if copies == 2 else self.step_cond
        else:
            step_graph = self.step_multi if copies == 2 else self.step_multi_cond
        evals = plan.evaluations()
        x = latents.astype(np.float64) * plan.init_noise_sigma
        f32, dt = STATE_DTYPE, self.latent_dtype
        lat = [edit.start if edit else self.runtime.upload("latents0", x.astype(f32)),
               self.runtime.buffer("latents1", shape, f32)]
        # Entries not yet pushed are read with coefficient 0: zeros, never stale values (0 * NaN is NaN).
        # Evaluation i writes slot (i + 1) % (depth + 1) and reads the slots before it, so slot 1 is written first.
        ring = [self.runtime.buffer("denoised1", shape, f32) if k == 1 else
                self.runtime.upload(f"denoised{k}", np.zeros(shape, f32)) for k in range(depth + 1)]
        model_in = edit.model_in if edit else self.runtime.upload(
            "unet_in", np.concatenate([x * evals[0][0].input_scale] * copies).astype(dt))
        mixer = edit.mixer if edit else None
        step_in = self.runtime.buffer("unet_in4", (copies * n, *shape[1:]), dt) if mixer else model_in
        model_out = self.runtime.buffer("unet_out", (copies * n, *shape[1:]), self.unet.output_dtype())
        zeros = self.runtime.upload("zeros", np.zeros(shape, f32))
        feeds = self._unet_feeds(cond, batch, copies * n)
        timesteps, coeffs, in_scales = self._step_tables(evals, guidance, depth, copies * n)
        return Denoising(evals, depth, step_graph, lat, ring, model_in, step_in, model_out, zeros, feeds,
                         timesteps, coeffs, in_scales, rngs, mixer, adapters,
                         timestep_values=tuple(float(step.timestep) for step, _ in evals))

    def denoise_step(self, state: Denoising, i: int) -> bool:
        """Evaluation ``i`` (the state's next): the UNet on the current input, then the step graph writes the next
        latents, the denoised estimate into the ring and the next UNet input. True when it completes a sampler
        step."""
        if i != state.next_eval:
            raise ValueError(f"evaluation {i} requested; the denoising is at {state.next_eval}")
        self.run_denoiser([state])
        return self.advance(state)

    def stepwise(self) -> StableDiffusionOnnx:
        return self

    def joinable(self) -> bool:
        """Whether rows at different timesteps can share one UNet call (its timestep input takes one per row)."""
        return self.io.timestep_rows

    def run_denoiser(self, states: Sequence[Denoising]) -> None:
        """One UNet evaluation for each state at its next evaluation, every state's rows in one call where the
        UNet takes a timestep per row (else one call per timestep value): each state's input buffers are joined on
        the device and its output rows copied back into its own output buffer (engines/numerics/rows.py). A
        single state binds its own buffers, exactly the solo path."""
        running = partition(states)  # a cached state reusing its output is left out of the call
        groups: dict[float, list[Denoising]] = {}
        for state in running:
            key = 0.0 if self.io.timestep_rows else state.timestep_values[state.next_eval]
            key = key if state.control is None else id(state)  # each controlled state runs its own units
            groups.setdefault(key, []).append(state)
        for group in groups.values():
            self._run_joined(group)
        record(running)

    def _run_joined(self, states: list[Denoising]) -> None:
        first = states[0]
        names = list(first.feeds)
        if first.control is not None and self.controls is not None:
            self.controls.run(self, first, first.control)
            return
        if len(states) == 1:
            self.unet.run({self.io.sample: first.model_in, self.io.timestep: first.timesteps[first.next_eval],
                           **first.feeds}, {self.io.out: first.model_out}, first.adapters)
            return
        join = self.rows.join
        for state in states[1:]:
            if list(state.feeds) != names or any(not isinstance(state.feeds[n], ort.OrtValue) for n in names):
                raise InferenceError("rows joined into one UNet call must bind the same device inputs")
        feeds: dict[str, Feed] = {
            self.io.sample: join("sample", [s.model_in for s in states]),
            self.io.timestep: join("timestep", [s.timesteps[s.next_eval] for s in states]) if self.io.timestep_rows
            else first.timesteps[first.next_eval],
            **{name: join(name, [s.feeds[name] for s in states]) for name in names},
        }
        shape = (sum(s.model_out.shape()[0] for s in states), *first.model_out.shape()[1:])
        out = self.runtime.buffer("rows_out", shape, self.unet.output_dtype())
        self.unet.run(feeds, {self.io.out: out}, first.adapters)  # one LoRA set per running set (its key)
        for state in states[1:]:
            if state.adapters is not None and first.adapters is not None:
                state.adapters.adapted |= first.adapters.adapted
        self.rows.split(out, [s.model_out for s in states])

    def advance(self, state: Denoising) -> bool:
        """After the UNet wrote the state's output: the step graph writes the next latents, the denoised estimate
        into the ring and the next UNet input (inpainting: the blend). True when a sampler step completed."""
        i = state.next_eval
        step, completes = state.evals[i]
        shape = tuple(state.zeros.shape())
        noise: Feed = state.zeros
        if step.next.noise:
            noise = self.runtime.upload("noise", np.stack([r.standard_normal(shape[1:], dtype=np.float32)
                                                           for r in state.rngs]))
        scale = state.evals[i + 1][0].input_scale if i + 1 < len(state.evals) else 1.0
        depth, ring, lat = state.depth, state.ring, state.lat
        history = {("prev" if k == 1 else f"prev{k}"): ring[(i + 1 - k) % (depth + 1)] for k in range(1, depth + 1)}
        state.step_graph.run({"sample": lat[0], "model_out": state.model_out, "noise": noise, **history,
                              "coeffs": state.coeffs[i], "in_scale": state.in_scales[i]},
                             {"next": lat[1], "denoised": ring[(i + 1) % (depth + 1)], "model_in": state.step_in})
        if state.mixer is not None:  # inpainting: the blend writes the step's latents back into lat[0]
            state.mixer.after(i, lat[1], lat[0], state.model_in, scale)
        else:
            lat.reverse()
        state.done += completes
        state.next_eval += 1
        return completes

    def _tokens(self, tokenizer: ClipTokenizer, batch: Batch,
                prompts: list[str]) -> tuple[np.ndarray, tuple[bool, ...]]:
        """Token ids of ``prompts``; refuses over-long prompts unless the batch truncates."""
        tokens = tokenizer(prompts)
        negatives = len(prompts) - len(batch.images)
        if not batch.truncate_prompts and any(tokens.truncated):
            name = "prompt" if any(tokens.truncated[negatives:]) else "negative_prompt"
            raise InvalidRequestError(f"{name} is longer than the text encoder's {tokenizer.max_length} "
                                      "tokens", param=name)
        return tokens.ids, tokens.truncated

    def _encode(self, batch: Batch, cfg: bool, adapters: Adapters | None = None) -> Conditioning:
        """Hidden states of [negatives..., prompts...] (prompts only without CFG)."""
        n = len(batch.images)
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        prompts = negatives + [s.prompt for s in batch.images]
        ids, truncated = self._tokens(self.tokenizer, batch, prompts)
        negative_truncated = truncated[:n] if cfg else (False,) * n
        if self.second is not None:
            hidden, pooled = self._encode_xl(self.second, batch, prompts, ids, len(negatives), adapters)
            return Conditioning(hidden, pooled, truncated[len(negatives):], negative_truncated)
        name = next(iter(self.text_encoder.inputs))
        outputs = self.text_encoder.outputs
        out_name = "last_hidden_state" if "last_hidden_state" in outputs else outputs[0]
        hidden = self.runtime.buffer("hidden", (len(prompts), ids.shape[1], self.hidden_width),
                                     self.unet.input_dtype(self.io.hidden))
        ids_in = self.runtime.upload("ids", ids.astype(self.text_encoder.input_dtype(name)))  # pinned on a GPU
        self.text_encoder.run({name: ids_in}, {out_name: hidden}, adapters)
        return Conditioning(hidden, None, truncated[len(negatives):], negative_truncated)

    def _encode_xl(self, second: SecondEncoder, batch: Batch, prompts: list[str], ids: np.ndarray,
                   negatives: int, adapters: Adapters | None = None) -> tuple[ort.OrtValue, ort.OrtValue]:
        """SDXL: both encoders' penultimate states, joined on the device with the second's pooled projection;
        rows of empty negative prompts are zeros under force_zeros_for_empty_prompt (as diffusers)."""
        ids_2, _ = self._tokens(second.tokenizer, batch, prompts)
        rows, length = ids.shape
        states = []
        pooled = self.runtime.buffer("pooled", (rows, _static_width(second.model, "text_embeds")),
                                     _output_dtype(second.model, "text_embeds"))
        for k, (model, token_ids) in enumerate(((self.text_encoder, ids), (second.model, ids_2))):
            out = second.penultimate[k]
            states.append(self.runtime.buffer(f"states{k}", (rows, length, _static_width(model, out)),
                                              _output_dtype(model, out)))
            name = next(iter(model.inputs))
            model.run({name: self.runtime.upload(f"ids{k}", token_ids.astype(model.input_dtype(name)))},
                      {out: states[k], **({"text_embeds": pooled} if k else {})}, adapters)
        keep = np.ones((rows, 1), dtype=STATE_DTYPE)
        if self.family.force_zeros_for_empty_prompt:
            keep[:negatives, 0] = [0.0 if not p else 1.0 for p in prompts[:negatives]]
        hidden = self.runtime.buffer("hidden", (rows, length, self.hidden_width), self.unet.input_dtype(self.io.hidden))
        embeds = self.runtime.buffer("text_embeds", (rows, pooled.shape()[1]),
                                     self.unet.input_dtype(second.text_embeds_input))
        second.join.run({"h1": states[0], "h2": states[1], "pooled": pooled, "keep": self.runtime.upload("keep", keep)},
                        {"hidden": hidden, "text_embeds": embeds})
        return hidden, embeds

    def _decode(self, latents: ort.OrtValue, batch: Batch) -> np.ndarray:
        n = int(latents.shape()[0])
        vae_in = next(iter(self.vae_decoder.inputs))
        # latents / scaling_factor, on the device, written in the VAE's input dtype into a device buffer.
        scaled = self.runtime.buffer("vae_in", tuple(latents.shape()), self.vae_decoder.input_dtype(vae_in))
        self.vae_scale.run({"latents": latents}, {"scaled": scaled})
        # The image comes down once, straight into a (pinned, on a GPU) host staging buffer bound as the output.
        out_dtype = self.vae_decoder.output_dtype()
        host, out = self.runtime.staging("image", (n, 3, batch.height, batch.width), out_dtype)
        self.vae_decoder.run({vae_in: scaled}, {self.vae_decoder.outputs[0]: out})
        decoded = host.astype(np.float32)
        if not np.isfinite(decoded).all():
            raise InferenceError("the VAE produced NaN/inf values (fp16 overflow or corrupted weights)")
        image = np.clip(decoded / 2 + 0.5, 0.0, 1.0)
        return np.ascontiguousarray((image.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8))


def _output_dtype(model: OrtModel, name: str) -> type[np.generic]:
    return numpy_dtype(next(o for o in model.session.get_outputs() if o.name == name).type)


def _static_width(model: OrtModel, name: str) -> int:
    width = next(o for o in model.session.get_outputs() if o.name == name).shape[-1]
    if not isinstance(width, int):
        raise ModelLoadError(f"{model.name} output {name} has no fixed last dimension ({width!r})")
    return width
