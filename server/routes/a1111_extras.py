"""AUTOMATIC1111's extras routes: ``POST /sdapi/v1/extra-single-image``, ``/extra-batch-images`` (upscale) and
``/interrogate`` (issue 57 point 4), as webuiapi, aiyabot's /upscale and /identify and AI Render call them.

Shapes follow A1111's modules/api/models.py (ExtrasBaseRequest, ExtrasSingleImageRequest, ExtrasBatchImagesRequest
with ``imageList`` of FileData, ExtraBaseResponse ``html_info``, InterrogateRequest/Response) and its handlers in
modules/api/api.py (``extras_single_image_api``, ``extras_batch_images_api``, ``interrogateapi``); the upscale
steps are server/upscale.py's. Uploads are decoded as every upload is (server/images_in.py: header bounds, the
per-request pixel budget, the shared decoder slots), the work runs off the event loop under the request's
deadline, one upscale at a time per process (another is a 429 at once), and with ``[provenance]`` signing each
result is signed with its source image as the ``parentOf`` ingredient. GFPGAN and CodeFormer are refused by name
(sdserve has neither model). ``/interrogate`` answers 501 naming the CLIP interrogator it lacks.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from PIL import Image, PngImagePlugin
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from engines.errors import InvalidRequestError
from engines.factory import TilesStopped, UpscalerLibrary
from server import headers
from server.edits import within_deadline
from server.errors import DeadlineExceededError, QueueFullError, error_body
from server.images_in import check_pixel_budget, decoding_for, from_base64, from_base64_bytes
from server.middleware import tenant_label
from server.provenance import HEADER
from server.provenance_stage import ingredient, sdserve_version, server_facts
from server.schemas import ErrorResponse, error_responses
from server.service import b64
from server.upscale import UpscaleJob, html_info, infotext, refuse_face_restorers, resolve, upscale_image

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])
MAX_BATCH = 16
"""Images one extra-batch-images request may carry (as img2img's init_images)."""
INTERROGATORS = ("clip", "deepdanbooru")
"""A1111's interrogate models (modules/api/api.py ``interrogateapi``)."""
_busy = threading.Lock()
"""One upscale at a time in the process: a second is refused at once (429), never queued on a thread."""


def library(request: Request) -> UpscalerLibrary:
    """The process's ONNX upscalers (``[runtime] upscaler_dir``), created on first use (one per app)."""
    found = getattr(request.app.state, "upscalers", None)
    if found is None:
        found = request.app.state.upscalers = UpscalerLibrary(request.app.state.settings.runtime)
    return found


class ExtrasBaseRequest(BaseModel):
    """A1111's ExtrasBaseRequest: its defaults, its bounds."""

    resize_mode: Literal[0, 1] = 0
    show_extras_results: bool = True
    gfpgan_visibility: float = Field(0, ge=0, le=1, allow_inf_nan=False)
    codeformer_visibility: float = Field(0, ge=0, le=1, allow_inf_nan=False)
    codeformer_weight: float = Field(0, ge=0, le=1, allow_inf_nan=False)
    upscaling_resize: float = Field(2, gt=0, le=64, allow_inf_nan=False)
    upscaling_resize_w: int = Field(512, ge=1, le=65_536)
    upscaling_resize_h: int = Field(512, ge=1, le=65_536)
    upscaling_crop: bool = True
    upscaler_1: str = Field("None", max_length=256)
    upscaler_2: str = Field("None", max_length=256)
    extras_upscaler_2_visibility: float = Field(0, ge=0, le=1, allow_inf_nan=False)
    upscale_first: bool = False


class ExtrasSingleImageRequest(ExtrasBaseRequest):
    image: str = Field("", description="the image, base64 (with or without a data: prefix)")


class FileData(BaseModel):
    data: str = Field(description="the image, base64 (with or without a data: prefix)")
    name: str = Field(max_length=1024)


class ExtrasBatchImagesRequest(ExtrasBaseRequest):
    imageList: list[FileData] = Field(min_length=1, max_length=MAX_BATCH)  # noqa: N815 (A1111's name)


class ExtrasSingleImageResponse(BaseModel):
    html_info: str
    image: str | None = None


class ExtrasBatchImagesResponse(BaseModel):
    html_info: str
    images: list[str]


EXTRAS_ERRORS = error_responses(401, 413, 422, 429, 500, 504, validation=True)


@router.post("/extra-single-image", response_model=ExtrasSingleImageResponse, responses=EXTRAS_ERRORS)
async def extra_single_image(req: ExtrasSingleImageRequest, request: Request,
                             response: Response) -> ExtrasSingleImageResponse:
    """One image upscaled as A1111's extras tab does (server/upscale.py)."""
    if not req.image:
        raise InvalidRequestError("image is required: a base64 image", param="image")
    images, html = await _extras(request, response, req, [("image", req.image)])
    return ExtrasSingleImageResponse(html_info=html, image=images[0] if req.show_extras_results else None)


@router.post("/extra-batch-images", response_model=ExtrasBatchImagesResponse, responses=EXTRAS_ERRORS)
async def extra_batch_images(req: ExtrasBatchImagesRequest, request: Request,
                             response: Response) -> ExtrasBatchImagesResponse:
    """Every image of ``imageList`` upscaled the same way; ``html_info`` is the last one's (A1111's)."""
    uploads = [(f"imageList.{i}.data", item.data) for i, item in enumerate(req.imageList)]
    images, html = await _extras(request, response, req, uploads)
    return ExtrasBatchImagesResponse(html_info=html, images=images)


async def _extras(request: Request, response: Response, req: ExtrasBaseRequest,
                  uploads: list[tuple[str, str]]) -> tuple[list[str], str]:
    refuse_face_restorers({"gfpgan_visibility": req.gfpgan_visibility,
                           "codeformer_visibility": req.codeformer_visibility})
    limits = request.app.state.settings.limits
    check_pixel_budget(uploads, limits.max_image_pixels, limits.max_request_pixels)
    deadline = request.app.state.service.deadline(request.headers.get(headers.TIMEOUT))
    with decoding_for(tenant_label(request.scope)):
        pngs, texts, facts = await within_deadline(deadline, _work, request, req, uploads, deadline)
    signed = await _sign(request, response, pngs, facts)
    return [b64(p) for p in signed], html_info(texts[-1])


def _work(request: Request, req: ExtrasBaseRequest, uploads: list[tuple[str, str]],
          deadline: float) -> tuple[list[bytes], list[str], list[dict[str, Any]]]:
    """Blocking, in a worker thread, holding the one upscale slot for as long as it computes (past a deadline the
    request answers 504 at once and this thread stops at its next tile, still holding it)."""
    if not _busy.acquire(blocking=False):
        raise QueueFullError("an upscale is already running on this server (one at a time): retry shortly", 2)
    try:
        return _upscale_all(request, req, uploads, deadline)
    finally:
        _busy.release()


def _upscale_all(request: Request, req: ExtrasBaseRequest, uploads: list[tuple[str, str]],
                 deadline: float) -> tuple[list[bytes], list[str], list[dict[str, Any]]]:
    """Load the upscalers, decode, upscale and encode every image."""
    runtime, limits = request.app.state.settings.runtime, request.app.state.settings.limits
    lib = library(request)
    job = UpscaleJob(req.resize_mode, req.upscaling_resize, req.upscaling_resize_w, req.upscaling_resize_h,
                     req.upscaling_crop, resolve(req.upscaler_1, "upscaler_1", lib),
                     resolve(req.upscaler_2, "upscaler_2", lib), req.extras_upscaler_2_visibility,
                     runtime.upscaler_tile, runtime.upscaler_tile_overlap, limits.max_request_pixels, deadline)
    pngs, texts, facts = [], [], []
    for field, text in uploads:
        source = from_base64(text, field, limits.max_image_pixels)
        try:
            result, info = upscale_image(source, job)
        except TilesStopped as exc:
            raise DeadlineExceededError(str(exc)) from None
        text_info = infotext(info)
        pngs.append(_png(result, source, text_info))
        texts.append(text_info)
        facts.append({"mode": "upscale", "postprocessing": text_info, "width": result.width,
                      "height": result.height, "upscaler_1": job.first[0], "upscaler_2": job.second[0],
                      "ingredients": [ingredient(from_base64_bytes(text, field), field, "parentOf")]})
    return pngs, texts, facts


def _png(image: Image.Image, source: Image.Image, text: str) -> bytes:
    """The PNG with the source's ``parameters`` text kept and ``postprocessing`` added (A1111's API encode)."""
    meta = PngImagePlugin.PngInfo()
    parameters = source.info.get("parameters")
    if isinstance(parameters, str):
        meta.add_text("parameters", parameters)
    if text:
        meta.add_text("postprocessing", text)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=meta)
    return buffer.getvalue()


