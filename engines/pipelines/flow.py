"""The flow-matching transformer pipeline's base: the loop every DiT architecture shares, with named hooks for
what differs (Flux.1: engines/pipelines/flux.py; SD 3 / 3.5: sd3.py; Qwen-Image: qwen.py), as diffusers'
FluxPipeline, StableDiffusion3Pipeline and QwenImagePipeline (0.42) share their loop.

A subclass is registered in engines/architectures.py (one row) and overrides hooks; it calls this constructor.
The hooks, in the order ``begin`` runs them:

1. ``load_text`` (at load): its tokenizers and text encoders; ``encode``: the prompts' conditioning (text states,
   pooled embeddings or a key mask; negatives first under classifier-free guidance).
2. ``schedule``: the flow sigmas for a request's steps and latent size (the shift by ``mu``).
3. ``text_feeds`` / ``position_feeds`` / ``guidance_feeds``: the transformer's per-request inputs (rotary tables,
   an embedded guidance scale); ``TIMESTEP_SCALE`` divides the timestep (Flux and Qwen-Image take ``t / 1000``).
4. ``step_graphs`` / ``coefficients``: the step's small ONNX graphs and their per-step coefficients (Euler with CFG,
   or Qwen-Image's norm-rescaled true CFG).
5. ``read_geometry``, ``patch_size`` and ``native_size`` read the folder's VAE and transformer configs (the latent
   grid, the token patch, the default size); the registry row's ``packed`` says whether latents go in as 2x2 tokens
   (unpacked again before the VAE).
6. ``extra_tokens`` (instruction edits): per image, latent tokens beside the noisy ones (reference latents) and
   their ids, handed to ``position_feeds`` as ``DitConditioning.extra``; joined to every evaluation's input on the
   token axis, their output dropped (engines/pipelines/flow_extra.py).

Sessions are built by the Runtime (providers under the policy) and run through IO binding. The text encoders run
once per request with host outputs (the conditioning is assembled on the host and uploaded once); the denoising
loop keeps the latents, the transformer input and output and the per-step timesteps and coefficients on the device:
a small step graph (engines/numerics/flow_graph.py) applies the Euler step and CFG as a linear combination whose
coefficients the flow schedule (engines/numerics/flow_schedule.py) gives, and a decode graph unpacks and rescales
the latents for the VAE. Only the initial noise goes up and the image comes down. img2img
(engines/pipelines/flow_edits.py) encodes the init image on the device and enters the same loop at the step its
strength picks.

Element types come from the sessions (``OrtModel.input_dtype``/``output_dtype``): fp32 and fp16 graph inputs and
outputs are fed and read in their own type, as the UNet pipeline does. `sdserve engines export --dtype fp16|bf16`
writes half-precision networks whose inputs and outputs stay fp32 (casts inside the graph), so this pipeline runs
them unchanged; a graph whose inputs or outputs are bf16 is refused at load, by name (engines/runtime/sessions.py
``check_io_types``: numpy has no bfloat16). bf16 compute needs the CUDA or TensorRT provider (ONNX Runtime's CPU
provider has no bf16 kernels; the load says so).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines import architectures
from engines.errors import InferenceError, InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.flow_graph import build_flow_decode_graph, build_flow_step_graph, flow_coefficients, flow_start
from engines.numerics.flow_samplers import FLOW_SAMPLERS, FlowSampler, start_sampler
from engines.numerics.flow_schedule import FlowMatchConfig, FlowSchedule, flow_schedule
from engines.numerics.rows import RowPacker, shape_feed
from engines.numerics.step_cache import OutputCache, Probe, cache_use, partition, record
from engines.pipelines.contract import Begun, PipelineOutput, check_common, image_rng
from engines.pipelines.first_block import PARTS as FIRST_BLOCK_PARTS
from engines.pipelines.first_block import FirstBlockRunner, FirstBlockState, decide_parts
from engines.pipelines.flow_edits import DitEditor
from engines.pipelines.flow_extra import ExtraJoin, ExtraState, ExtraTokens, by_extra
from engines.pipelines.flow_family import DitFamily, detect_dit
from engines.pipelines.ort_model import Feed, OrtModel
from engines.pipelines.unet_family import read_json
from engines.runtime.sessions import Runtime
from engines.types.model import ModelInfo
from engines.types.request import CACHE_MIN_STEPS, Batch, CacheUse, StepHook, Timings

log = logging.getLogger(__name__)
NATIVE_SIZE_KEY = "_sdserve_native_size"
"""model_index.json key of a model's native size in pixels where its configs do not say it (the tiny models: a
self-test at 64x64, not Flux's 1024)."""
SAMPLERS = FLOW_SAMPLERS
"""Euler (this step graph) and Euler a, DPM++ 2M, UniPC (flow_samplers.py), all on the flow schedule ("Simple")."""
ROW_INPUTS = ("encoder_hidden_states", "pooled_projections", "guidance", "encoder_hidden_states_mask")
"""Transformer inputs with a row per image (besides hidden_states and timestep); the others (rope tables) depend on
the size only."""


