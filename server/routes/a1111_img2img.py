"""AUTOMATIC1111-compatible POST /sdapi/v1/img2img, as webuiapi and chaiNNer send it.

``init_images`` (base64, with or without a data-URL prefix; image i of the batch uses init_images[i % len]),
``denoising_strength``, ``mask`` (white repaints; an RGBA mask with transparency: its opaque pixels repaint, as
A1111's create_binary_mask), ``resize_mode`` 0 just resize / 1 crop and resize / 2 resize and fill (3, latent
upscale, is refused), ``mask_blur`` (a Gaussian blur of the mask), ``inpainting_mask_invert``, ``inpainting_fill``
0 fill / 1 original / 2 latent noise / 3 latent nothing (the masked init latents start from the image's seeded
noise or from zeros, as A1111's StableDiffusionProcessingImg2Img.init; what openOutpaint's outpainting sends),
``inpaint_full_res`` + padding ("only masked": the mask's region, padded and grown to the output's aspect, is
inpainted at the output size and pasted back into the whole image, which keeps its size),
``include_init_images``. ``image_cfg_scale`` is an instruct-pix2pix setting A1111 ignores for every other model:
any value is accepted and named as ignored (x-sdserve-ignored-fields), as are the Hires fix fields (A1111's img2img
has none). Each PNG carries its infotext (server/images.py). Progress and interrupt work as for txt2img (same
queue and batcher). Errors are 422 like the other A1111 routes.
"""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

from fastapi import APIRouter, Request, Response
from PIL import Image, ImageOps
from pydantic import Field
from starlette.concurrency import run_in_threadpool

import engines.families as families
from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from engines.types.request import LatentFill
from server import headers
from server.a1111_request import HIRES_FIELDS, Txt2ImgRequest, from_a1111
from server.edits import (
    EditInput,
    edit_batch,
    instruct_shape,
    instruct_size,
    is_instruct,
    require_edits,
    within_deadline,
)
from server.images_in import (
    blur_mask,
    check_pixel_budget,
    declared_size,
    decoding_for,
    fill_masked,
    from_base64,
    from_base64_bytes,
    resize,
)
from server.middleware import tenant_label
from server.provenance_stage import ingredient, record_inputs, stamp_a1111
from server.routes.a1111 import (
    Txt2ImgResponse,
    check_common,
    ignored_headers,
    resolve_sampler,
    sampler_label,
    with_controlnet,
    with_infotexts,
)
from server.routes.a1111_infotext import image_params, infotext
from server.schemas import Text, error_responses
from server.service import b64, encode_png

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])
FILLS: dict[int, tuple[LatentFill, str]] = {0: ("original", "fill"), 1: ("original", "original"),
                                            2: ("noise", "latent noise"), 3: ("nothing", "latent nothing")}
"""inpainting_fill -> (what the masked init latents start from, A1111's "Masked content" infotext label); 0 also
fills the masked pixels before encoding (server/images_in.py fill_masked)."""


class Img2ImgRequest(Txt2ImgRequest):
    """The A1111 img2img fields sdserve honours (and txt2img's); the prompt may be empty."""

    prompt: Text = ""
    init_images: list[str] = Field(..., min_length=1, max_length=16)
    denoising_strength: float = Field(0.75, ge=0.0, le=1.0)
    mask: str | None = None
    resize_mode: int = Field(0, ge=0, le=3)
    mask_blur: int = Field(4, ge=0, le=64)
    inpainting_fill: int = Field(0, ge=0, le=3)
    inpaint_full_res: bool = True
    inpaint_full_res_padding: int = Field(0, ge=0, le=1024)
    inpainting_mask_invert: int = Field(0, ge=0, le=1)
    initial_noise_multiplier: float | None = None
    image_cfg_scale: float | None = None
    include_init_images: bool = False

    def refuse_unsupported_edits(self) -> None:
        if self.resize_mode == 3:
            raise InvalidRequestError("resize_mode 3 (just resize, latent upscale) is not supported: use 0, 1 or 2",
                                      param="resize_mode")
        if self.initial_noise_multiplier not in (None, 1.0):
            raise InvalidRequestError("initial_noise_multiplier other than 1 is not supported",
                                      param="initial_noise_multiplier")

    def ignored(self, distilled: bool = False, instruct: bool = False) -> dict[str, str]:
        found = dict.fromkeys(self.model_extra or {}, "not used by sdserve")
        if instruct and "denoising_strength" in self.model_fields_set:
            found["denoising_strength"] = ("an instruction edit starts from noise and conditions on init_images; "
                                           "the prompt says what to change")
        if self.styles:
            found["styles"] = f"{self.styles[:4]!r} is the no-style choice"
        found |= dict.fromkeys(sorted((HIRES_FIELDS - {"denoising_strength"} | {"enable_hr"}) & self.model_fields_set),
                               "A1111's img2img has no Hires fix")
        if self.image_cfg_scale is not None:
            found["image_cfg_scale"] = "applies to instruct-pix2pix models only (A1111 ignores it for others)"
        return found | self.common_ignored(distilled)


