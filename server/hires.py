"""Hires fix as A1111 does it: a first pass at the base size, an upscale, then an img2img pass at the target size.

From AUTOMATIC1111/stable-diffusion-webui:

- ``modules/processing.py`` StableDiffusionProcessingTxt2Img ``calculate_target_resolution`` (the target from
  ``hr_scale`` or ``hr_resize_x/y``, and the truncation when both resize sides are given) and ``sample_hr_pass``:
  a pixel upscaler works on the decoded first-pass images, the upscaled images are encoded again and noised with
  the same seeds, then denoised with ``hr_second_pass_steps`` (0: the first pass's steps) at
  ``denoising_strength``.
- ``modules/sd_samplers_common.py`` ``setup_img2img_steps``: with explicit steps (the hires pass always passes
  them) exactly that many steps run, at the end of a schedule of ``int(steps / min(denoising_strength, 0.999))``.
- ``modules/images.py`` ``resize_image`` (mode 0) with ``modules/upscaler.py`` ``Upscaler.upscale`` and the
  Lanczos/Nearest/None upscalers: the upscaler's own resize to ``scale`` x, a LANCZOS fix-up to multiples of 8,
  then a LANCZOS resize to the exact target.

A1111's latent upscale modes (``modules/shared_items.py`` latent_upscale_modes; "Latent" is its default) take the
first pass's latents (the engine hands them out when asked: ImageSpec.keep_latents), resize them as
``torch.nn.functional.interpolate`` does (bilinear, bicubic, nearest, nearest-exact; align_corners False, no
antialias: the antialiased modes are refused by name), cut the truncation in latent space, and start the second
pass from them instead of encoding pixels. Either way the second pass goes through the edits path
(server/edits.py edit_batch) as any img2img request does. An OpenAI edit at an OpenAI size served through Hires fix
(server/routes/edits.py) runs its edit as the first pass; with a mask, the second pass repaints only under it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image
from starlette.concurrency import run_in_threadpool

from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import Batch, EditImage
from server import headers
from server.admission import Cost, admit
from server.edits import EditInput, edit_batch
from server.errors import QueueFullError
from server.metrics import note_refusal
from server.service import Encoder, Generated, ImageService, encode_png

UPSCALERS: dict[str, Image.Resampling | None] = {"None": None, "Lanczos": Image.Resampling.LANCZOS,
                                                 "Nearest": Image.Resampling.NEAREST}
"""The pixel upscalers offered (A1111's built-in names; GET /sdapi/v1/upscalers): "None" resizes with LANCZOS."""
LATENT_MODES: dict[str, str | None] = {"Latent": "bilinear", "Latent (antialiased)": None,
                                       "Latent (bicubic)": "bicubic", "Latent (bicubic antialiased)": None,
                                       "Latent (nearest)": "nearest", "Latent (nearest-exact)": "nearest-exact"}
"""A1111's latent upscale modes -> torch's interpolate mode (None: antialiased, not served)."""
CUBIC_A = -0.75
"""torch's bicubic convolution coefficient."""
OPT_F = 8
"""A1111's latent factor: truncation and the upscaler's fix-up work in multiples of it."""
MAX_SCHEDULE = 1000
"""The longest schedule the second pass may ask for (steps / denoising_strength)."""


@dataclass(frozen=True)
class HiresPlan:
    """The second pass of one request, fixed before the first runs (admission counts both)."""

    upscale_to: tuple[int, int]
    """What the upscaler makes (A1111's hr_upscale_to_x/y)."""
    box: tuple[int, int, int, int]
    """The part of it the second pass denoises (the truncation of a two-sided resize; the whole image else)."""
    upscaler: str
    steps: int
    """Second-pass steps that run."""
    denoising_strength: float
    infotext: dict[str, Any] = field(default_factory=dict)
    """A1111's extra generation parameters for the infotext (Denoising strength, Hires upscale/resize, ...)."""

    @property
    def latent(self) -> bool:
        """A latent upscale: the first pass hands its latents to the second."""
        return self.upscaler in LATENT_MODES

    @property
    def size(self) -> tuple[int, int]:
        return self.box[2] - self.box[0], self.box[3] - self.box[1]

    @property
    def schedule_steps(self) -> int:
        """setup_img2img_steps: the schedule whose last ``steps`` steps run."""
        return int(self.steps / min(self.denoising_strength, 0.999))

    @property
    def strength(self) -> float:
        """The Batch.strength that runs exactly ``steps`` of ``schedule_steps`` (int(S * strength) == steps)."""
        return min(1.0, (self.steps + 0.5) / self.schedule_steps)


def target_size(width: int, height: int, scale: float, resize_x: int, resize_y: int) -> tuple[int, int, int, int]:
    """(upscale_to_x, upscale_to_y, truncate_x, truncate_y) as A1111's calculate_target_resolution."""
    if resize_x == 0 and resize_y == 0:
        return int(width * scale), int(height * scale), 0, 0
    if resize_y == 0:
        return resize_x, resize_x * height // width, 0, 0
    if resize_x == 0:
        return resize_y * width // height, resize_y, 0, 0
    if width / height < resize_x / resize_y:
        to_x, to_y = resize_x, resize_x * height // width
    else:
        to_x, to_y = resize_y * width // height, resize_y
    return to_x, to_y, (to_x - resize_x) // OPT_F, (to_y - resize_y) // OPT_F


def make_plan(first: Batch, info: ModelInfo, *, scale: float = 2.0, resize: tuple[int, int] = (0, 0),
              upscaler: str | None = None, steps: int = 0, denoising_strength: float | None = None) -> HiresPlan:
    """The second pass for a first pass ``first``; 422 naming the field for what cannot run."""
    name = "Latent" if upscaler is None else upscaler  # A1111's default (latent_upscale_default_mode)
    offered = [*UPSCALERS, *served_latent_modes()]
    if name not in offered:
        why = "torch's antialiased resize is not reproduced" if name in LATENT_MODES else "no such upscaler"
        raise InvalidRequestError(f"hr_upscaler {name[:64]!r} is not served ({why}); available: {offered} "
                                  "(GET /sdapi/v1/upscalers, /sdapi/v1/latent-upscale-modes)", param="hr_upscaler")
    if name in LATENT_MODES and info.inpainting_unet:
        raise InvalidRequestError(f"hr_upscaler {name!r}: a latent upscale on a 9-channel inpainting model is not "
                                  f"served; use one of {list(UPSCALERS)}", param="hr_upscaler")
    if "img2img" not in info.modes:
        raise InvalidRequestError("enable_hr needs the model to serve img2img for its second pass: "
                                  f"{info.edits_unavailable or 'it has no VAE encoder'}", param="enable_hr")
    strength = 0.75 if denoising_strength is None else denoising_strength
    if strength <= 0:
        raise InvalidRequestError("denoising_strength must be above 0 with enable_hr (the second pass would run "
                                  "no step)", param="denoising_strength")
    run = steps or first.steps
    to_x, to_y, trunc_x, trunc_y = target_size(first.width, first.height, scale, *resize)
    box = (trunc_x // 2 * OPT_F, trunc_y // 2 * OPT_F, to_x - (trunc_x + 1) // 2 * OPT_F,
           to_y - (trunc_y + 1) // 2 * OPT_F)
    m = info.size_multiple  # the latents hold whole multiples: the rest of the box is dropped, as A1111's // 8
    box = (box[0], box[1], box[0] + (box[2] - box[0]) // m * m, box[1] + (box[3] - box[1]) // m * m)
    if box[2] <= box[0] or box[3] <= box[1]:
        raise InvalidRequestError(f"Hires fix target {to_x}x{to_y} is smaller than one latent", param="hr_scale")
    extra: dict[str, Any] = {"Denoising strength": f"{strength:g}"}
    extra |= {"Hires upscale": f"{scale:g}"} if resize == (0, 0) else {"Hires resize": f"{resize[0]}x{resize[1]}"}
    extra |= ({"Hires steps": steps} if steps else {}) | ({"Hires upscaler": upscaler} if upscaler else {})
    plan = HiresPlan((to_x, to_y), box, name, run, strength, extra)
    if plan.schedule_steps > MAX_SCHEDULE:
        raise InvalidRequestError(f"denoising_strength {strength:g} with {run} second-pass steps asks for a "
                                  f"{plan.schedule_steps}-step schedule (at most {MAX_SCHEDULE})",
                                  param="denoising_strength")
    return plan


def served_latent_modes() -> list[str]:
    """The latent upscale modes offered (GET /sdapi/v1/latent-upscale-modes)."""
    return [name for name, mode in LATENT_MODES.items() if mode is not None]


def _axis(n_in: int, n_out: int, mode: str) -> np.ndarray:
    """The [n_out, n_in] matrix of torch's 1-D interpolation (align_corners False; scale = n_in / n_out)."""
    scale, weights = n_in / n_out, np.zeros((n_out, n_in), np.float64)
    for d in range(n_out):
        if mode in ("nearest", "nearest-exact"):
            src = math.floor((d + (0.5 if mode == "nearest-exact" else 0.0)) * scale)
            weights[d, min(src, n_in - 1)] = 1.0
            continue
        src_f = scale * (d + 0.5) - 0.5
        if mode == "bilinear":
            src_f = max(src_f, 0.0)
            i, t = int(src_f), src_f - int(src_f)
            weights[d, i] += 1.0 - t
            weights[d, min(i + 1, n_in - 1)] += t
            continue
        i, t = math.floor(src_f), src_f - math.floor(src_f)
        for k, w in zip(range(i - 1, i + 3), _cubic(t), strict=True):
            weights[d, min(max(k, 0), n_in - 1)] += w
    return weights


def _cubic(t: float) -> tuple[float, float, float, float]:
    """torch's cubic convolution weights of the four taps around a point ``t`` past the second."""
    a = CUBIC_A
    w0 = ((a * (t + 1) - 5 * a) * (t + 1) + 8 * a) * (t + 1) - 4 * a
    w1 = ((a + 2) * t - (a + 3)) * t * t + 1
    w2 = ((a + 2) * (1 - t) - (a + 3)) * (1 - t) * (1 - t) + 1
    w3 = ((a * (2 - t) - 5 * a) * (2 - t) + 8 * a) * (2 - t) - 4 * a
    return w0, w1, w2, w3


def upscale_latents(latents: np.ndarray, height: int, width: int, mode: str) -> np.ndarray:
    """[C, h, w] latents resized to [C, height, width] as torch.nn.functional.interpolate(mode, no antialias)."""
    rows = _axis(latents.shape[1], height, mode)
    cols = _axis(latents.shape[2], width, mode)
    out: np.ndarray = np.einsum("hy,cyx,wx->chw", rows, latents.astype(np.float64), cols)
    return out.astype(np.float32)


def upscale(image: Image.Image, upscaler: str, width: int, height: int) -> Image.Image:
    """resize_image(0, image, width, height, upscaler_name) with a built-in upscaler."""
    resample = UPSCALERS[upscaler]
    scale = max(width / image.width, height / image.height)
    if resample is not None and scale > 1.0:
        dest = (int(image.width * scale // OPT_F * OPT_F), int(image.height * scale // OPT_F * OPT_F))
        for attempt in range(3):  # Upscaler.upscale: the upscaler's own resize until it reaches dest
            if image.width >= dest[0] and image.height >= dest[1] and (attempt > 0 or scale != 1):
                break
            before = image.size
            image = image.resize((int(image.width * scale), int(image.height * scale)), resample)
            if before == image.size:
                break
        if image.size != dest:
            image = image.resize(dest, Image.Resampling.LANCZOS)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    return image


def second_pass(first: Batch, images: list[Image.Image], plan: HiresPlan, info: ModelInfo,
                latents: list[np.ndarray | None] | None = None) -> Batch:
    """The img2img batch of the second pass: each first-pass image (or, for a latent upscale, its latents)
    upscaled and cut to the box, same seeds and prompts, ``plan.steps`` steps at the end of the schedule."""
    width, height = plan.size
    base = replace(first, width=width, height=height, steps=plan.schedule_steps,
                   images=tuple(replace(s, keep_latents=False) for s in first.images))
    if not plan.latent:
        up = tuple(upscale(im.convert("RGB"), plan.upscaler, *plan.upscale_to).crop(plan.box) for im in images)
        return edit_batch(base, EditInput(up, _mask(first, plan), plan.strength, 0, overlay=True), info,
                          plan.strength)
    if latents is None or any(x is None for x in latents):
        raise InvalidRequestError(f"hr_upscaler {plan.upscaler!r}: the engine returned no latents for the first "
                                  f"pass; use one of {list(UPSCALERS)}", param="hr_upscaler")
    mode = LATENT_MODES[plan.upscaler] or "bilinear"
    x0, y0, x1, y1 = (v // OPT_F for v in plan.box)
    cut = [upscale_latents(x, plan.upscale_to[1] // OPT_F, plan.upscale_to[0] // OPT_F, mode)[:, y0:y1, x0:x1]
           for x in latents if x is not None]
    batch = edit_batch(base, EditInput((Image.new("RGB", (width, height)),), None, plan.strength, 0),
                       info, plan.strength)  # validates the edit; the pixels are never encoded
    specs = tuple(replace(s, edit=EditImage(s.edit.image, latents=cut[i])) if s.edit is not None else s
                  for i, s in enumerate(batch.images))
    return replace(batch, images=specs)


def _mask(first: Batch, plan: HiresPlan) -> Image.Image | None:
    """An inpainting first pass's mask at the second pass's size (an OpenAI edit with a mask served through Hires
    fix: the second pass repaints only where the first did); None for a txt2img or img2img first pass."""
    edit = first.images[0].edit
    if edit is None or edit.mask is None:
        return None
    return Image.fromarray(edit.mask).resize(plan.upscale_to, Image.Resampling.LANCZOS).crop(plan.box)


def costs(batches: list[Batch], plan: HiresPlan) -> list[Cost]:
    """What admission counts: each first pass, and each second pass at its size and the steps that run."""
    width, height = plan.size
    return [Cost(b.width, b.height, b.steps, len(b.images)) for b in batches] + \
        [Cost(width, height, plan.steps, len(b.images)) for b in batches]


async def run_hires(service: ImageService, batches: list[Batch], plan: HiresPlan, timeout: str | None,
                    disconnected: Callable[[], Awaitable[bool]], owner: str | None,
                    encode: Encoder = encode_png) -> list[Generated]:
    """Both passes under one deadline, admitted on their total cost before the first runs. An interrupted first
    pass answers with its images (A1111 skips the second pass then)."""
    deadline = service.deadline(timeout)
    service.admit_memory(batches, plan.size, not plan.latent,  # the second pass, before the first runs
                         "hr_scale" if "Hires upscale" in plan.infotext else "size")
    source = headers.TIMEOUT if timeout is not None else "queue.request_timeout_s"
    both = costs(batches, plan)
    try:  # the wait priced as the step policy ranks this tenant's request (issue 52: not the whole queue)
        admit(service.cost, both, service.batcher.ahead_seconds(both, owner), deadline - time.monotonic(), source)
    except Exception as exc:
        service.metrics.refused.labels("over_deadline").inc()
        if isinstance(exc, QueueFullError):
            note_refusal("estimated_wait")
        raise
    if plan.latent:  # the first pass hands its latents to the second
        batches = [replace(b, images=tuple(replace(s, keep_latents=True) for s in b.images)) for b in batches]
    firsts = await service.run_all(batches, timeout, disconnected, owner, encode)
    if any(out.result.interrupted for out in firsts):
        return firsts
    info = service.engine.info
    seconds = [await run_in_threadpool(second_pass, b, [g.image for g in out.result.images], plan, info,
                                       [g.latents for g in out.result.images])
               for b, out in zip(batches, firsts, strict=True)]
    left = max(deadline - time.monotonic(), 0.001)
    return await service.run_all(seconds, f"{left:.3f}", disconnected, owner, encode)
