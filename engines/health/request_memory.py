"""A request's working memory, estimated from its shape before anything runs: what admission refuses a request by
(server/admission.py) and what tells the runtime that a batch was large enough to trim the arenas after it
(engines/runtime/buffers.py ``DeviceBuffers.run``).

The formulas are the memory plan's (engines/health/memory_plan.py ``activations``, ``measured=True``): per stage,
the live activations of one call at the request's size, from the model's own configs (channels, heads, the VAE's
levels, the latent factor, whether guidance doubles the rows). What this module adds is the request's view:

- **Stages run one after another** on one arena (ONNX Runtime's shared arena: the CUDA one, and on the CPU the one
  engines/runtime/buffers.py registers), so the peak is the largest stage, not the sum: text encoding, the
  denoiser (one call at the rows it may share with other requests), the VAE encoder (edits, a Hires fix second pass
  from pixels) and the VAE decoder with the host image buffers the decode fills.
- **Attention is unfused** on ORT's CPU and CUDA providers for these graphs (onnxruntime.transformers' UNet
  attention fusion fails on graphs torch's legacy exporter writes), so every self-attention materializes heads x
  tokens^2 fp32 scores, twice (``SCORE_BUFFERS``): the VAE's mid-block attention over (H/8 x W/8)^2 is the
  3.29 GB buffer of a 1024x1792 image.
- **The arena rounds up** (``ARENA_SLACK``): the figures are the measured peaks' upper bound, not their mean.

Measured on the tiny SD 1.x model with ONNX Runtime 1.31 on the CPU (peak RSS growth of one request over the
loaded, warmed model, the arena shared and trimmed; tests/integration/test_arena_trim.py keeps checking the bound):
512x512 274 MiB (estimate 379), 768x768 894 MiB (1,017), 512x512 x 2 images 552 MiB (758), 256x256 x 4 272 MiB
(379), 1024x1024 2,164 MiB (3,063). Per stage, each session on its own arena: the UNet at 1024x1024 2,144 MiB
(formula before the slack 2,088), the VAE decoder 2,149 MiB (2,133); the VAE decoder at 768x768 883 MiB (726: the
worst ratio seen, 1.22).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.errors import ModelLoadError
from engines.health.controlnet_memory import request_bytes, residual_config, residual_sets
from engines.health.memory_plan import (
    DENOISERS,
    ITEMSIZE,
    TEXT_ENCODERS,
    Layout,
    Served,
    activations,
    component,
    config,
    layout,
)
from engines.types.model import MemoryNeed

log = logging.getLogger(__name__)
ARENA_SLACK = 1.4
"""What the formula is multiplied by: the measured peaks were up to 1.22 times it (the VAE decoder at 768x768,
where the arena's power-of-two regions round up the most), 1.03 at 1024x1024; with room for what was not measured
(another model, the CUDA arena, whose regions count whole on the device where the CPU's count only touched pages)."""
IMAGE_BUFFER_BYTES = 3 * 4 * 5
"""Host bytes per decoded pixel: the float32 staging buffer the VAE writes, its copy, the clipped and scaled
copies, then the uint8 image (engines/pipelines/unet.py ``_decode``)."""
GIB = 1 << 30


@dataclass(frozen=True, eq=False)
class RequestMemory:
    """The working memory of one model's requests by shape (engines.types.model.MemoryModel)."""

    lay: Layout
    configs: dict[str, dict[str, Any]]
    """Component name -> its config.json."""
    items: dict[str, int]
    """Component name -> bytes per activation element (the files' float type)."""
    controlnet: dict[str, Any] = field(default_factory=dict)
    """The residual denoiser's config (``unet_controlnet/``, or FLUX.1's transformer config beside
    ``transformer_controlnet/``; {}: no ControlNet residuals): a controlled request's denoiser stage holds the
    residual sets its units keep (engines/health/controlnet_memory.py ``residual_sets``)."""

    @property
    def factor(self) -> int:
        return self.lay.factor

    def stage(self, name: str, width: int, height: int, images: int, extra_tokens: int = 0) -> int:
        """One component's live activations for ``images`` images at ``width`` x ``height`` (0 without it);
        ``extra_tokens``: reference tokens in each denoiser row."""
        kind = self.lay.parts.get(name)
        if kind is None or images <= 0:
            return 0
        return activations(kind, self.configs.get(name, {}), Served(width, height, images, extra_tokens=extra_tokens),
                           self.lay, self.items.get(name, 4), measured=True)

    def need(self, width: int, height: int, denoise_images: int, images: int, encode: bool = False,
             references: tuple[tuple[int, int], ...] = (), controls: int = 0) -> MemoryNeed:
        """``controls``: the ControlNet units of the batch (their residuals join the denoiser stage; a ControlNet
        runs before the UNet on the same arena, its activations within the UNet's)."""
        denoiser = next(n for n in self.lay.parts if n in DENOISERS)
        patch = self.lay.factor * 2  # the 2x2-packed latents every instruction-edit family joins
        extra = sum((w // patch) * (h // patch) for w, h in references)
        residuals = request_bytes(self.controlnet, width, height, denoise_images * (2 if self.lay.cfg else 1),
                                  self.factor, self.items.get(denoiser, 4), units=controls) \
            if controls and self.controlnet else 0
        raw = {"text encoder": max(self.stage(n, width, height, images) for n in TEXT_ENCODERS),
               "denoiser": self.stage(denoiser, width, height, denoise_images, extra) + residuals,
               "VAE decode": self.stage("vae_decoder", width, height, images)
               + images * width * height * IMAGE_BUFFER_BYTES}
        if encode or references:  # a request's input images are encoded once each, whatever its image count
            raw["VAE encode"] = max([self.stage("vae_encoder", width, height, images)] * encode
                                    + [self.stage("vae_encoder", w, h, 1) for w, h in references])
        stages = tuple((name, int(value * ARENA_SLACK)) for name, value in raw.items())
        stage, peak = max(stages, key=lambda s: s[1])
        why = self._why(stage, width, height, denoise_images, images, extra)
        if stage == "denoiser" and residuals:
            sets = residual_sets(controls)
            why += f", with {residuals / GIB:.2f} GiB of ControlNet residuals ({sets} set{'s' * (sets > 1)})"
        return MemoryNeed(peak, stage, stages, why)

    def _why(self, stage: str, width: int, height: int, denoise_images: int, images: int, extra: int = 0) -> str:
        factor = self.lay.factor
        latent = (width // factor) * (height // factor)
        if stage in ("VAE decode", "VAE encode"):
            return (f"{images} image(s) through the VAE, whose mid-block attention over {latent} latent pixels "
                    f"holds {latent * latent * 4 / GIB:.2f} GiB of scores per image")
        if stage == "denoiser":
            rows = denoise_images * (2 if self.lay.cfg else 1)
            guided = ", x2 for guidance" if self.lay.cfg else ""
            refs = f" plus {extra} reference tokens of the input images" if extra else ""
            return (f"{rows} denoiser row(s) ({denoise_images} image(s) per call{guided}) at {latent} latent "
                    f"pixels{refs}, its attention scores growing with their square")
        return f"{images} image(s) through the text encoders"


def for_folder(folder: Path) -> RequestMemory | None:
    """The request memory of a model folder from its configs and its files' float types (headers only); None
    when the folder is no family the memory plan knows, or its configs cannot be read (logged)."""
    try:
        lay = layout(folder)
        configs = {name: config(folder, name) for name in lay.parts}
        missing = [name for name in lay.parts if name in DENOISERS + ("vae_decoder",) and not configs[name]]
        if missing:
            raise ModelLoadError(f"no config.json for {', '.join(missing)}")
        probe = Served(64, 64, 1, tensorrt=False)
        parts = {name: component(folder, name, kind, lay, probe, None) for name, kind in lay.parts.items()}
        control = residual_config(folder)
        return RequestMemory(lay, configs, {name: ITEMSIZE.get(c.stored_dtype, 4) for name, c in parts.items()},
                             control)
    except (ModelLoadError, OSError, TypeError, ValueError, KeyError, IndexError) as exc:
        log.warning("no request memory estimate for %s (admission will not refuse on memory): %s", folder, exc)
        return None
