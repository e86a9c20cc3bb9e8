"""Flow-matching DiT txt2img and img2img on ONNX Runtime (no torch): Flux.1 dev/schnell and Stable Diffusion
3 / 3.5.

The folder is the layout engines/build/dit_export.py writes (family: engines/pipelines/flow_family.py). What the two
bases do, as diffusers' FluxPipeline and StableDiffusion3Pipeline do it:

- Flux: CLIP-L's pooled output and T5's states condition the transformer; the 16-channel latents are packed 2×2
  into 64-channel tokens with position ids (``img_ids``: (0, row, col); ``txt_ids``: zeros), whose rotary tables
  are computed here in float64 and fed in fp32 (``flux_rope``); dev takes the guidance scale as an input
  (``guidance``), schnell has none; no classifier-free guidance; the timestep goes in as ``t / 1000``; the schedule
  shifts by the image's token count (``mu``) when the scheduler config asks. A negative prompt is not used (as
  diffusers without ``true_cfg_scale``, and Forge/ComfyUI's Flux defaults).
- SD 3 / 3.5: CLIP-L and CLIP-G penultimate states side by side, zero-padded to the T5 width, then the T5 states
  after them on the sequence axis; the two pooled projections concatenated; classifier-free guidance with a
  negative prompt (rows [negatives..., prompts...]); the timestep goes in as ``t``.

Both decode ``latents / scaling_factor + shift_factor``. T5 reads ``max_sequence_length`` tokens (Flux dev 512,
schnell and SD 3 256); a longer prompt is truncated with a warning and reported per image, or refused when the
batch does not truncate.

Sessions are built by the Runtime (providers under the policy) and run through IO binding. The text encoders run
once per request with host outputs (the conditioning is assembled on the host and uploaded once); the denoising
loop keeps the latents, the transformer input and output and the per-step timesteps and coefficients on the device:
a small step graph (engines/numerics/flow_graph.py) applies the Euler step and CFG as a linear combination whose
coefficients the flow schedule (engines/numerics/flow_schedule.py) gives, and a decode graph unpacks and rescales the
latents for the VAE. Only the initial noise goes up and the image comes down. img2img (engines/pipelines/
dit_edits.py) encodes the init image on the device and enters the same loop at the step its strength picks.

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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engines.errors import InferenceError, InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.flow_graph import build_flow_decode_graph, build_flow_step_graph, flow_coefficients, flow_start
from engines.numerics.flow_schedule import FlowMatchConfig, FlowSchedule, flow_schedule, flux_sigmas
from engines.numerics.rows import RowPacker, shape_feed
from engines.numerics.step_cache import OutputCache, Probe, cache_use, partition, record
from engines.numerics.t5_tokenizer import T5Tokenizer
from engines.numerics.tokenizer import ClipTokenizer
from engines.pipelines.first_block import PARTS as FIRST_BLOCK_PARTS
from engines.pipelines.first_block import FirstBlockRunner, FirstBlockState
from engines.pipelines.flow_edits import DitEditor
from engines.pipelines.flow_family import DitFamily, detect_dit
from engines.pipelines.unet import Begun, Feed, OrtModel, PipelineOutput, image_rng
from engines.pipelines.unet_family import read_json
from engines.runtime.sessions import Runtime
from engines.types.model import ModelInfo
from engines.types.request import CACHE_MIN_STEPS, Batch, CacheUse, StepHook, Timings

log = logging.getLogger(__name__)
NATIVE_SIZE_KEY = "_sdserve_native_size"
"""model_index.json key of a model's native size in pixels where its configs do not say it (the tiny models: a
self-test at 64x64, not Flux's 1024)."""
SAMPLERS = ("euler",)
"""Flow matching samples with Euler on the flow schedule (what Forge and ComfyUI serve Flux with: Euler, "Simple")."""
ROPE_THETA = 10000.0
"""FluxTransformer2DModel's rotary base (FluxPosEmbed(theta=10000))."""


