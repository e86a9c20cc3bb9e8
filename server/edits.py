"""Edit requests -> engine batches: the decoded images resized to the batch's size, the mask, the strength.

The routes (server/routes/edits.py for OpenAI, server/routes/a1111_img2img.py for A1111) decode uploads with
server/images_in.py and build the txt2img batch for the other fields (their request mapped to the core's
server/generation.py GenerationRequest, then ImageService.to_batches: size, steps, seeds, scheduler, limits); this
adds what makes it an edit and validates it against what the model serves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import Batch, EditImage, LatentFill
from server.errors import DeadlineExceededError
from server.images_in import ResizeMode, resize

T = TypeVar("T")


@dataclass(frozen=True)
class EditInput:
    """Decoded edit inputs: one image per output image (cycled), an optional L mask (255 repaints)."""

    images: tuple[Image.Image, ...]
    mask: Image.Image | None = None
    strength: float | None = None
    """None: the profile's default (img2img) or 1.0 (with a mask, as diffusers' inpainting)."""
    resize_mode: ResizeMode = 1
    overlay: bool = True
    fill: LatentFill = "original"
    """With a mask: what the masked init latents start from (A1111's inpainting_fill 2 "noise", 3 "nothing")."""
    instruct: bool = False
    """An instruction edit (``is_instruct``): every image conditions every output image (EditImage.references),
    the first, resized to the batch's size, is ``EditImage.image``; no mask, no strength."""


def is_instruct(info: ModelInfo, images: int, masks: int, image_field: str = "image") -> bool:
    """Whether an edit of ``images`` input images and ``masks`` masks is an instruction edit (a model with
    ModelInfo.instruct_images, no mask); 400 naming the field for what the model cannot take: more images than it
    takes, a mask on a model that cannot inpaint. Several images on a model that is not an instruction-edit model
    are the route's to judge (OpenAI edits take one; A1111's init_images cycle over the batch)."""
    if images < 1:
        more = f" (this model takes up to {info.instruct_images})" if info.instruct_images > 1 else ""
        raise InvalidRequestError(f"send one image (got 0){more}", param=image_field)
    if masks > 1:
        raise InvalidRequestError(f"send at most one mask (got {masks})", param="mask")
    if masks and info.instruct_images and "inpaint" not in info.modes:
        raise InvalidRequestError(f"this model ({info.name}) edits by instruction and cannot inpaint: send no mask "
                                  "and say in the prompt what to change", param="mask")
    instruct = info.instruct_images > 0 and not masks
    if instruct and images > info.instruct_images:
        raise InvalidRequestError(f"this model ({info.name}) takes at most {info.instruct_images} input images per "
                                  f"edit (got {images})", param=image_field)
    return instruct


def instruct_size(info: ModelInfo, sizes: list[tuple[int, int]]) -> tuple[int, int] | None:
    """An instruction edit's output (width, height) when the request names none (or ``auto``): the model's
    diffusers rule on the input images' sizes (ModelInfo.instruct_size); None: the batch's default size."""
    return info.instruct_size(tuple(sizes)) if info.instruct_size is not None else None


def require_edits(info: ModelInfo) -> None:
    """400 naming why when the served model cannot edit (a folder exported without the VAE encoder)."""
    if "img2img" not in info.modes:
        raise InvalidRequestError(f"this server's model serves txt2img only: "
                                  f"{info.edits_unavailable or 'it has no VAE encoder'}", param="image")


def edit_batch(batch: Batch, edit: EditInput, info: ModelInfo, default_strength: float) -> Batch:
    """``batch`` (validated as txt2img) with the edit inputs resized to its size; refuses what the model cannot
    edit, naming the field."""
    require_edits(info)
    if edit.instruct:
        return _instruct_batch(batch, edit, info)
    if batch.scheduler not in info.edit_schedulers:
        raise InvalidRequestError(f"scheduler {batch.scheduler!r} does not serve edits (img2img, inpainting); use "
                                  f"one of {list(info.edit_schedulers)}", param="scheduler")
    strength = edit.strength if edit.strength is not None else 1.0 if edit.mask is not None else default_strength
    if not 0.0 < strength <= 1.0:
        raise InvalidRequestError(f"strength {strength} must be in (0, 1]", param="strength")
    if int(batch.steps * strength) < 1:
        raise InvalidRequestError(f"strength {strength} x {batch.steps} steps runs no denoising step: raise "
                                  "strength or steps", param="strength")
    size = (batch.width, batch.height)
    pixels = [np.asarray(resize(im.convert("RGB"), *size, edit.resize_mode)) for im in edit.images]
    mask = None if edit.mask is None else np.asarray(resize(edit.mask.convert("L"), *size, edit.resize_mode))
    if mask is not None and not mask.any():
        raise InvalidRequestError("mask marks nothing to repaint (no white, or no transparent, pixels)",
                                  param="mask")
    fill = edit.fill if mask is not None else "original"
    specs = tuple(replace(spec, edit=EditImage(np.ascontiguousarray(pixels[i % len(pixels)]), mask, fill))
                  for i, spec in enumerate(batch.images))
    return replace(batch, images=specs, strength=strength, overlay=edit.overlay)


def _instruct_batch(batch: Batch, edit: EditInput, info: ModelInfo) -> Batch:
    """An instruction edit: every image of the batch conditions on all the input images at their own sizes (the
    model resizes them as its diffusers pipeline does) and starts from noise (strength 1)."""
    if batch.scheduler not in info.edit_schedulers:
        raise InvalidRequestError(f"scheduler {batch.scheduler!r} does not serve instruction edits; use one of "
                                  f"{list(info.edit_schedulers)}", param="scheduler")
    references = tuple(np.ascontiguousarray(np.asarray(im.convert("RGB"))) for im in edit.images)
    first = np.ascontiguousarray(np.asarray(resize(edit.images[0].convert("RGB"), batch.width, batch.height,
                                                   edit.resize_mode)))
    specs = tuple(replace(spec, edit=EditImage(first, None, "original", references=references))
                  for spec in batch.images)
    return replace(batch, images=specs, strength=1.0, overlay=False)


def instruct_shape(batch: Batch, sizes: list[tuple[int, int]]) -> Batch:
    """The batch an instruction edit will be, as admission prices it before any pixel is decoded: each image an
    edit whose references have the inputs' declared sizes (zero-copy arrays of zeros: nothing is allocated), so
    admission counts the VAE encode and whatever the model's memory estimate takes from the references."""
    zero = np.zeros((1, 1, 3), np.uint8)
    references = tuple(np.broadcast_to(zero, (h, w, 3)) for w, h in sizes)
    edit = EditImage(np.broadcast_to(zero, (batch.height, batch.width, 3)), references=references)
    return replace(batch, images=tuple(replace(spec, edit=edit) for spec in batch.images), strength=1.0)


async def within_deadline(deadline: float, call: Callable[..., T], *args: object) -> T:
    """``call(*args)`` (decoding uploads) in the threadpool under the request's deadline: 504 when it passes
    first, so a client that set a deadline is answered on time. The thread finishes the image it holds (bounded by
    the pixel, scan and per-request budgets) and its result is dropped."""
    from starlette.concurrency import run_in_threadpool

    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceededError("the request's deadline passed before its images were decoded")
    try:
        return await asyncio.wait_for(run_in_threadpool(call, *args), remaining)
    except TimeoutError:
        raise DeadlineExceededError(f"the request's deadline passed while its images were decoded "
                                    f"({remaining:.1f}s were left)") from None
