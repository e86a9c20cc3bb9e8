"""What a request asks of the engine and what it answers: the images of a batch, their edit inputs, the batch's
LoRA set and step cache, and the result with its timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image

LatentFill = Literal["original", "noise", "nothing"]


@dataclass(frozen=True, eq=False)
class EditImage:
    """One image's edit input, already at the batch's width and height (server/images_in.py decodes, orients and
    resizes uploads). Compared by identity: it holds arrays."""

    image: np.ndarray
    """uint8 [H, W, 3] RGB."""
    mask: np.ndarray | None = None
    """uint8 [H, W]: where to repaint, as diffusers' mask (binarized at 0.5: >= 128 repaints; the output blends
    the repainted pixels in by mask/255 where ``Batch.overlay``); None: img2img."""
    fill: LatentFill = "original"
    """Inpainting: what the masked part of the init latents starts from (A1111's inpainting_fill 2 and 3, done
    in modules/processing.py StableDiffusionProcessingImg2Img.init): "original" the encoded image, "noise" the
    image's own seeded start noise (latent noise), "nothing" zeros (latent nothing)."""
    latents: np.ndarray | None = None
    """float32 [C, h, w]: init latents as the denoiser sees them (scaled), used instead of encoding ``image``
    (Hires fix's latent upscale, A1111's latent_scale_mode); None: ``image`` is encoded."""
    references: tuple[np.ndarray, ...] = ()
    """Instruction edits (ModelInfo.instruct_images > 0, no mask): every input image as sent, uint8 [h, w, 3] RGB
    at its own size (decoded, oriented and bounded as uploads are). The model conditions on them (reference latents,
    a vision tower) as its diffusers pipeline does and starts from noise; ``image`` is then the first of them at the
    batch's size, kept for the overlay-free result and provenance. Empty: img2img or inpainting."""


@dataclass(frozen=True)
class ImageSpec:
    """One image to generate; per-image settings may differ inside a batch."""

    prompt: str
    negative_prompt: str = ""
    seed: int = 0
    guidance_scale: float = 7.5
    edit: EditImage | None = None
    """img2img (no mask) or inpainting input; None: txt2img. Every image of a batch has the same mode."""
    keep_latents: bool = False
    """Return this image's final latents (GeneratedImage.latents): a Hires fix first pass with a latent upscale."""


Mode = Literal["txt2img", "img2img", "inpaint", "instruct"]


CACHE_METHODS = ("output", "first-block")
"""Step cache methods: ``output`` reuses the denoiser's last output for every family (engines/pipelines/
step_cache.py); ``first-block`` runs the DiT transformer's first block and skips the rest (first_block.py)."""


CACHE_MIN_STEPS = 9
"""A cache never runs on a request with fewer steps: few-step models (Turbo, schnell) gain nothing and every
evaluation counts."""


@dataclass(frozen=True)
class StepCache:
    """A request's step cache (off unless the server's policy or the request turns it on, and only after the gate
    passed for this model and shape). Images under a cache are no longer the seed-reproducible uncached images."""

    method: str = "output"
    threshold: float = 0.2
    """``output``: the accumulated estimate of the output's relative change (EasyCache's rule) under which the last
    output is reused; ``first-block``: the first block's relative residual change (diffusers' hook)."""
    warmup: float = 0.15
    """The first fraction of evaluations always computed (ComfyUI's EasyCache ``start_percent``)."""
    final: float = 0.05
    """The last fraction of evaluations always computed (at least one)."""
    max_reuse: int = 3
    """Consecutive evaluations that may reuse before one is computed."""

    def label(self) -> str:
        """How a response, infotext and manifest name it: ``output:0.2``."""
        return f"{self.method}:{self.threshold:g}"


@dataclass(frozen=True)
class CacheUse:
    """What a step cache did for one request: its configuration and the denoiser evaluations it reused."""

    spec: StepCache
    reused: int
    evaluations: int


@dataclass(frozen=True)
class LoraUse:
    """One LoRA of a request's adapter set, resolved against the library (the server checks names first)."""

    name: str
    sha256: str
    te: float = 1.0
    """Multiplier on the text encoders (A1111's te_multiplier)."""
    unet: float = 1.0
    """Multiplier on the denoiser, UNet or DiT transformer (A1111's unet_multiplier)."""

    def label(self) -> str:
        """``name:te:unet`` (``name:mult`` when both are equal), as ``<lora:...>`` writes it."""
        return f"{self.name}:{self.te:g}" + ("" if self.te == self.unet else f":{self.unet:g}")


def lora_key(uses: tuple[LoraUse, ...]) -> tuple[tuple[str, float, float], ...]:
    """An adapter set's cache and batching key: sorted (file sha256, te multiplier, denoiser multiplier)."""
    return tuple(sorted((u.sha256, u.te, u.unet) for u in uses))