def pack_latents(latents: np.ndarray) -> np.ndarray:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each 2×2 patch becomes one token (channels, then the patch's rows/cols)."""
    b, c, h, w = latents.shape
    patches = latents.reshape(b, c, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
    return np.ascontiguousarray(patches.reshape(b, (h // 2) * (w // 2), c * 4))


def unpack_latents(tokens: np.ndarray, h: int, w: int) -> np.ndarray:
    """The inverse of ``pack_latents`` for latents of height ``h`` and width ``w``."""
    b, _, channels = tokens.shape
    patches = tokens.reshape(b, h // 2, w // 2, channels // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(patches.reshape(b, channels // 4, h, w))


def run(model: OrtModel, feeds: dict[str, np.ndarray], outputs: Sequence[str],
        adapters: Adapters | None) -> list[np.ndarray]:
    """One session call through IO binding, host feeds cast to the session's input dtypes, outputs to the host;
    ``adapters``: the batch's LoRA weights (every text encoder is adaptable, so every call site passes them)."""
    session, binding = model.bound(adapters)  # the LoRA variant with this batch's weights, when it has some
    for name, value in feeds.items():  # per request (text ids), never per step; on a GPU through pinned staging
        host = np.ascontiguousarray(value.astype(model.input_dtype(name), copy=False))
        binding.bind_ortvalue_input(name, model.runtime.upload(f"{model.name}:{name}", host))
    for name in outputs:
        binding.bind_output(name, model.runtime.device, model.runtime.device_id)
    session.run_with_iobinding(binding)
    return [np.asarray(out) for out in binding.copy_outputs_to_cpu()]


@dataclass(frozen=True)
class DitConditioning:
    """Transformer text inputs for one batch: states [rows, tokens, width] and pooled [rows, width] (or, for a
    masked text sequence, the key mask [rows, tokens] in ``mask``)."""

    states: np.ndarray
    pooled: np.ndarray | None
    truncated: tuple[bool, ...]
    negative_truncated: tuple[bool, ...]
    mask: np.ndarray | None = None
    extra: ExtraTokens | None = None
    """The ``extra_tokens`` hook's tokens (their ids for ``position_feeds``), or None."""


@dataclass
class DitDenoising:
    """One batch's denoising on the device between transformer evaluations (FlowPipeline.begin / run_denoiser /
    advance): what step-level batching holds per running request."""

    evaluations: int
    step: OrtModel
    lat: list[ort.OrtValue]
    """[current latents, next latents] (swapped after each step)."""
    model_in: ort.OrtValue
    model_out: ort.OrtValue
    feeds: dict[str, Feed]
    timesteps: list[ort.OrtValue]
    coeffs: list[ort.OrtValue]
    adapters: Adapters | None
    latent_size: tuple[int, int]
    next_eval: int = 0
    done: int = 0
    cache: OutputCache | None = None
    """The request's output-level step cache (engines/numerics/step_cache.py), or None: every evaluation runs."""
    first_block: FirstBlockState | None = None
    """The request's first-block cache state (engines/pipelines/first_block.py), or None."""
    extra: ExtraState | None = None
    """The request's extra tokens on the device (flow_extra.py), or None."""
    sampler: FlowSampler | None = None
    """The request's Euler a / DPM++ 2M / UniPC state (flow_samplers.py), or None: this Euler step."""


@dataclass(frozen=True)
class Geometry:
    vae_scale_factor: int
    latent_channels: int
    scaling_factor: float
    shift_factor: float
    size_multiple: int


class FlowPipeline:
    """Loads an exported flow-matching transformer folder and runs txt2img and img2img batches
    (engines.types.request.Batch). Subclasses override the hooks (module docstring); this runs everything else."""

    TIMESTEP_SCALE = 1000.0
    """The transformer takes ``t / TIMESTEP_SCALE`` (1: SD 3 takes ``t``)."""
    FIRST_BLOCK = True
    """Whether the first-block cache's transformer parts are served when the folder has them."""

    def __init__(self, folder: Path, runtime: Runtime, label: str = "", sources: dict[str, Path] | None = None) -> None:
        """ModelLoadError (exit 11) when the folder is no served DiT family or misses a component. ``sources``:
        per component, the model to load instead of ``<component>/model.onnx`` (prebuilt EP-context models)."""
        given = sources or {}
        self.family: DitFamily = detect_dit(folder)
        self.architecture = architectures.of(folder)
        self.packed = self.architecture.packed
        """Latents go in as 2x2-packed tokens (Flux, Qwen-Image), else as [B, C, H, W] patched inside (SD 3)."""
        for part in self.architecture.components:
            if not (folder / part / "model.onnx").is_file():
                raise ModelLoadError(f"{folder} has no {part}/model.onnx (the ONNX layout of a {self.family.name} "
                                     "model: `sdserve engines export`)")
        self.runtime = runtime
        self._make: Callable[[Path | bytes, str], OrtModel] = lambda model, name: OrtModel(runtime, model, name + label)
        models = {part: self._make(given.get(part, folder / part / "model.onnx"), part)
                  for part in self.architecture.components}
        self.transformer, self.vae_decoder = models["transformer"], models["vae_decoder"]
        self.text_encoders: list[OrtModel] = []
        """What ``load_text`` loaded, for LoRA (``adaptable``) and placement."""
        self.max_sequence_length: int = self.family.max_sequence_length
        """The text encoder's token budget; ``load_text`` may lower it to what its tokenizer takes."""
        self.load_text(folder, models)
        self.flow = FlowMatchConfig.from_config(read_json(folder / "scheduler" / "scheduler_config.json"))
        self.config = read_json(folder / "transformer" / "config.json")
        self.geometry = self.read_geometry(folder)
        self.axes_dim = tuple(int(a) for a in self.config.get("axes_dims_rope", (16, 56, 56)))
        native = read_json(folder / "model_index.json").get(NATIVE_SIZE_KEY)
        self._native = int(native) if native else self.native_size()
        self.guidance_input = "guidance" in self.transformer.inputs
        if self.guidance_input != self.family.guidance_embeds:
            raise ModelLoadError(f"{folder}: the transformer's inputs {sorted(self.transformer.inputs)} do not match "
                                 f"its config (guidance_embeds={self.family.guidance_embeds})")
        in_dtype, out_dtype = self.transformer.input_dtype("hidden_states"), self.transformer.output_dtype()
        self.step, self.step_cfg = self.step_graphs(in_dtype, out_dtype)
        kinds = [(self.transformer.input_dtype(name), len(arg.shape)) for name, arg in self.transformer.inputs.items()
                 if name in ("hidden_states", "timestep", *ROW_INPUTS)]
        self.rows = RowPacker(runtime, self._make, kinds,
                              (out_dtype, len(self.transformer.session.get_outputs()[0].shape)))
        self.cache_probe = Probe.build(self._make, [in_dtype, out_dtype])
        self.extra = ExtraJoin(self._make, runtime, in_dtype, out_dtype)
        self.first_block_parts = decide_parts(folder, self.family.name, self.FIRST_BLOCK, prebuilt_what(given))
        """Whether the parts load, and what a ``first-block`` request is told when they do not."""
        self.first_block = FirstBlockRunner(folder, runtime, label, given) if self.first_block_parts.load else None
        """The first-block cache's transformer parts (exported with `sdserve engines export --first-block`), or None:
        loaded beside the full transformer, which uncached requests keep running (engines/health/memory_plan.py
        counts their weights). Not loaded where the transformer runs from prebuilt EP-context artifacts that do not
        cover the parts (the TensorRT plan builds no engine for them; building one on the node is what the policy
        forbids): the refusal says so."""
        g, vae_in = self.geometry, next(iter(self.vae_decoder.inputs))
        self.decode_scale = self._make(build_flow_decode_graph(
            g.scaling_factor, g.shift_factor, self.vae_decoder.input_dtype(vae_in), self.packed), "flow_decode")
        encoder = folder / "vae_encoder" / "model.onnx"
        self.editor = DitEditor(runtime, self._make(given.get("vae_encoder", encoder), "vae_encoder"), self._make,
                                g.scaling_factor, g.shift_factor, in_dtype, self.packed) if encoder.is_file() else None
        self.edits_unavailable = "" if self.editor else (
            f"{folder.name} has no vae_encoder/model.onnx: it serves txt2img only (re-export it with "
            "`sdserve engines export` to serve img2img)")

    # --- hooks -----------------------------------------------------------------------------------------------

    def load_text(self, folder: Path, models: dict[str, OrtModel]) -> None:
        """Hook: the tokenizers and text encoders (append the encoders to ``text_encoders``); lower
        ``max_sequence_length`` where the tokenizer takes less."""
        raise NotImplementedError

    def encode(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        """Hook: the batch's conditioning (negatives first under ``cfg``)."""
        raise NotImplementedError

    def prompt_tokens(self) -> int:
        """Hook: the prompt length a request is validated against (``ModelInfo.max_prompt_tokens``)."""
        return self.max_sequence_length

    def text_tokens(self) -> int:
        """Hook: the transformer's text sequence length (the memory estimate's text tokens)."""
        return self.max_sequence_length

    def read_geometry(self, folder: Path) -> Geometry:
        """Hook: the latent geometry from the VAE config (AutoencoderKL's: scale 2^(levels-1), 16 channels)."""
        vae = read_json(folder / "vae_decoder" / "config.json")
        scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        return Geometry(scale, int(vae.get("latent_channels", 16)), float(vae.get("scaling_factor", 1.0)),
                        float(vae.get("shift_factor") or 0.0), scale * self.patch_size())

    def patch_size(self) -> int:
        """Hook: latent pixels per token side (the 2x2 pack)."""
        return 2

    def native_size(self) -> int:
        """Hook: the native size where model_index.json does not say it (the pipelines' default 1024)."""
        return 1024

    def schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        """Hook: the flow schedule of ``steps`` for latents h x w (the scheduler's spacing, shifted by ``mu`` of
        the token count when the config asks)."""
        patch = self.patch_size()
        mu = self.flow.mu((h // patch) * (w // patch)) if self.flow.use_dynamic_shifting else None
        return flow_schedule(self.flow, steps, mu=mu)

    def text_feeds(self, cond: DitConditioning) -> dict[str, np.ndarray]:
        """Hook: the text inputs with a row per image (host arrays, cast and uploaded by ``transformer_feeds``)."""
        feeds = {"encoder_hidden_states": cond.states}
        if cond.pooled is not None:
            feeds["pooled_projections"] = cond.pooled
        if cond.mask is not None:
            feeds["encoder_hidden_states_mask"] = cond.mask
        return feeds

    def position_feeds(self, cond: DitConditioning, h: int, w: int) -> dict[str, np.ndarray]:
        """Hook: inputs that depend on the size only (rotary tables); none by default."""
        return {}

    def guidance_feeds(self, guidance: np.ndarray, rows: int) -> dict[str, np.ndarray]:
        """Hook: an embedded guidance scale (a row per image) where the transformer takes one."""
        return {"guidance": guidance[:rows]} if self.guidance_input else {}

    def step_graphs(self, model_in: type[np.generic], model_out: type[np.generic]) -> tuple[OrtModel, OrtModel]:
        """Hook: the (plain, CFG) step graphs: flow Euler, CFG as a linear combination."""
        return (self._make(build_flow_step_graph(model_in, model_out, cfg=False, packed=self.packed), "flow_step"),
                self._make(build_flow_step_graph(model_in, model_out, cfg=True, packed=self.packed), "flow_step_cfg"))

    def coefficients(self, sigma: float, sigma_next: float, guidance: np.ndarray, cfg: bool) -> np.ndarray:
        """Hook: one step's coefficients for the step graph ``step_graphs`` gave."""
        return flow_coefficients(sigma, sigma_next, guidance, cfg)

    def extra_tokens(self, batch: Batch) -> ExtraTokens | None:
        """Hook: latent tokens each image's transformer calls take beside the noisy ones (instruction edits'
        reference latents) with their ids; None: none."""
        return None

    def uses_cfg(self, guidance: np.ndarray) -> bool:
        """Whether a batch runs classifier-free guidance (two rows per image)."""
        return self.family.cfg and bool((guidance > 1.0).any())

    # --- what the engine reads ---------------------------------------------------------------------------------

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE factor × the pack or patch."""
        return self.geometry.size_multiple

    @property
    def default_size(self) -> int:
        return self._native

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """What the engine reports and validates requests against (``/v1/models``, ``/capabilities``)."""
        f = self.family
        return ModelInfo(name=name, size_multiple=self.size_multiple, default_size=self.default_size,
                         schedulers=SAMPLERS, max_prompt_tokens=self.prompt_tokens(), digest=digest,
                         family=f.name, prediction_type="flow", text_encoders=len(self.text_encoders),
                         vae_scaling_factor=self.geometry.scaling_factor, cfg_default=f.cfg, default_steps=f.steps,
                         default_guidance=f.guidance,
                         modes=("txt2img", "img2img") if self.editor else ("txt2img",),
                         edits_unavailable=self.edits_unavailable, edit_schedulers=SAMPLERS if self.editor else (),
                         token_patch=self.size_multiple, text_tokens=self.text_tokens(),
                         prompt_limits=((77, "CLIP tokens"), (self.max_sequence_length, "T5 tokens (max_sequence_"
                                        "length)")) if self.architecture.t5 else ((self.prompt_tokens(), "text "
                                        "encoder tokens (max_sequence_length)"),),
                         reads_negative=lambda g: self.uses_cfg(np.array([g], dtype=np.float32)),
                         hidden_size=int(self.config.get("num_attention_heads", 24))
                         * int(self.config.get("attention_head_dim", 128)))

    def describe(self) -> str:
        f = self.family
        return f"{f.name} (flow matching, " + ("guidance embedded" if f.guidance_embeds else
                                                "classifier-free guidance" if f.cfg else "no guidance") + ")"

    @property
    def denoiser(self) -> OrtModel:
        return self.transformer

    def adaptable(self) -> list[OrtModel]:
        return [self.transformer, *self.text_encoders]

    def check_inputs(self, batch: Batch) -> None:
        """Refuse (never clamp) what this model cannot serve."""
        check_common(batch, self.size_multiple)
        if batch.mode == "inpaint":
            raise InvalidRequestError(f"inpainting is not served for {self.family.name} (txt2img and img2img are)",
                                      param="mask")
        if batch.mode == "instruct" and type(self).extra_tokens is FlowPipeline.extra_tokens:
            raise InvalidRequestError(f"instruction edits are not served for {self.family.name}", param="image")
        if batch.mode == "img2img" and self.editor is None:
            raise InvalidRequestError(f"img2img is not served by this model: {self.edits_unavailable}",
                                      param="image")
        if batch.mode == "img2img" and not 0.0 < batch.strength <= 1.0:
            raise InvalidRequestError(f"strength {batch.strength} must be in (0, 1]", param="strength")
        if batch.scheduler not in SAMPLERS:
            raise InvalidRequestError(f"scheduler {batch.scheduler!r} is not served for {self.family.name}: "
                                      f"flow models sample with Euler or {list(SAMPLERS[1:])}", param="scheduler")
        if batch.cache is not None and batch.cache.method == "first-block" and self.first_block is None:
            raise InvalidRequestError(self.first_block_parts.refusal, param="cache")
        if any(not spec.prompt.strip() for spec in batch.images) and batch.mode == "txt2img":
            raise InvalidRequestError("prompt must not be empty", param="prompt")  # edits: variations send none

    # --- the loop ------------------------------------------------------------------------------------------------

    def __call__(self, batch: Batch, latents: np.ndarray | None = None,
                 max_sequence_length: int | None = None, on_step: StepHook | None = None,
                 adapters: Adapters | None = None) -> PipelineOutput:
        """Generate ``batch``: uint8 images [B, H, W, 3], per-image truncation, timings. ``latents`` (float32
        [B, C, h, w], unit noise, unpacked) replaces the seeded noise (parity tests); ``max_sequence_length``
        replaces the family's text length; ``on_step(done, total)`` runs after every step, False stops there and
        the latents so far are decoded (A1111's interrupt, a drain); ``adapters``: the batch's LoRA weights, handed
        to the text encoders and the transformer. The stages step-level batching runs for many requests at once:
        ``begin``, one evaluation at a time, ``finish``."""
        run = self.begin(batch, latents, adapters, max_sequence_length)
        while not run.finished:
            t = time.perf_counter()
            self.run_denoiser([run.state])
            self.advance(run.state)
            run.denoise_s += time.perf_counter() - t
            if on_step is not None and not on_step(run.state.done, run.steps_total) and not run.finished:
                run.stopped = True
        return self.finish(run)

    def begin(self, batch: Batch, latents: np.ndarray | None = None, adapters: Adapters | None = None,
              max_sequence_length: int | None = None) -> Begun:
        """Encode the prompts, draw each image's noise, prepare an img2img batch's start and the denoising state
        (every buffer under the runtime's current scope)."""
        self.check_inputs(batch)
        t0 = time.perf_counter()
        length = max_sequence_length or self.max_sequence_length
        guidance = np.array([s.guidance_scale for s in batch.images], dtype=np.float32)
        cfg = self.uses_cfg(guidance)
        # 1. Text: the architecture's encoders (negatives first under CFG).
        cond = self.encode(batch, length, cfg, adapters)
        extra = self.extra_tokens(batch)
        cond = replace(cond, extra=extra) if extra is not None else cond
        t1 = time.perf_counter()
        # 2. Initial noise per image from its seed, the request's schedule (an edit's strength skips the first
        #    steps) and the start latents: the noise (txt2img) or the encoded image noised to the first step.
        g = self.geometry
        h, w = batch.height // g.vae_scale_factor, batch.width // g.vae_scale_factor
        rngs = [image_rng(s.seed) for s in batch.images]
        seeded = np.stack([r.standard_normal((g.latent_channels, h, w), dtype=np.float32) for r in rngs])
        x = seeded if latents is None else latents.astype(np.float32)  # the streams advance either way
        full = self.schedule(batch.steps, h, w)
        first = flow_start(batch.steps, batch.strength) if batch.mode == "img2img" else 0
        schedule = FlowSchedule(full.timesteps[first:], full.sigmas[first:])
        start, model_in = self._start(batch, x, rngs, float(schedule.sigmas[0]), 2 if cfg else 1)
        t2 = time.perf_counter()
        # 3. The denoising state on the device.
        feeds = self.transformer_feeds(cond, guidance, h, w, len(batch.images))
        state = self._start_denoise(start, model_in, feeds, guidance, schedule, cfg, adapters, (h, w))
        state.sampler = start_sampler(self, batch.scheduler, schedule.sigmas, guidance, cfg, rngs, state)
        state.extra = self.extra.upload(self.runtime, extra, 2 if cfg else 1) if extra is not None else None
        if batch.cache is not None and batch.steps >= CACHE_MIN_STEPS:
            if batch.cache.method == "output":
                state.cache = OutputCache.start(batch.cache, state.evaluations, self.cache_probe, state.model_in,
                                                state.model_out, self.runtime.buffer)
            elif self.first_block is not None:
                if extra is not None:
                    raise InvalidRequestError("the first-block step cache is not served with reference images",
                                              param="cache")
                if adapters is not None and adapters.of(self.transformer.component):
                    raise InvalidRequestError("the first-block step cache runs the transformer's parts with their "
                                              "base weights: not with a LoRA on the transformer", param="cache")
                state.first_block = self.first_block.start(state.model_in, batch.cache.threshold)
        return Begun(batch, state, cond, None, len(schedule), (t0, t1, t2))

    def decode(self, run: Begun, images: int) -> None:
        """Decode up to ``images`` more of the batch's images where the denoising is (their rows of the latents
        taken on the device): latents / scaling + shift through the VAE; the images come down once."""
        start, stop = run.next_rows(images)
        if start >= stop:
            return
        t3 = time.perf_counter()
        state = run.state
        assert isinstance(state, DitDenoising)
        h, w = state.latent_size
        part = self.rows.take("latents", state.lat[0], start, stop)
        run.decoded.append(self._decode(part, stop - start, h, w))
        run.decode_s += time.perf_counter() - t3

    def finish(self, run: Begun) -> PipelineOutput:
        """Decode what ``decode`` did not yet (all of it, when it was not called) and return the batch."""
        state = run.state
        assert isinstance(state, DitDenoising)
        self.decode(run, len(run.batch.images))
        images = run.all_decoded()
        t0, t1, t2 = run.started
        timings = Timings(text_encoder=t1 - t0, denoise=run.denoise_s, vae_decode=run.decode_s,
                          total=(t2 - t0) + run.denoise_s + run.decode_s, vae_encode=t2 - t1)
        first = state.first_block
        use = cache_use(state) or (CacheUse(run.batch.cache, first.reused, first.reused + first.computed)
                                   if first is not None and run.batch.cache is not None else None)
        return PipelineOutput(images, run.cond.truncated, run.cond.negative_truncated, timings, state.done,
                              run.steps_total, cache=use)

    def stepwise(self) -> FlowPipeline:
        return self

    def joinable(self) -> bool:
        """The exported transformers take a timestep per row (dit_export.py)."""
        return True

    def run_denoiser(self, states: Sequence[DitDenoising]) -> None:
        """One transformer evaluation for each state at its next step, all rows in one call: the per-row inputs
        (latent tokens, timestep, text states, pooled embeddings, guidance) joined on the device, the per-size ones
        (rope tables: equal within a step key) bound once, the output rows copied back (rows.py)."""
        running = partition(states)  # a cached state reusing its output is left out of the call
        joined = [s for s in running if s.first_block is None]
        for state in running:
            if state.first_block is not None and self.first_block is not None:
                self.first_block.run(state)  # its first block, then the rest or the cached tail
        for group in by_extra(joined):  # rows with other extra tokens (other rope tables) never share a call
            self._run_joined(group)
        record(running)

    def _run_joined(self, states: Sequence[DitDenoising]) -> None:
        first, join, one = states[0], self.rows.join, len(states) == 1
        feeds: dict[str, Feed] = {
            "hidden_states": join("hidden_states", [s.model_in for s in states]),
            "timestep": join("timestep", [s.timesteps[s.next_eval] for s in states])}
        for name, value in first.feeds.items():
            values = [s.feeds[name] for s in states]
            if not one and not all(isinstance(v, ort.OrtValue) for v in values):
                raise InferenceError("rows joined into one transformer call must bind device inputs")
            feeds[name] = join(name, values) if name in ROW_INPUTS else value
        shape = (sum(s.model_out.shape()[0] for s in states), *first.model_out.shape()[1:])
        out = first.model_out if one else self.runtime.buffer("dit_rows_out", shape, self.transformer.output_dtype())
        full = out
        if first.extra is not None:  # the extra tokens joined on the token axis, their output dropped
            extra = join("extra", [s.extra.tokens for s in states if s.extra is not None])
            feeds["hidden_states"] = self.extra.join(feeds["hidden_states"], extra, first.extra.prepend)
            full = self.extra.output(out, extra)
        self.transformer.run(feeds, {"out_hidden_states": full}, first.adapters)  # one LoRA set per step key
        if first.extra is not None:
            self.extra.strip(full, out, first.extra.prepend)
        for state in states[1:]:
            if state.adapters is not None and first.adapters is not None:
                state.adapters.adapted |= first.adapters.adapted
        if not one:
            self.rows.split(out, [s.model_out for s in states])

    def advance(self, state: DitDenoising) -> bool:
        """The step graph writes the next latents and the next transformer input. Every evaluation is a step."""
        if state.sampler is not None:
            return state.sampler.advance(state)
        i = state.next_eval
        state.step.run({"sample": state.lat[0], "model_out": state.model_out, "coeffs": state.coeffs[i]},
                       {"next": state.lat[1], "model_in": state.model_in})
        state.lat.reverse()
        state.next_eval += 1
        state.done += 1
        return True

    def checked_tokens(self, batch: Batch, what: str, ids: np.ndarray, truncated: tuple[bool, ...], limit: int,
                       negatives: int = 0) -> np.ndarray:
        """The ids of a tokenized batch; a truncated prompt refused (naming the field) unless the batch truncates."""
        if any(truncated):
            name = "prompt" if any(truncated[negatives:]) else "negative_prompt"
            if not batch.truncate_prompts:
                raise InvalidRequestError(f"{name} is longer than the {what} takes ({limit} tokens)", param=name)
            log.warning("%d %s(s) truncated to the %s's %d tokens", sum(truncated), name, what, limit)
        return ids

    def transformer_feeds(self, cond: DitConditioning, guidance: np.ndarray, h: int, w: int,
                          rows: int) -> dict[str, Feed]:
        """The per-request transformer inputs, on the device once, each in the session's input type: the text
        rows, the size's positional tables and the embedded guidance (the hooks')."""
        model = self.transformer
        host = {**self.text_feeds(cond), **self.position_feeds(cond, h, w), **self.guidance_feeds(guidance, rows)}
        return {name: self.runtime.upload(f"dit_{name}", value.astype(model.input_dtype(name)))
                for name, value in host.items()}

    def _start(self, batch: Batch, noise: np.ndarray, rngs: list[np.random.Generator], sigma: float,
               copies: int) -> tuple[ort.OrtValue, ort.OrtValue]:
        """(start latents, first transformer input) on the device: the noise itself (packed where ``packed``), or
        an img2img batch's encoded images noised to ``sigma``."""
        if batch.mode == "img2img" and self.editor is not None:
            return self.editor.prepare(batch, noise, rngs, sigma, copies)
        x = pack_latents(noise) if self.packed else noise
        in_dtype = self.transformer.input_dtype("hidden_states")
        return (self.runtime.upload("dit_latents0", x.astype(np.float32)),
                self.runtime.upload("dit_in", np.concatenate([x] * copies).astype(in_dtype)))

    def _start_denoise(self, start: ort.OrtValue, model_in: ort.OrtValue, feeds: dict[str, Feed],
                       guidance: np.ndarray, schedule: FlowSchedule, cfg: bool, adapters: Adapters | None,
                       latent_size: tuple[int, int]) -> DitDenoising:
        """The denoising state on the device: the transformer on [x; x] (CFG) or [x], then the step graph writes
        the next latents and the next transformer input; per-step timesteps and coefficients uploaded once."""
        rt, shape = self.runtime, tuple(start.shape())
        n, copies = shape[0], 2 if cfg else 1
        lat = [start, rt.buffer("dit_latents1", shape, np.float32)]
        model_out = rt.buffer("dit_out", (copies * n, *shape[1:]), self.transformer.output_dtype())
        divisor = np.float32(self.TIMESTEP_SCALE)  # as diffusers divides the float32 timestep
        times = np.stack([np.full(copies * n, t, dtype=np.float32) / divisor for t in schedule.timesteps])
        timesteps = rt.upload_steps("dit_timesteps", times.astype(self.transformer.input_dtype("timestep")))
        coeffs = rt.upload_steps("dit_coeffs", np.stack([
            self.coefficients(schedule.sigmas[i], schedule.sigmas[i + 1], guidance, cfg)
            for i in range(len(schedule))]))
        return DitDenoising(len(schedule), self.step_cfg if cfg else self.step, lat, model_in, model_out, feeds,
                            timesteps, coeffs, adapters, latent_size)

    def _decode(self, latents: ort.OrtValue, n: int, h: int, w: int) -> np.ndarray:
        """latents / scaling + shift (unpacked first where ``packed``) on the device, the VAE, and the image down
        once."""
        c, f = self.geometry.latent_channels, self.geometry.vae_scale_factor
        vae_in = next(iter(self.vae_decoder.inputs))
        scaled = self.runtime.buffer("dit_vae_in", (n, c, h, w), self.vae_decoder.input_dtype(vae_in))
        feeds: dict[str, Feed] = {"latents": latents}
        if self.packed:
            feeds["unpacked_shape"] = shape_feed([n, h // 2, w // 2, c, 2, 2])
            feeds["image_shape"] = shape_feed([n, c, h, w])
        self.decode_scale.run(feeds, {"scaled": scaled})
        host, out = self.runtime.staging("dit_image", (n, 3, h * f, w * f), self.vae_decoder.output_dtype())
        self.vae_decoder.run({vae_in: scaled}, {self.vae_decoder.outputs[0]: out})
        decoded = host.astype(np.float32)
        if not np.isfinite(decoded).all():
            raise InferenceError("the VAE produced NaN/inf values (fp16 overflow or corrupted weights)")
        image = np.clip(decoded / 2 + 0.5, 0.0, 1.0)
        return np.ascontiguousarray((image.transpose(0, 2, 3, 1) * 255).round().astype(np.uint8))


def prebuilt_what(sources: dict[str, Path]) -> str:
    """What the prebuilt models that leave the first-block parts out are ("" when none are, or they cover them)."""
    if not sources or all(part in sources for part in FIRST_BLOCK_PARTS):
        return ""
    from engines.artifacts import TRT_DIR

    trt = any(TRT_DIR in path.parts for path in sources.values())
    return "TensorRT engines, `sdserve engines build`" if trt else "EP-context artifacts, `sdserve engines build`"


def load_pipeline(folder: Path, runtime: Runtime, label: str = "", sources: dict[str, Path] | None = None) -> Any:
    """The registered pipeline of a folder's architecture (engines/architectures.py), loaded."""
    return architectures.of(folder).pipeline_class()(folder, runtime, label=label, sources=sources)