def flux_rope(ids: np.ndarray, axes_dim: Sequence[int], theta: float = ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """Rotary (cos, sin) tables [tokens, sum(axes_dim)] for position ids [tokens, axes]: per axis, angles
    ``pos * theta^(-2i/dim)`` in float64, each value repeated twice (interleaved pairs), cast to float32."""
    cos, sin = [], []
    pos = ids.astype(np.float32).astype(np.float64)
    for axis, dim in enumerate(axes_dim):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        angles = np.outer(pos[:, axis], freqs)
        cos.append(np.repeat(np.cos(angles), 2, axis=1).astype(np.float32))
        sin.append(np.repeat(np.sin(angles), 2, axis=1).astype(np.float32))
    return np.concatenate(cos, axis=-1), np.concatenate(sin, axis=-1)


def image_ids(grid_h: int, grid_w: int) -> np.ndarray:
    """Flux's ``img_ids``: (0, row, col) for each packed latent token, row-major, float32 [h*w, 3]."""
    ids = np.zeros((grid_h, grid_w, 3), dtype=np.float32)
    ids[..., 1] = np.arange(grid_h, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(grid_w, dtype=np.float32)[None, :]
    return ids.reshape(grid_h * grid_w, 3)


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
    """Transformer text inputs for one batch: states [rows, tokens, width] and pooled [rows, width]."""

    states: np.ndarray
    pooled: np.ndarray
    truncated: tuple[bool, ...]
    negative_truncated: tuple[bool, ...]


ROW_INPUTS = ("encoder_hidden_states", "pooled_projections", "guidance", "encoder_hidden_states_mask")
"""Transformer inputs with a row per image (besides hidden_states and timestep); the others (Flux's rope tables)
depend on the size only. (Qwen-Image's key mask: engines/pipelines/qwen.py.)"""


@dataclass
class DitDenoising:
    """One batch's denoising on the device between transformer evaluations (DitOnnx.begin / run_denoiser /
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


@dataclass(frozen=True)
class _Geometry:
    vae_scale_factor: int
    latent_channels: int
    scaling_factor: float
    shift_factor: float
    size_multiple: int


def _geometry(folder: Path, family: DitFamily) -> _Geometry:
    vae = read_json(folder / "vae_decoder" / "config.json")
    transformer = read_json(folder / "transformer" / "config.json")
    scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    patch = 2 if family.base == "flux" else int(transformer.get("patch_size", 2))
    return _Geometry(scale, int(vae.get("latent_channels", 16)), float(vae.get("scaling_factor", 1.0)),
                     float(vae.get("shift_factor") or 0.0), scale * patch)


class DitOnnx:
    """Loads an exported Flux or SD 3 folder and runs txt2img and img2img batches (engines.protocol.Batch)."""

    def __init__(self, folder: Path, runtime: Runtime, label: str = "", sources: dict[str, Path] | None = None) -> None:
        """ModelLoadError (exit 11) when the folder is no served DiT family or misses a component. ``sources``:
        per component, the model to load instead of ``<component>/model.onnx`` (prebuilt EP-context models)."""
        given = sources or {}
        self.family = detect_dit(folder)
        flux = self.family.base == "flux"
        t5 = "text_encoder_2" if flux else "text_encoder_3"
        parts = ["text_encoder", t5, "transformer", "vae_decoder"] + ([] if flux else ["text_encoder_2"])
        for part in parts:
            if not (folder / part / "model.onnx").is_file():
                raise ModelLoadError(f"{folder} has no {part}/model.onnx (the ONNX layout of a {self.family.name} "
                                     "model: `sdserve engines export`)")
        self.runtime = runtime
        models = {part: OrtModel(runtime, given.get(part, folder / part / "model.onnx"), part + label)
                  for part in parts}
        self.t5, self.transformer, self.vae_decoder = models[t5], models["transformer"], models["vae_decoder"]
        self.clips = [(ClipTokenizer(folder / "tokenizer"), models["text_encoder"])]
        """CLIP-L (Flux: its pooled output), and SD 3's CLIP-G second."""
        if not flux:
            self.clips.append((ClipTokenizer(folder / "tokenizer_2"), models["text_encoder_2"]))
        self.t5_tokenizer = T5Tokenizer(folder / ("tokenizer_2" if flux else "tokenizer_3"))
        self.flow = FlowMatchConfig.from_config(read_json(folder / "scheduler" / "scheduler_config.json"))
        self.geometry = _geometry(folder, self.family)
        self.axes_dim = tuple(int(a) for a in read_json(folder / "transformer" / "config.json").get(
            "axes_dims_rope", (16, 56, 56)))
        sample = read_json(folder / "transformer" / "config.json").get("sample_size")
        native = read_json(folder / "model_index.json").get(NATIVE_SIZE_KEY)
        self._native = int(native) if native else (
            int(sample) * self.geometry.vae_scale_factor if sample and not flux else 1024)
        self.guidance_input = "guidance" in self.transformer.inputs
        if flux and self.guidance_input != self.family.guidance_embeds:
            raise ModelLoadError(f"{folder}: the transformer's inputs {sorted(self.transformer.inputs)} do not match "
                                 f"its config (guidance_embeds={self.family.guidance_embeds})")
        self.max_sequence_length = min(self.family.max_sequence_length, self.t5_tokenizer.model_max_length)
        in_dtype, out_dtype = self.transformer.input_dtype("hidden_states"), self.transformer.output_dtype()
        self.step = OrtModel(runtime, build_flow_step_graph(in_dtype, out_dtype, cfg=False, packed=flux),
                             "flow_step" + label)
        self.step_cfg = OrtModel(runtime, build_flow_step_graph(in_dtype, out_dtype, cfg=True, packed=flux),
                                 "flow_step_cfg" + label)
        kinds = [(self.transformer.input_dtype(name), len(arg.shape)) for name, arg in self.transformer.inputs.items()
                 if name in ("hidden_states", "timestep", *ROW_INPUTS)]
        self.rows = RowPacker(runtime, lambda m, name: OrtModel(runtime, m, name + label), kinds,
                              (out_dtype, len(self.transformer.session.get_outputs()[0].shape)))
        self.cache_probe = Probe.build(lambda m, name: OrtModel(runtime, m, name + label), [in_dtype, out_dtype])
        prebuilt = bool(given) and not all(part in given for part in FIRST_BLOCK_PARTS)
        self.first_block = FirstBlockRunner(folder, runtime, label, given) \
            if FirstBlockRunner.available(folder) and not prebuilt else None
        """The first-block cache's transformer parts (exported with `sdserve engines export --first-block`), or None:
        loaded beside the full transformer, which uncached requests keep running. Not loaded where the other
        components run from prebuilt EP-context artifacts that do not cover the parts (the TensorRT plan builds no
        engine for them yet; building one on the node is what the policy forbids)."""
        g, vae_in = self.geometry, next(iter(self.vae_decoder.inputs))
        self.decode_scale = OrtModel(runtime, build_flow_decode_graph(g.scaling_factor, g.shift_factor,
                                                                      self.vae_decoder.input_dtype(vae_in), flux),
                                     "flow_decode" + label)
        encoder = folder / "vae_encoder" / "model.onnx"
        self.editor = DitEditor(runtime, OrtModel(runtime, given.get("vae_encoder", encoder), "vae_encoder" + label),
                                lambda model, name: OrtModel(runtime, model, name + label), g.scaling_factor,
                                g.shift_factor, in_dtype, flux) if encoder.is_file() else None
        self.edits_unavailable = "" if self.editor else (
            f"{folder.name} has no vae_encoder/model.onnx: it serves txt2img only (re-export it with "
            "`sdserve engines export` to serve img2img)")

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: the VAE factor × the 2×2 pack (Flux) or patch (SD 3)."""
        return self.geometry.size_multiple

    @property
    def default_size(self) -> int:
        """The native size: SD 3's transformer ``sample_size`` × the VAE factor (128 × 8 = 1024 for the released
        models), Flux's pipeline default 1024 (its transformer config has no sample size)."""
        return self._native

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """What the engine reports and validates requests against (``/v1/models``, ``/capabilities``)."""
        f = self.family
        return ModelInfo(name=name, size_multiple=self.size_multiple, default_size=self.default_size,
                         schedulers=SAMPLERS, max_prompt_tokens=self.clips[0][0].max_length, digest=digest,
                         family=f.name, prediction_type="flow", text_encoders=len(self.clips) + 1,
                         vae_scaling_factor=self.geometry.scaling_factor, cfg_default=f.cfg, default_steps=f.steps,
                         default_guidance=f.guidance,
                         modes=("txt2img", "img2img") if self.editor else ("txt2img",),
                         edits_unavailable=self.edits_unavailable, edit_schedulers=SAMPLERS if self.editor else ())

    @property
    def denoiser(self) -> OrtModel:
        return self.transformer

    def adaptable(self) -> list[OrtModel]:
        return [self.transformer, self.t5, *(model for _, model in self.clips)]

    def check_inputs(self, batch: Batch) -> None:
        """Refuse (never clamp) what this model cannot serve."""
        if not batch.images:
            raise InvalidRequestError("a batch needs at least one image", param="n")
        if batch.mode == "inpaint":
            raise InvalidRequestError(f"inpainting is not served for {self.family.name} (txt2img and img2img are)",
                                      param="mask")
        if batch.mode == "img2img" and self.editor is None:
            raise InvalidRequestError(f"img2img is not served by this model: {self.edits_unavailable}",
                                      param="image")
        if batch.mode == "img2img" and not 0.0 < batch.strength <= 1.0:
            raise InvalidRequestError(f"strength {batch.strength} must be in (0, 1]", param="strength")
        for name, value in (("width", batch.width), ("height", batch.height)):
            if value <= 0 or value % self.size_multiple:
                raise InvalidRequestError(f"{name} {value} must be a positive multiple of {self.size_multiple}",
                                          param="size")
        if batch.steps < 1:
            raise InvalidRequestError(f"steps {batch.steps} must be at least 1", param="steps")
        if batch.scheduler not in SAMPLERS:
            raise InvalidRequestError(f"scheduler {batch.scheduler!r} is not served for {self.family.name}: "
                                      "flow-matching models sample with Euler", param="scheduler")
        if batch.cache is not None and batch.cache.method == "first-block" and self.first_block is None:
            raise InvalidRequestError("the first-block step cache needs the transformer exported in parts "
                                      "(`sdserve engines export --first-block`); this model has none: use method "
                                      "'output'", param="cache")
        if any(not spec.prompt.strip() for spec in batch.images):
            raise InvalidRequestError("prompt must not be empty", param="prompt")

    def __call__(self, batch: Batch, latents: np.ndarray | None = None,
                 max_sequence_length: int | None = None, on_step: StepHook | None = None,
                 adapters: Adapters | None = None) -> PipelineOutput:
        """Generate ``batch``: uint8 images [B, H, W, 3], per-image truncation, timings. ``latents`` (float32
        [B, C, h, w], unit noise, unpacked) replaces the seeded noise (parity tests); ``max_sequence_length``
        replaces the family's T5 length; ``on_step(done, total)`` runs after every step, False stops there and the
        latents so far are decoded (A1111's interrupt, a drain); ``adapters``: the batch's LoRA weights, handed to
        the text encoders and the transformer. The stages step-level batching runs for many requests at once:
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
        cfg = self.family.cfg and bool((guidance > 1.0).any())
        # 1. Text: Flux (CLIP pooled, T5 states) or SD 3 (three encoders, negatives first under CFG).
        cond = self._encode_flux(batch, length, adapters) if self.family.base == "flux" else \
            self._encode_sd3(batch, length, cfg, adapters)
        t1 = time.perf_counter()
        # 2. Initial noise per image from its seed, the request's schedule (an edit's strength skips the first
        #    steps) and the start latents: the noise (txt2img) or the encoded image noised to the first step.
        g = self.geometry
        h, w = batch.height // g.vae_scale_factor, batch.width // g.vae_scale_factor
        rngs = [image_rng(s.seed) for s in batch.images]
        seeded = np.stack([r.standard_normal((g.latent_channels, h, w), dtype=np.float32) for r in rngs])
        x = seeded if latents is None else latents.astype(np.float32)  # the streams advance either way
        full = self._schedule(batch.steps, h, w)
        first = flow_start(batch.steps, batch.strength) if batch.mode == "img2img" else 0
        schedule = FlowSchedule(full.timesteps[first:], full.sigmas[first:])
        start, model_in = self._start(batch, x, rngs, float(schedule.sigmas[0]), 2 if cfg else 1)
        t2 = time.perf_counter()
        # 3. The denoising state on the device: Flux on 2x2-packed tokens, SD 3 on [negatives; prompts] rows.
        feeds = self._transformer_feeds(cond, guidance, h, w, len(batch.images))
        state = self._start_denoise(start, model_in, feeds, guidance, schedule, cfg, adapters, (h, w))
        if batch.cache is not None and batch.steps >= CACHE_MIN_STEPS:
            if batch.cache.method == "output":
                state.cache = OutputCache.start(batch.cache, state.evaluations, self.cache_probe, state.model_in,
                                                state.model_out, self.runtime.buffer)
            elif self.first_block is not None:
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

    def stepwise(self) -> DitOnnx:
        return self

    def joinable(self) -> bool:
        """The exported transformers take a timestep per row (dit_export.py)."""
        return True

    def run_denoiser(self, states: Sequence[DitDenoising]) -> None:
        """One transformer evaluation for each state at its next step, all rows in one call: the per-row inputs
        (latent tokens, timestep, text states, pooled embeddings, guidance) joined on the device, the per-size ones
        (Flux's rope tables: equal within a step key) bound once, the output rows copied back (rows.py)."""
        running = partition(states)  # a cached state reusing its output is left out of the call
        joined = [s for s in running if s.first_block is None]
        for state in running:
            if state.first_block is not None and self.first_block is not None:
                self.first_block.run(state)  # its first block, then the rest or the cached tail
        if joined:
            self._run_joined(joined)
        record(running)

    def _run_joined(self, states: Sequence[DitDenoising]) -> None:
        first = states[0]
        if len(states) == 1:
            self.transformer.run({"hidden_states": first.model_in, "timestep": first.timesteps[first.next_eval],
                                  **first.feeds}, {"out_hidden_states": first.model_out}, first.adapters)
            return
        join = self.rows.join
        feeds: dict[str, Feed] = {
            "hidden_states": join("hidden_states", [s.model_in for s in states]),
            "timestep": join("timestep", [s.timesteps[s.next_eval] for s in states])}
        for name, value in first.feeds.items():
            values = [s.feeds[name] for s in states]
            if not all(isinstance(v, ort.OrtValue) for v in values):
                raise InferenceError("rows joined into one transformer call must bind device inputs")
            feeds[name] = join(name, values) if name in ROW_INPUTS else value
        shape = (sum(s.model_out.shape()[0] for s in states), *first.model_out.shape()[1:])
        out = self.runtime.buffer("dit_rows_out", shape, self.transformer.output_dtype())
        self.transformer.run(feeds, {"out_hidden_states": out}, first.adapters)  # one LoRA set per step key
        for state in states[1:]:
            if state.adapters is not None and first.adapters is not None:
                state.adapters.adapted |= first.adapters.adapted
        self.rows.split(out, [s.model_out for s in states])

    def advance(self, state: DitDenoising) -> bool:
        """The step graph writes the next latents and the next transformer input. Every evaluation is a step."""
        i = state.next_eval
        state.step.run({"sample": state.lat[0], "model_out": state.model_out, "coeffs": state.coeffs[i]},
                       {"next": state.lat[1], "model_in": state.model_in})
        state.lat.reverse()
        state.next_eval += 1
        state.done += 1
        return True

    def _schedule(self, steps: int, h: int, w: int) -> FlowSchedule:
        """Flux: its evenly spaced sigmas, shifted by ``mu`` of the packed token count when the config says;
        SD 3: the scheduler's own spacing with its static shift."""
        if self.family.base == "flux":
            return flow_schedule(self.flow, steps, sigmas=flux_sigmas(steps), mu=self.flow.mu((h // 2) * (w // 2)))
        patch = self.geometry.size_multiple // self.geometry.vae_scale_factor
        mu = self.flow.mu((h // patch) * (w // patch)) if self.flow.use_dynamic_shifting else None
        return flow_schedule(self.flow, steps, mu=mu)

    def _tokens(self, batch: Batch, what: str, ids: np.ndarray, truncated: tuple[bool, ...], limit: int,
                negatives: int = 0) -> np.ndarray:
        if any(truncated):
            name = "prompt" if any(truncated[negatives:]) else "negative_prompt"
            if not batch.truncate_prompts:
                raise InvalidRequestError(f"{name} is longer than the {what} takes ({limit} tokens)", param=name)
            log.warning("%d %s(s) truncated to the %s's %d tokens", sum(truncated), name, what, limit)
        return ids

    def _clip(self, tokenizer: ClipTokenizer, batch: Batch, prompts: list[str],
              negatives: int) -> tuple[np.ndarray, tuple[bool, ...]]:
        tokens = tokenizer(prompts)
        return self._tokens(batch, "CLIP text encoder", tokens.ids, tokens.truncated, tokenizer.max_length,
                            negatives), tokens.truncated

    def _t5(self, batch: Batch, prompts: list[str], length: int, negatives: int,
            adapters: Adapters | None) -> tuple[np.ndarray, tuple[bool, ...]]:
        tokens = self.t5_tokenizer(prompts, length)
        ids = self._tokens(batch, "T5 encoder (max_sequence_length)", tokens.ids, tokens.truncated, length,
                           negatives)
        return run(self.t5, {next(iter(self.t5.inputs)): ids}, ["last_hidden_state"], adapters)[0], tokens.truncated

    def _encode_flux(self, batch: Batch, length: int, adapters: Adapters | None) -> DitConditioning:
        prompts = [s.prompt for s in batch.images]
        tokenizer, model = self.clips[0]
        ids, clip_cut = self._clip(tokenizer, batch, prompts, 0)
        pooled = run(model, {next(iter(model.inputs)): ids}, ["pooler_output"], adapters)[0]
        states, t5_cut = self._t5(batch, prompts, length, 0, adapters)
        cut = tuple(a or b for a, b in zip(clip_cut, t5_cut, strict=True))
        return DitConditioning(states, pooled, cut, (False,) * len(prompts))

    def _encode_sd3(self, batch: Batch, length: int, cfg: bool, adapters: Adapters | None) -> DitConditioning:
        n = len(batch.images)
        negatives = [s.negative_prompt for s in batch.images] if cfg else []
        prompts = negatives + [s.prompt for s in batch.images]
        k = len(negatives)
        states, pooled, cut = [], [], [False] * len(prompts)
        for tokenizer, model in self.clips:
            ids, trunc = self._clip(tokenizer, batch, prompts, k)
            penultimate = next(o for o in model.outputs if o.startswith("hidden_states."))
            embeds, hidden = run(model, {next(iter(model.inputs)): ids}, ["text_embeds", penultimate], adapters)
            states.append(hidden)
            pooled.append(embeds)
            cut = [a or b for a, b in zip(cut, trunc, strict=True)]
        t5_states, t5_cut = self._t5(batch, prompts, length, k, adapters)
        clip = np.concatenate(states, axis=-1)
        width = t5_states.shape[-1]
        if clip.shape[-1] > width:
            raise InferenceError(f"CLIP states ({clip.shape[-1]}) are wider than the T5's ({width})")
        clip = np.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
        cut = [a or b for a, b in zip(cut, t5_cut, strict=True)]
        return DitConditioning(np.concatenate([clip, t5_states], axis=1), np.concatenate(pooled, axis=-1),
                               tuple(cut[k:]), tuple(cut[:k]) if cfg else (False,) * n)

    def _transformer_feeds(self, cond: DitConditioning, guidance: np.ndarray, h: int, w: int,
                           rows: int) -> dict[str, Feed]:
        """The per-request transformer inputs, on the device once: text states and pooled embeddings; Flux's rope
        tables for this size (text tokens first, then the packed image tokens) and dev's guidance scale."""
        up, model = self.runtime.upload, self.transformer
        feeds: dict[str, Feed] = {
            "encoder_hidden_states": up("dit_states", cond.states.astype(model.input_dtype("encoder_hidden_states"))),
            "pooled_projections": up("dit_pooled", cond.pooled.astype(model.input_dtype("pooled_projections")))}
        if self.family.base == "flux":
            ids = np.concatenate([np.zeros((cond.states.shape[1], 3), np.float32), image_ids(h // 2, w // 2)])
            for name, table in zip(("rope_cos", "rope_sin"), flux_rope(ids, self.axes_dim), strict=True):
                feeds[name] = up(f"dit_{name}", table.astype(model.input_dtype(name)))
            if self.guidance_input:
                feeds["guidance"] = up("dit_guidance", guidance[:rows].astype(model.input_dtype("guidance")))
        return feeds

    def _start(self, batch: Batch, noise: np.ndarray, rngs: list[np.random.Generator], sigma: float,
               copies: int) -> tuple[ort.OrtValue, ort.OrtValue]:
        """(start latents, first transformer input) on the device: the noise itself (packed for Flux), or an
        img2img batch's encoded images noised to ``sigma``."""
        if batch.mode == "img2img" and self.editor is not None:
            return self.editor.prepare(batch, noise, rngs, sigma, copies)
        x = pack_latents(noise) if self.family.base == "flux" else noise
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
        # Flux takes t / 1000 (diffusers divides the float32 timestep); SD 3 takes t.
        divisor = np.float32(1000.0 if self.family.base == "flux" else 1.0)
        times = np.stack([np.full(copies * n, t, dtype=np.float32) / divisor for t in schedule.timesteps])
        timesteps = rt.upload_steps("dit_timesteps", times.astype(self.transformer.input_dtype("timestep")))
        coeffs = rt.upload_steps("dit_coeffs", np.stack([
            flow_coefficients(schedule.sigmas[i], schedule.sigmas[i + 1], guidance, cfg)
            for i in range(len(schedule))]))
        return DitDenoising(len(schedule), self.step_cfg if cfg else self.step, lat, model_in, model_out, feeds,
                            timesteps, coeffs, adapters, latent_size)

    def _decode(self, latents: ort.OrtValue, n: int, h: int, w: int) -> np.ndarray:
        """latents / scaling + shift (Flux: unpacked first) on the device, the VAE, and the image down once."""
        c, f = self.geometry.latent_channels, self.geometry.vae_scale_factor
        vae_in = next(iter(self.vae_decoder.inputs))
        scaled = self.runtime.buffer("dit_vae_in", (n, c, h, w), self.vae_decoder.input_dtype(vae_in))
        feeds: dict[str, Feed] = {"latents": latents}
        if self.family.base == "flux":
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