@dataclass(frozen=True, eq=False)
class ControlUnit:
    """One ControlNet unit of a request (diffusers' multi-ControlNet: the units' residuals are summed). Compared by
    identity: it holds an array."""

    image: np.ndarray
    """The control image, uint8 [H, W, 3] (already preprocessed: canny edges, ...); resized to the output size."""
    model: str
    """The ControlNet's name in the server's ControlNet folder."""
    weight: float = 1.0
    """diffusers' ``controlnet_conditioning_scale`` (A1111's ``weight``)."""
    guidance_start: float = 0.0
    """Fraction of the steps before which the unit is inactive (diffusers' ``control_guidance_start``)."""
    guidance_end: float = 1.0
    """Fraction of the steps after which the unit is inactive (diffusers' ``control_guidance_end``)."""
    union_mode: int | None = None
    """A union ControlNet's control type for this unit (InstantX FLUX.1 Union: canny 0, tile 1, depth 2, blur 3, pose
    4, gray 5, low quality 6), from the unit's preprocessor; None: 0. A single-type ControlNet ignores it."""
    hint_mask: np.ndarray | None = None
    """Inpaint units: bool [H, W] at ``image``'s size, True where the hint is masked: those pixels are -1 in the
    control image (diffusers' ``make_inpaint_condition``, sd-webui-controlnet's inpaint hint); None: a plain hint."""
    inpaint: Literal["", "global", "only"] = ""
    """An inpaint unit: "global" (inpaint_global_harmonious) or "only" (inpaint_only: served where the pipeline
    blends the unmasked area back, inpainting); "": not one. Served on SD 1.x/2.x and SDXL UNets only."""
    from_init: Callable[[np.ndarray], np.ndarray] | None = None
    """The unit sent no image: it takes the request's init image (img2img; sd-webui-controlnet's
    ``choose_input_image``), uint8 [H, W, 3] at the batch's size, through this preprocessor; an inpaint unit without
    its own mask then takes the request's mask. ``image`` is then empty; a txt2img batch refuses the unit."""
    field: str = "controlnet"
    """The request field that sent the unit: what the pipeline's refusals name (``<field>.image``, ...)."""


def control_key(units: tuple[ControlUnit, ...]) -> tuple[str, ...]:
    """A control set's batching key: the ControlNets it runs, in order (rows join only runs with the same ones)."""
    return tuple(u.model for u in units)


@dataclass(frozen=True)
class Batch:
    """Images that share shape, step count and scheduler, so they run as one batch."""

    images: tuple[ImageSpec, ...]
    width: int = 64
    height: int = 64
    steps: int = 20
    scheduler: str = "euler"
    truncate_prompts: bool = True
    """Over-long prompts: truncate (reported per image) or refuse with InvalidRequestError (tokenized once)."""
    original_size: tuple[int, int] | None = None
    """SDXL micro-conditioning: the (height, width) the image claims to come from; None = the target size."""
    crops_coords_top_left: tuple[int, int] = (0, 0)
    """SDXL micro-conditioning: the (top, left) crop it claims; (0, 0) as diffusers."""
    strength: float = 1.0
    """Edits: diffusers' ``strength`` in (0, 1]: ``int(steps * strength)`` steps run, from the noise level where
    the full schedule would be after the others (``get_timesteps``). txt2img ignores it."""
    overlay: bool = True
    """Inpainting: paste the init image back outside the mask (as A1111 does; diffusers does not): pixels the
    mask leaves (mask 0) come back exactly as sent."""
    loras: tuple[LoraUse, ...] = ()
    """The adapter set: requests batch together only with the same set (engines/lora/manager.py set_key)."""
    cache: StepCache | None = None
    """The request's step cache (None: every denoiser evaluation runs)."""
    control: tuple[ControlUnit, ...] = ()
    """ControlNet units (SD 1.x/2.x UNets with a ControlNet library); () runs the plain UNet."""

    @property
    def lora_key(self) -> tuple[tuple[str, float, float], ...]:
        """What makes two requests' LoRA weights the same (``lora_key``)."""
        return lora_key(self.loras)

    @property
    def mode(self) -> Mode:
        """txt2img, img2img or inpaint, from the first image (check_inputs refuses mixed batches)."""
        edit = self.images[0].edit if self.images else None
        if edit is not None and edit.references:
            return "instruct"
        return "txt2img" if edit is None else "img2img" if edit.mask is None else "inpaint"


@dataclass(frozen=True)
class GeneratedImage:
    image: Image.Image
    seed: int
    prompt_truncated: bool = False
    negative_prompt_truncated: bool = False
    latents: np.ndarray | None = None
    """float32 [C, h, w] final latents (scaled), when the image asked for them (ImageSpec.keep_latents)."""


@dataclass(frozen=True)
class Timings:
    """Seconds per phase of one executed batch."""

    text_encoder: float = 0.0
    denoise: float = 0.0
    vae_decode: float = 0.0
    total: float = 0.0
    vae_encode: float = 0.0
    """Edits: encoding the init (and masked) images on the device."""


StepHook = Callable[[int, int], bool]
"""Called after each denoising step with (steps done, steps in total); returning False stops the batch at this step
boundary: the images are decoded from the latents so far (A1111's interrupt)."""


@dataclass(frozen=True)
class BatchResult:
    images: tuple[GeneratedImage, ...]
    provider: str
    """The execution provider that ran the UNet."""
    timings: Timings = Timings()
    batch_images: int = 0
    """Images in the batch that actually executed (micro-batching may merge requests; step-level batching: the most
    images any denoiser call of this request ran with); 0 = len(images)."""
    steps_done: int = 0
    """Denoising steps that ran; fewer than the batch's steps when a StepHook stopped it."""
    interrupted: bool = False
    adapted: tuple[str, ...] = ()
    """The components that ran with the batch's merged LoRA weights bound (sorted); empty without LoRA."""
    first_step_s: float = 0.0
    """Seconds from the request's arrival in the queue to the end of its first denoiser evaluation (the server's
    batcher sets it; 0 from the engine)."""
    cache: CacheUse | None = None
    """The step cache that ran (its evaluations reused), None when every evaluation was computed."""

    @property
    def executed(self) -> int:
        return self.batch_images or len(self.images)