def _a1111_mask(image: Image.Image, invert: int, blur: int) -> Image.Image:
    """A1111's create_binary_mask (an RGBA mask with transparency: alpha > 128 repaints; else luminance), then
    the inversion and the blur."""
    if image.mode == "RGBA" and image.getchannel("A").getextrema() != (255, 255):
        mask = image.getchannel("A").point(lambda v: 255 if v > 128 else 0)
    else:
        mask = image.convert("L")
    return blur_mask(ImageOps.invert(mask) if invert else mask, blur)


def _flatten(image: Image.Image) -> Image.Image:
    """A1111 flattens transparency onto its img2img background colour (white by default)."""
    if image.mode != "RGBA":
        return image.convert("RGB")
    return Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)), image).convert("RGB")


def crop_region(mask: Image.Image, padding: int, width: int, height: int) -> tuple[int, int, int, int]:
    """"Only masked": the mask's bounding box, padded, grown to the output's aspect ratio within the image."""
    box = mask.getbbox()
    if box is None:
        raise InvalidRequestError("mask marks nothing to repaint", param="mask")
    x1, y1 = max(box[0] - padding, 0), max(box[1] - padding, 0)
    x2, y2 = min(box[2] + padding, mask.width), min(box[3] + padding, mask.height)
    ratio = width / height
    if (x2 - x1) / (y2 - y1) < ratio:
        x1, x2 = _grow(x1, x2, round((y2 - y1) * ratio), mask.width)
    else:
        y1, y2 = _grow(y1, y2, round((x2 - x1) / ratio), mask.height)
    return x1, y1, x2, y2