async def _sign(request: Request, response: Response, pngs: list[bytes], facts: list[dict[str, Any]]) -> list[bytes]:
    """The provenance stage (server/provenance.py ``Provenance.stamp``) with each source as the ingredient."""
    provenance = request.app.state.service.provenance
    if provenance.mode == "off":
        stamped = provenance.stamp(pngs, [], "")
    else:
        shared = server_facts(request)
        full = [{**shared, **fact, "index": i} for i, fact in enumerate(facts)]
        start = time.perf_counter()
        stamped = await run_in_threadpool(provenance.stamp, pngs, full, sdserve_version())
        response.headers["Server-Timing"] = f"sign;dur={(time.perf_counter() - start) * 1000:.1f}"
    response.headers[HEADER] = stamped.status
    if stamped.warning:
        headers.put(response.headers, headers.WARNINGS, stamped.warning)
    signed: list[bytes] = stamped.images
    return signed


class InterrogateRequest(BaseModel):
    image: str = Field("", description="the image, base64")
    model: str = Field("clip", max_length=256, description="clip or deepdanbooru (A1111's)")


INTERROGATE_MISSING = ("{model} interrogation is not available on this server: it needs the {what}, which is not "
                       "installed (sdserve has no interrogator model configured)")
WHAT = {"clip": "CLIP interrogator model (a BLIP captioner and a CLIP image/text encoder pair, as ONNX)",
        "deepdanbooru": "DeepDanbooru tagger model"}


@router.post("/interrogate", responses={**error_responses(401, 413, 422, validation=True),
                                        501: {"model": ErrorResponse, "description": "no interrogator installed"}})
async def interrogate(req: InterrogateRequest) -> JSONResponse:
    """A1111's interrogate: 501 naming the model it needs (none is installed), never a bare 404; a model A1111
    does not know is a 422 naming ``model``."""
    if req.model not in INTERROGATORS:
        raise InvalidRequestError(f"model {req.model[:64]!r} is not an interrogate model; A1111's are "
                                  f"{list(INTERROGATORS)}", param="model")
    message = INTERROGATE_MISSING.format(model=req.model, what=WHAT[req.model])
    return JSONResponse({**error_body(message, "not_implemented", "model", "model_not_installed"),
                         "detail": message}, status_code=501)
