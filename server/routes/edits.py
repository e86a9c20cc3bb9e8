"""OpenAI Images API edits: POST /v1/images/edits and POST /v1/images/variations (multipart/form-data, as the
official SDK sends them).

- edits: ``image`` (or ``image[]``, one image), optional ``mask`` whose transparent pixels mark the area to edit
  (without a mask, the image's own transparent pixels; with neither, img2img of the whole image at
  ``limits.edit_strength``), ``prompt``, ``n``, ``size``, ``response_format``, ``output_format`` (png, jpeg,
  webp) and ``output_compression``, ``background`` (auto, opaque), ``moderation``, ``model``, ``user``,
  ``quality``; extensions ``strength``, ``negative_prompt``, ``seed``, ``steps``, ``guidance_scale``,
  ``scheduler``. The image is resized to ``size`` by crop-and-resize (A1111's resize mode 1); a mask must have the
  image's dimensions, as OpenAI requires. Refused by name: ``stream``, ``background=transparent``, more than one
  image; ``input_fidelity`` and ``partial_images`` are named as ignored (x-sdserve-ignored-fields).
- instruction edits (a model with ModelInfo.instruct_images: Qwen-Image-Edit, FLUX.1 Kontext, FLUX.2 with
  reference images): without a mask, the prompt says what to change and every image sent (``image[]`` repeated, as
  the openai SDK sends a list; up to the model's limit, else a 400 naming ``image``) conditions every output image
  (mode ``instruct``); the output size is ``size``, else (or ``auto``) the model's rule on the inputs' sizes
  (ModelInfo.instruct_size). ``strength`` and ``input_fidelity`` are named as ignored; a mask on such a model that
  cannot inpaint is a 400 naming ``mask``.

Each input image is a C2PA ingredient of the signed manifest (server/provenance_stage.py record_inputs): the image
edited ``parentOf``, an instruction edit's other images ``componentOf``, the mask ``inputTo``.
- variations: img2img of ``image`` with an empty prompt at ``limits.variation_strength`` (fields ``image``, ``n``,
  ``size``, ``response_format``, ``model``, ``user``; extension ``seed``, ``strength``).

An OpenAI size on a model trained smaller is served as generations serve it: through Hires fix under
``[serving] openai_sizes_hires`` (the edit at the native pixel count, then a second pass at the size), else a 400
naming the option.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile

from engines.config import parse_size
from engines.errors import InvalidRequestError
from engines.types.request import Batch
from server import headers
from server.controlnet import openai_control, openai_units
from server.edits import (
    EditInput,
    edit_batch,
    instruct_shape,
    instruct_size,
    is_instruct,
    require_edits,
    within_deadline,
)
from server.hires import HiresPlan, make_plan
from server.images_in import alpha_mask, check_pixel_budget, declared_size, decode, decoding_for, mask_image
from server.middleware import tenant_label
from server.provenance_stage import ingredient, record_inputs
from server.request_rules import FieldNotes, from_openai, hires_base, openai_notes
from server.routes.openai_images import run_and_answer
from server.schemas import ImageGenerationRequest, ImagesResponse, error_responses

router = APIRouter(tags=["openai"])
EDIT_PATHS = ("/v1/images/edits", "/v1/images/variations", "/sdapi/v1/img2img", "/sdapi/v1/png-info")
"""Routes whose bodies carry images: limits.max_upload_bytes applies to them (server/app.py)."""
NUMBERS: dict[str, type[int] | type[float]] = {"n": int, "seed": int, "steps": int, "guidance_scale": float,
                                                "strength": float, "output_compression": int}
TEXT = ("prompt", "negative_prompt", "size", "response_format", "model", "user", "quality", "scheduler",
        "output_format", "background", "moderation")
ACCEPTED = ("input_fidelity", "stream", "partial_images")
"""OpenAI edit fields without a generation counterpart (checked by _edit_notes: ignored by name or refused)."""


async def _read(request: Request, allowed: tuple[str, ...]) -> tuple[dict[str, Any], list[bytes], list[bytes]]:
    """(text fields, images, masks) of the multipart body; the uploads' temporary files are closed here."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidRequestError("send the image as multipart/form-data (as the openai SDK does)", param="image")
    form = await request.form(max_files=8, max_fields=64)
    try:
        return _fields(form, allowed), await _files(form, "image", "image[]"), await _files(form, "mask")
    finally:
        await form.close()


