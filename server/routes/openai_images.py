"""OpenAI Images API: POST /v1/images/generations (b64_json or url, png/jpeg/webp), GET /v1/images/files/{name},
and GET /v1/models (the served model with its family)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from engines.config import parse_size
from engines.types.model import ModelInfo
from engines.types.request import Batch
from server import headers
from server.controlnet import openai_control
from server.encoding import ImageFormat, media_type_of
from server.hires import HiresPlan, make_plan, run_hires
from server.images import embed_infotext
from server.links import image_link, link_base, may_fetch, store_image
from server.middleware import tenant_label
from server.provenance_stage import stamp
from server.request_rules import FieldNotes, alias_models, from_openai, hires_base, openai_notes, response_format
from server.routes.a1111 import sampler_label
from server.routes.a1111_infotext import image_params, infotext
from server.schemas import ImageData, ImageGenerationRequest, ImagesResponse, error_responses
from server.service import Generated, b64
from server.settings import Settings

router = APIRouter(tags=["openai"])
__all__ = ["image_link", "link_base", "router"]
"""image_link and link_base live in server/links.py; named here too for routes that imported them from here."""


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=error_responses(400, 401, 413, 429, 500, 503, 504))
async def generate_images(req: ImageGenerationRequest, request: Request, response: Response) -> ImagesResponse:
    """Generate ``n`` images for ``prompt``; same seed, same request -> byte-identical images."""
    service = request.app.state.service
    service.require_ready()
    notes = openai_notes(req)
    plan = None
    base = hires_base(req.size, service.settings, service.engine.info)
    if base is not None:  # an OpenAI size on a smaller-trained model, served through Hires fix
        first = req.model_copy(update={"size": f"{base[0]}x{base[1]}"})
        batch = service.to_batch(from_openai(first, service.settings, service.engine.info))
        plan = make_plan(batch, service.engine.info, resize=parse_size(req.size or ""), upscaler="Lanczos",
                         denoising_strength=service.settings.limits.edit_strength)
        notes.warnings.append(f"size {req.size} served through Hires fix ([serving] openai_sizes_hires): a first "
                              f"pass at {base[0]}x{base[1]}, a Lanczos upscale, then a second pass at {req.size} "
                              f"at strength {plan.denoising_strength:g}")
    else:
        batch = service.to_batch(from_openai(req, service.settings, service.engine.info))
    if req.controlnet is not None:  # extension: ControlNet units, as A1111's (server/controlnet.py)
        batch = await run_in_threadpool(openai_control, request, req.controlnet, batch, plan is not None)
    answer, out = await run_and_answer(request, response, req, batch, notes, plan)
    if out.result.interrupted:  # POST /sdapi/v1/interrupt by the same caller: decoded from the latents so far
        response.headers[headers.INTERRUPTED] = f"{out.result.steps_done}/{batch.steps}"
    return answer


async def run_and_answer(request: Request, response: Response, req: ImageGenerationRequest, batch: Batch,
                         notes: FieldNotes, hires: HiresPlan | None = None) -> tuple[ImagesResponse, Generated]:
    """Run ``batch`` for an OpenAI images route (generations, edits, variations) and answer as OpenAI does: images
    as b64 or absolute links in the requested format, trace headers, the fields noted as ignored, warnings. With
    ``hires``, ``batch`` is the first pass of a Hires fix (server/hires.py). Each image carries its infotext
    (``[api] infotext``), written before provenance signs the bytes."""
    service = request.app.state.service
    as_url = response_format(req) == "url"
    if as_url:
        link_base(request, request.app.state.settings.server)  # refuse a Host we cannot link to before computing
    fmt = ImageFormat(req.output_format or "png", 100 if req.output_compression is None else req.output_compression)
    timeout, owner = request.headers.get(headers.TIMEOUT), tenant_label(request.scope)
    if hires is None:
        out = await service.run(batch, timeout, request.is_disconnected, owner, fmt.encode)
    else:
        out = (await run_hires(service, [batch], hires, timeout, request.is_disconnected, owner, fmt.encode))[0]
    out = _with_infotexts(out, batch, service.engine.info, request.app.state.settings, hires)
    out.trace_headers(response)
    out = await stamp(request, response, out, batch)  # provenance: the last stage, it signs the final bytes
    warnings = out.warnings + notes.warnings
    response.headers.update(notes.headers())
    if warnings:
        headers.put(response.headers, headers.WARNINGS, "; ".join(warnings))
    if as_url:
        data = [ImageData(url=image_link(request, store_image(request, p, fmt.name, owner))) for p in out.pngs]
    else:
        data = [ImageData(b64_json=b64(p)) for p in out.pngs]
    width, height = hires.size if hires is not None and not out.result.interrupted else (batch.width, batch.height)
    answer = ImagesResponse(created=int(time.time()), data=data, output_format=fmt.name,
                            size=f"{width}x{height}", background="opaque", warnings=warnings or None)
    return answer, out


def _with_infotexts(out: Generated, batch: Batch, info: ModelInfo, settings: Settings,
                    hires: HiresPlan | None) -> Generated:
    """The images with A1111's infotext embedded (server/images.py), as the A1111 routes write it."""
    if not settings.api.infotext:
        return out
    try:
        sampler = sampler_label(batch.scheduler)
    except StopIteration:  # a scheduler without an A1111 name: the infotext names ours
        sampler = batch.scheduler
    prompt, negative = batch.images[0].prompt, batch.images[0].negative_prompt
    prompt += "".join(f" <lora:{u.label()}>" for u in batch.loras)  # as A1111 writes it: the tags in the prompt
    extra = hires.infotext if hires is not None else None
    texts = [infotext(prompt, negative, image_params(batch, g.seed, info, sampler, extra)) for g in out.result.images]
    return dataclasses.replace(out, pngs=[embed_infotext(p, t) for p, t in zip(out.pngs, texts, strict=True)])


@router.get("/v1/images/files/{image_id}", name="image_file", response_class=Response,
            responses={200: {"content": {"image/png": {}, "image/jpeg": {}, "image/webp": {}}},
                       **error_responses(404)})
async def image_file(image_id: str, request: Request) -> Response:
    """An image from a `response_format: url` response (``<id>.png``, ``.jpeg`` or ``.webp``); kept for a short
    time in a bounded store. 404 as for an unknown image when the fetch presents another tenant's credentials
    (server/links.py)."""
    media_type = media_type_of(image_id)
    if media_type is None or not may_fetch(request, image_id):
        raise HTTPException(404, "image not found or expired")
    return Response(request.app.state.image_store.get(image_id), media_type=media_type)


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's model list: the one served model, with its family, native size, prediction type, text encoders,
    VAE scaling factor and whether CFG runs by default (engines/types/model.py ModelInfo.family_summary)."""
    info = request.app.state.engine.info
    return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0, "owned_by": "sdserve",
                                        **info.family_summary()}, *alias_models(request.app.state.settings, info)]}