def _grow(lo: int, hi: int, size: int, limit: int) -> tuple[int, int]:
    size = min(size, limit)
    lo = max(0, min(lo - (size - (hi - lo)) // 2, limit - size))
    return lo, lo + size


def _decode(req: Img2ImgRequest, limit: int) -> tuple[list[Image.Image], Image.Image | None]:
    images = [_flatten(from_base64(t, f"init_images.{i}", limit)) for i, t in enumerate(req.init_images)]
    if req.mask is None:
        return images, None
    mask = _a1111_mask(from_base64(req.mask, "mask", limit), req.inpainting_mask_invert, req.mask_blur)
    if mask.size != images[0].size:  # A1111 resizes the mask like the image
        mask = mask.resize(images[0].size, Image.Resampling.LANCZOS)
    if req.inpainting_fill == 0:  # fill: the masked pixels painted over before encoding (2 and 3 act on latents)
        images = [fill_masked(im, resize(mask, *im.size, 0)) for im in images]
    return images, mask


def _ingredients(req: Img2ImgRequest, instruct: bool) -> list[list[dict[str, Any]]]:
    """The C2PA ingredients of each image of a batch (server/provenance_stage.py record_inputs): image i edits
    init_images[i % len] (parentOf); an instruction edit's images all have init_images.0 as parent and the others
    as components; the mask is an input to the model."""
    sent = [from_base64_bytes(t, f"init_images.{i}") for i, t in enumerate(req.init_images)]
    mask = [ingredient(from_base64_bytes(req.mask, "mask"), "mask", "inputTo")] if req.mask is not None else []
    titles = [f"init_images.{i}" for i in range(len(sent))]
    if instruct:
        return [[ingredient(data, title, "parentOf" if i == 0 else "componentOf")
                 for i, (title, data) in enumerate(zip(titles, sent, strict=True))]]
    return [[ingredient(data, title, "parentOf"), *mask] for title, data in zip(titles, sent, strict=True)]


def _paste_full_res(png: bytes, whole: Image.Image, mask: Image.Image, box: tuple[int, int, int, int]) -> bytes:
    """"Only masked": the inpainted crop, resized back, pasted into the whole image through the mask."""
    crop = Image.open(io.BytesIO(png)).convert("RGB").resize((box[2] - box[0], box[3] - box[1]),
                                                            Image.Resampling.LANCZOS)
    out = whole.copy()
    out.paste(crop, box[:2], mask.crop(box))
    return encode_png(out)


@router.post("/img2img", response_model=Txt2ImgResponse,
             responses=error_responses(400, 401, 413, 422, 429, 500, 503, 504, validation=True))
async def img2img(req: Img2ImgRequest, request: Request, response: Response) -> Txt2ImgResponse:
    """img2img, or inpainting with ``mask``: batch_size images per iteration, n_iter iterations, seed + i."""
    service = request.app.state.service
    service.require_ready()
    info = request.app.state.engine.info
    require_edits(info)
    settings = request.app.state.settings
    check_common(req, info, settings)
    req.refuse_unsupported_edits()
    name = req.sampler_name or req.sampler_index
    scheduler = resolve_sampler(name, req.scheduler, served=info.edit_schedulers) if name else None
    instruct = is_instruct(info, len(req.init_images), int(req.mask is not None), "init_images")
    uploads = [*((f"init_images.{i}", t) for i, t in enumerate(req.init_images)), ("mask", req.mask)]
    await run_in_threadpool(check_pixel_budget, uploads, settings.limits.max_image_pixels,
                            settings.limits.max_request_pixels)  # headers only, before any pixel is decoded
    sizes = [await run_in_threadpool(declared_size, t, f"init_images.{i}", settings.limits.max_image_pixels)
             for i, t in enumerate(req.init_images)] if instruct else []
    if instruct and not {"width", "height"} & req.model_fields_set:  # the model's rule on the inputs' sizes
        size = instruct_size(info, sizes)
        req = req if size is None else req.model_copy(update={"width": size[0], "height": size[1]})
    batches = service.to_batches(from_a1111(req, info, scheduler))
    # admitted on the batches' estimated cost before any pixel is decoded; decoding runs under the deadline
    deadline = service.preadmit([instruct_shape(b, sizes) for b in batches] if instruct else batches,
                                request.headers.get(headers.TIMEOUT))
    with decoding_for(tenant_label(request.scope)):  # the decoders are shared fairly across tenants
        images, mask = await within_deadline(deadline, _decode, req, settings.limits.max_image_pixels)
    first = batches[0]
    box = crop_region(mask, req.inpaint_full_res_padding, first.width, first.height) \
        if mask is not None and req.inpaint_full_res else None
    crops = [im.crop(box) for im in images] if box else images
    edit = EditInput(tuple(crops), mask.crop(box) if box and mask else mask, req.denoising_strength,
                     2 if box else req.resize_mode, overlay=True,  # type: ignore[arg-type]
                     fill=FILLS[req.inpainting_fill][0], instruct=instruct)
    batches = [edit_batch(b, edit, info, req.denoising_strength) for b in batches]
    record_inputs(request, await run_in_threadpool(_ingredients, req, instruct))
    batches, control = await with_controlnet(req, batches, request)  # alwayson_scripts.controlnet's units
    outs = await asyncio.gather(*(service.run(b, request.headers.get(headers.TIMEOUT),
                                              request.is_disconnected, tenant_label(request.scope)) for b in batches))
    outs[-1].trace_headers(response)
    response.headers[headers.MODE] = batches[0].mode
    ignored = req.ignored(families.facts(info.family).distilled_guidance, instruct)
    warnings = outs[0].warnings + ignored_headers(response, ignored)
    pngs = [p for out in outs for p in out.pngs]
    if box is not None and mask is not None:
        pngs = [await run_in_threadpool(_paste_full_res, p, images[k % len(images)], mask, box)
                for k, p in enumerate(pngs)]
    request.app.state.metrics.images_by_mode.labels(request.url.path, batches[0].mode).inc(len(pngs))
    body = _info(req, batches, outs, info, warnings, control)
    pngs = with_infotexts(pngs, body["infotexts"], settings)
    pngs = await stamp_a1111(request, response, list(outs), batches, pngs)  # provenance: last, signs final bytes
    return Txt2ImgResponse(images=[b64(p) for p in pngs], parameters=_parameters(req, set(ignored)),
                           info=json.dumps(body))


def _parameters(req: Img2ImgRequest, ignored: set[str]) -> dict[str, Any]:
    """The request echoed as A1111 does: without the images unless include_init_images."""
    ignored = ignored - {"styles", "image_cfg_scale"}
    drop = ignored | (set() if req.include_init_images else {"init_images", "mask"})
    return req.model_dump(exclude=drop)


def _info(req: Img2ImgRequest, batches: list[Any], outs: list[Any], model: ModelInfo,
          warnings: list[str], control: dict[str, str] | None = None) -> dict[str, Any]:
    first = batches[0]
    seeds = [g.seed for out in outs for g in out.result.images]
    sampler = sampler_label(first.scheduler)
    cache = outs[0].result.cache if outs else None
    extra = _extra(req) | (control or {})  # ControlNet's units after img2img's own parameters
    texts = [infotext(req.prompt, req.negative_prompt, image_params(first, seed, model, sampler, extra, cache))
             for seed in seeds]
    return {"prompt": req.prompt, "negative_prompt": req.negative_prompt, "seed": seeds[0], "all_seeds": seeds,
            "all_prompts": [req.prompt] * len(seeds), "width": first.width, "height": first.height,
            "sampler_name": sampler, "cfg_scale": first.images[0].guidance_scale,
            "steps": first.steps, "denoising_strength": first.strength, "batch_size": req.batch_size,
            "n_iter": req.n_iter, "sd_model_name": model.name, "mode": first.mode, "warnings": warnings,
            "infotexts": texts, "interrupted": any(out.result.interrupted for out in outs)}


def _extra(req: Img2ImgRequest) -> dict[str, Any]:
    """img2img's infotext parameters (create_infotext's Denoising strength; the inpainting ones with a mask)."""
    extra: dict[str, Any] = {"Denoising strength": f"{req.denoising_strength:g}"}
    if req.mask is not None:
        extra |= {"Mask blur": req.mask_blur, "Masked content": FILLS[req.inpainting_fill][1]}
        if req.inpaint_full_res:
            extra |= {"Inpaint area": "Only masked", "Masked area padding": req.inpaint_full_res_padding}
    return extra
