"""Stable Diffusion txt2img on ONNX Runtime, every session call through IO binding.

Text embeddings, latents, noise predictions and the UNet input live in device buffers reused across steps
(device ``cpu`` when the policy allows only the CPU). Only the initial noise (and Euler-ancestral step noise) goes
up and the image comes down: the latents are scaled for the VAE on the device too. Latents and scheduler state are
float32 even for fp16 UNets (see step_graph.py); only the UNet's input is cast to its dtype.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import onnxruntime as ort

from engines.diffusion.schedulers import SCHEDULERS, NoiseSchedule, SchedulePlan, make_plan
from engines.diffusion.step_graph import STATE_DTYPE, build_scale_graph, build_step_graph, step_coefficients
from engines.diffusion.tokenizer import ClipTokenizer
from engines.errors import InferenceError, InvalidRequestError, ModelLoadError
from engines.protocol import Batch, Timings
from engines.runtime.sessions import Runtime, numpy_dtype

Feed: TypeAlias = ort.OrtValue | np.ndarray


class OrtModel:
    """One component session; IO names, ranks and dtypes come from the session, never hard-coded."""

    def __init__(self, runtime: Runtime, model: Path | bytes, name: str) -> None:
        self.name = name
        self.session = runtime.session(model, name)
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]

    def input_dtype(self, name: str) -> type[np.generic]:
        return numpy_dtype(self.inputs[name].type)

    def output_dtype(self, index: int = 0) -> type[np.generic]:
        return numpy_dtype(self.session.get_outputs()[index].type)

    def run(self, feeds: dict[str, Feed], outputs: dict[str, ort.OrtValue]) -> None:
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, np.require(value, requirements="C"))  # keeps rank 0
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        self.session.run_with_iobinding(binding)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def image_rng(seed: int) -> np.random.Generator:
    """Per-image noise stream: the initial latents first, then Euler-ancestral step noise, in order."""
    return np.random.default_rng(seed)


@dataclass(frozen=True)
class PipelineOutput:
    images: np.ndarray
    """uint8 [B, H, W, 3]."""
    truncated: tuple[bool, ...]
    """Per image: its prompt was longer than the text encoder takes."""
    negative_truncated: tuple[bool, ...]
    timings: Timings


@dataclass(frozen=True)
class UNetIO:
    sample: str
    timestep: str
    hidden: str
    out: str
    timestep_shape: tuple[int, ...]


def _unet_io(model: OrtModel) -> UNetIO:
    by_rank: dict[int, str] = {}
    for name, arg in model.inputs.items():
        by_rank.setdefault(len(arg.shape), name)
    extra = set(model.inputs) - set(by_rank.values())
    if extra or not {4, 3} <= set(by_rank) or not ({0, 1} & set(by_rank)):
        raise ModelLoadError(f"unet inputs {sorted(model.inputs)} are not SD 1.x/2.x "
                             "(expected sample, timestep, encoder_hidden_states)")
    timestep = by_rank.get(0) or by_rank[1]
    shape = model.inputs[timestep].shape
    return UNetIO(by_rank[4], timestep, by_rank[3], model.outputs[0], () if not shape else (1,))


class StableDiffusionOnnx:
    """Loads an optimum-layout folder and runs txt2img batches."""

    def __init__(self, folder: Path, runtime: Runtime, sources: dict[str, Path] | None = None) -> None:
        """``sources`` replaces a component's model.onnx (e.g. a TensorRT EP-context model with prebuilt engines)."""
        for part in ("text_encoder", "unet", "vae_decoder"):
            if not (folder / part / "model.onnx").is_file():
                raise ModelLoadError(f"{folder} has no {part}/model.onnx (expected the optimum ONNX layout)")
        paths = {part: (sources or {}).get(part, folder / part / "model.onnx")
                 for part in ("text_encoder", "unet", "vae_decoder")}
        self.runtime = runtime
        self.tokenizer = ClipTokenizer(folder / "tokenizer")
        self.text_encoder = OrtModel(runtime, paths["text_encoder"], "text_encoder")
        self.unet = OrtModel(runtime, paths["unet"], "unet")
        self.vae_decoder = OrtModel(runtime, paths["vae_decoder"], "vae_decoder")
        self.schedule = NoiseSchedule.from_config(_read_json(folder / "scheduler" / "scheduler_config.json"))
        self.io = _unet_io(self.unet)
        self.latent_dtype = self.unet.input_dtype(self.io.sample)
        self.step = OrtModel(runtime, build_step_graph(self.latent_dtype, self.unet.output_dtype()), "scheduler_step")
        channels = self.unet.inputs[self.io.sample].shape[1]
        unet_cfg = _read_json(folder / "unet" / "config.json")
        vae_cfg = _read_json(folder / "vae_decoder" / "config.json")
        self.latent_channels = channels if isinstance(channels, int) else int(unet_cfg.get("in_channels", 4))
        self.vae_scale_factor = 2 ** (len(vae_cfg.get("block_out_channels", [0] * 4)) - 1)
        self.size_multiple = self.vae_scale_factor * 2 ** (len(unet_cfg.get("block_out_channels", [0] * 4)) - 1)
        self.scaling_factor = float(vae_cfg.get("scaling_factor", 0.18215))
        vae_in = next(iter(self.vae_decoder.inputs))
        self.vae_scale = OrtModel(runtime, build_scale_graph(1.0 / self.scaling_factor,
                                                             self.vae_decoder.input_dtype(vae_in)), "vae_scale")
        sample = unet_cfg.get("sample_size", 64)
        self.default_size = int(sample if isinstance(sample, int) else 64) * self.vae_scale_factor
        width = [self.unet.inputs[self.io.hidden].shape[2], self.text_encoder.session.get_outputs()[0].shape[-1]]
        known = [w for w in width if isinstance(w, int)]
        if not known:
            raise ModelLoadError("cannot tell the text embedding width from the unet or text_encoder inputs")
        self.hidden_width = known[0]

    def check_inputs(self, batch: Batch) -> None:
        """Refuse (never clamp) what this model cannot serve; the server validates first, this is the backstop."""
        if not batch.images:
            raise InvalidRequestError("a batch needs at least one image", param="n")
        for name, value in (("width", batch.width), ("height", batch.height)):
            if value <= 0 or value % self.size_multiple:
                raise InvalidRequestError(f"{name} {value} must be a positive multiple of {self.size_multiple}",
                                          param="size")
        if batch.steps < 1:
            raise InvalidRequestError(f"steps {batch.steps} must be at least 1", param="steps")
        if batch.scheduler not in SCHEDULERS:
            raise InvalidRequestError(f"unknown scheduler {batch.scheduler!r}; expected one of "
                                      f"{sorted(SCHEDULERS)}", param="scheduler")
        if any(not spec.prompt.strip() for spec in batch.images):
            raise InvalidRequestError("prompt must not be empty", param="prompt")

    def __call__(self, batch: Batch, latents: np.ndarray | None = None) -> PipelineOutput:
        """Generate ``batch``: uint8 images, per-image prompt truncation (prompts are tokenized once, here) and
        phase timings.
        ``latents`` (float32 [B,C,h,w], unscaled unit noise) replaces the seeded initial noise, for parity tests."""
        self.check_inputs(batch)
        t0 = time.perf_counter()
        n = len(batch.images)
        shape = (n, self.latent_channels, batch.height // self.vae_scale_factor, batch.width // self.vae_scale_factor)
        # 1. Encode negative and positive prompts in one call: rows [uncond..., text...].
        hidden, truncated, negative_truncated = self._encode(batch)
        t1 = time.perf_counter()
        # 2. Per-request schedule and per-image noise streams.
        plan = make_plan(batch.scheduler, self.schedule, batch.steps)
        rngs = [image_rng(spec.seed) for spec in batch.images]
        seeded = np.stack([rng.standard_normal(shape[1:], dtype=np.float32) for rng in rngs])
        latents = seeded if latents is None else latents  # the stream advances either way
        guidance = np.array([spec.guidance_scale for spec in batch.images], dtype=np.float64)
        # 3. Denoise: UNet on [uncond; text], then the step graph writes the next latents and UNet input.
        final = self._denoise(plan, latents, hidden, guidance, rngs)
        t2 = time.perf_counter()
        # 4. Decode on the device; the image comes down once.
        images = self._decode(final, batch)
        t3 = time.perf_counter()
        timings = Timings(text_encoder=t1 - t0, denoise=t2 - t1, vae_decode=t3 - t2, total=t3 - t0)
        return PipelineOutput(images, truncated, negative_truncated, timings)

    def _denoise(self, plan: SchedulePlan, latents: np.ndarray, hidden: ort.OrtValue, guidance: np.ndarray,
                 rngs: list[np.random.Generator]) -> ort.OrtValue:
        """Run every step; returns the device buffer holding the final float32 latents."""
        shape, n = latents.shape, len(latents)
        x = latents.astype(np.float64) * plan.init_noise_sigma
        f32, dt = STATE_DTYPE, self.latent_dtype
        lat = [self.runtime.upload("latents0", x.astype(f32)), self.runtime.buffer("latents1", shape, f32)]
        den = [self.runtime.upload("denoised0", np.zeros(shape, f32)), self.runtime.buffer("denoised1", shape, f32)]
        model_in = self.runtime.upload("unet_in", np.concatenate([x * plan.steps[0].input_scale] * 2).astype(dt))
        model_out = self.runtime.buffer("unet_out", (2 * n, *shape[1:]), self.unet.output_dtype())
        zeros = self.runtime.upload("zeros", np.zeros(shape, f32))
        t_dtype = self.unet.input_dtype(self.io.timestep)
        for i, step in enumerate(plan.steps):
            timestep = np.full(self.io.timestep_shape, step.timestep, dtype=t_dtype)
            self.unet.run({self.io.sample: model_in, self.io.timestep: timestep, self.io.hidden: hidden},
                          {self.io.out: model_out})
            noise: Feed = zeros
            if step.next.noise:
                noise = self.runtime.upload("noise", np.stack([r.standard_normal(shape[1:], dtype=np.float32)
                                                               for r in rngs]))
            scale = plan.steps[i + 1].input_scale if i + 1 < len(plan.steps) else 1.0
            cur = i % 2
            self.step.run({"sample": lat[cur], "model_out": model_out, "prev": den[cur], "noise": noise,
                           "coeffs": step_coefficients(step.next, step.denoised, guidance),
                           "in_scale": np.array([scale], dtype=f32)},
                          {"next": lat[1 - cur], "denoised": den[1 - cur], "model_in": model_in})
        return lat[len(plan.steps) % 2]

    def _encode(self, batch: Batch) -> tuple[ort.OrtValue, tuple[bool, ...], tuple[bool, ...]]:
        """Hidden states of [negatives..., prompts...]; refuses over-long prompts unless the batch truncates."""
        n = len(batch.images)
        prompts = [s.negative_prompt for s in batch.images] + [s.prompt for s in batch.images]
        tokens = self.tokenizer(prompts)
        if not batch.truncate_prompts and any(tokens.truncated):
            name = "prompt" if any(tokens.truncated[n:]) else "negative_prompt"
            raise InvalidRequestError(f"{name} is longer than the text encoder's {self.tokenizer.max_length} "
                                      "tokens", param=name)
        name = next(iter(self.text_encoder.inputs))
        ids = tokens.ids.astype(self.text_encoder.input_dtype(name))
        outputs = self.text_encoder.outputs
        out_name = "last_hidden_state" if "last_hidden_state" in outputs else outputs[0]
        hidden = self.runtime.buffer("hidden", (len(prompts), ids.shape[1], self.hidden_width),
                                     self.unet.input_dtype(self.io.hidden))
        self.text_encoder.run({name: ids}, {out_name: hidden})
        return hidden, tokens.truncated[n:], tokens.truncated[:n]

    def _decode(self, latents: ort.OrtValue, batch: Batch) -> np.ndarray:
        n = len(batch.images)
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