def _fields(form: FormData, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The form's text fields, numbers converted; unknown fields refused by name."""
    out: dict[str, Any] = {}
    for name, value in form.multi_items():
        if name in ("image", "image[]", "mask"):
            continue
        if name not in allowed:
            raise InvalidRequestError(f"unknown field {name[:64]!r}", param=name[:64])
        if not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a text field, not a file", param=name)
        if name in NUMBERS:
            try:
                out[name] = NUMBERS[name](value)
            except ValueError:
                raise InvalidRequestError(f"{name} {value[:32]!r} is not a number", param=name) from None
        else:
            out[name] = value
    return out


def _edit_notes(fields: dict[str, Any], instruct: bool) -> FieldNotes:
    notes = FieldNotes()
    if fields.pop("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequestError("stream is not supported: sdserve answers when the images are done", param="stream")
    if "input_fidelity" in fields:
        why = ("the model conditions on the input images in full (its pipeline has no fidelity setting)"
               if instruct else "the strength decides how much of the image is kept")
        notes.ignore("input_fidelity", f"{str(fields.pop('input_fidelity'))[:16]!r}: {why}")
    if instruct and "strength" in fields:
        notes.ignore("strength", f"{fields.pop('strength')!r}: an instruction edit starts from noise and "
                     "conditions on the input images; the prompt says what to change")
    if "partial_images" in fields:
        notes.ignore("partial_images", "no partial images are sent (no streaming)")
        fields.pop("partial_images")
    return notes


async def _files(form: FormData, name: str, *aliases: str) -> list[bytes]:
    found = [v for key in (name, *aliases) for v in form.getlist(key)]
    if any(not isinstance(v, UploadFile) for v in found):
        raise InvalidRequestError(f"{name} must be a file upload", param=name)
    return [await v.read() for v in found if isinstance(v, UploadFile)]


def _request(fields: dict[str, Any]) -> ImageGenerationRequest:
    try:
        return ImageGenerationRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "body"
        raise InvalidRequestError(f"{where}: {error['msg']}", param=where) from None


def first_pass(req: ImageGenerationRequest, request: Request) -> ImageGenerationRequest:
    """The request whose batch the edit runs first: itself, or, for an OpenAI size served through Hires fix
    ([serving] openai_sizes_hires, as generations are: server/request_rules.py hires_base), the same at the
    first pass's size."""
    service = request.app.state.service
    base = hires_base(req.size, service.settings, service.engine.info)
    return req if base is None else req.model_copy(update={"size": f"{base[0]}x{base[1]}"})


def _first_batch(req: ImageGenerationRequest, request: Request) -> Batch:
    """The txt2img batch of ``first_pass(req)``, which the edit inputs are added to."""
    service = request.app.state.service
    batch: Batch = service.to_batch(from_openai(first_pass(req, request), service.settings, service.engine.info))
    return batch


def _hires(req: ImageGenerationRequest, batch: Batch, request: Request, notes: FieldNotes) -> HiresPlan:
    """The second pass of an edit (``batch``, at the first pass's size) at an OpenAI size served through Hires fix:
    a Lanczos upscale, then img2img at the requested size at ``limits.edit_strength`` (with the mask, when the edit
    has one: server/hires.py second_pass)."""
    service = request.app.state.service
    plan = make_plan(batch, service.engine.info, resize=parse_size(req.size or ""), upscaler="Lanczos",
                     denoising_strength=service.settings.limits.edit_strength)
    notes.warnings.append(f"size {req.size} served through Hires fix ([serving] openai_sizes_hires): the edit at "
                          f"{batch.width}x{batch.height}, a Lanczos upscale, then a second pass at {req.size} at "
                          f"strength {plan.denoising_strength:g}")
    return plan


async def _respond(request: Request, response: Response, req: ImageGenerationRequest, edit: EditInput,
                   strength: float, notes: FieldNotes) -> ImagesResponse:
    service = request.app.state.service
    more = openai_notes(req)
    notes.ignored += more.ignored
    notes.warnings += more.warnings
    hires = first_pass(req, request) is not req
    if hires and edit.instruct:
        raise InvalidRequestError(f"size {req.size} is served through Hires fix on this profile ([serving] "
                                  "openai_sizes_hires), which instruction edits do not take: ask a served size, or "
                                  "leave size out for the model's own", param="size")
    batch = edit_batch(_first_batch(req, request), edit, service.engine.info, strength)
    if req.controlnet is not None:  # extension: ControlNet units, as A1111's (server/controlnet.py)
        batch = await run_in_threadpool(openai_control, request, req.controlnet, batch, hires)
    plan = _hires(req, batch, request, notes) if hires else None
    answer, out = await run_and_answer(request, response, req, batch, notes, plan)
    response.headers[headers.MODE] = batch.mode
    response.headers[headers.STRENGTH] = f"{batch.strength:g}"
    request.app.state.metrics.images_by_mode.labels(request.url.path, batch.mode).inc(len(out.pngs))
    return answer


@router.post("/v1/images/edits", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=error_responses(400, 401, 413, 429, 500, 503, 504))
async def edit_images(request: Request, response: Response) -> ImagesResponse:
    """Edit ``image`` as ``prompt`` says: inpainting where the mask (or the image) is transparent, else img2img."""
    service = request.app.state.service
    service.require_ready()
    require_edits(service.engine.info)
    fields, images, masks = await _read(request, (*TEXT, *NUMBERS, *ACCEPTED, "controlnet"))
    info = service.engine.info
    instruct = is_instruct(info, len(images), len(masks))
    if not instruct and len(images) != 1:
        raise InvalidRequestError(f"send one image (got {len(images)}): this model edits one image (several are "
                                  "for an instruction-edit model, and without a mask)", param="image")
    notes = _edit_notes(fields, instruct)
    strength = fields.pop("strength", None)
    if "controlnet" in fields:  # extension: the units as JSON text (server/controlnet.py)
        fields["controlnet"] = openai_units(fields["controlnet"])["args"]
    req, limit = _request(fields), service.settings.limits.max_image_pixels  # cheap checks before the decodes
    uploads = [("image" if len(images) == 1 else f"image.{i}", data) for i, data in enumerate(images)]
    await run_in_threadpool(check_pixel_budget, [*uploads, *(("mask", m) for m in masks)], limit,
                            service.settings.limits.max_request_pixels)
    sizes = [await run_in_threadpool(declared_size, data, name, limit) for name, data in uploads] if instruct else []
    if instruct and req.size in (None, "auto"):  # the model's rule on the inputs' sizes, read from their headers
        size = instruct_size(info, sizes)
        req = req if size is None else req.model_copy(update={"size": f"{size[0]}x{size[1]}"})
    # admitted on its estimated cost before any pixel is decoded; the decodes run under the request's deadline
    first = _first_batch(req, request)
    deadline = service.preadmit([instruct_shape(first, sizes) if instruct else first],
                                request.headers.get(headers.TIMEOUT))
    with decoding_for(tenant_label(request.scope)):  # the decoders are shared fairly across tenants
        decoded = [await within_deadline(deadline, decode, data, name, limit) for name, data in uploads]
        mask = await within_deadline(deadline, decode, masks[0], "mask", limit) if masks else None
    image = decoded[0]
    if mask is not None and mask.size != image.size:
        raise InvalidRequestError(f"mask is {mask.width}x{mask.height} but image is {image.width}x{image.height}: "
                                  "they must have the same dimensions", param="mask")
    if instruct:
        edit = EditInput(tuple(decoded), instruct=True)
    else:
        edit = EditInput((image,), mask_image(mask) if mask is not None else alpha_mask(image), strength)
    record_inputs(request, [[ingredient(data, name, "parentOf" if i == 0 else "componentOf")
                             for i, (name, data) in enumerate(uploads)]
                            + [ingredient(m, "mask", "inputTo") for m in masks]])
    return await _respond(request, response, req, edit, service.settings.limits.edit_strength, notes)


@router.post("/v1/images/variations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=error_responses(400, 401, 413, 429, 500, 503, 504))
async def image_variations(request: Request, response: Response) -> ImagesResponse:
    """Variations of ``image``: img2img with an empty prompt at ``limits.variation_strength`` (x-sdserve-strength
    says which)."""
    service = request.app.state.service
    service.require_ready()
    require_edits(service.engine.info)
    fields, images, masks = await _read(request, ("n", "size", "response_format", "model", "user", "seed",
                                                  "strength"))
    if len(images) != 1 or masks:
        raise InvalidRequestError(f"send one image (got {len(images)})", param="image")
    strength = fields.pop("strength", service.settings.limits.variation_strength)
    req = _request({**fields, "prompt": "variation"}).model_copy(update={"prompt": ""})
    deadline = service.preadmit([_first_batch(req, request)], request.headers.get(headers.TIMEOUT))
    with decoding_for(tenant_label(request.scope)):
        image = await within_deadline(deadline, decode, images[0], "image", service.settings.limits.max_image_pixels)
    record_inputs(request, [[ingredient(images[0], "image", "parentOf")]])
    return await _respond(request, response, req, EditInput((image,), None, strength), strength, FieldNotes())
