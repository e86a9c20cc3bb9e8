"""OpenAI Images API: POST /v1/images/generations (b64_json or url), GET /v1/images/files/{id}.png, and
GET /v1/models (the served model with its family)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response

from server.middleware import api_key_id
from server.schemas import ImageData, ImageGenerationRequest, ImagesResponse, error_responses
from server.service import alias_models, b64

router = APIRouter(tags=["openai"])


def image_link(request: Request, image_id: str) -> str:
    """The configured public base URL + the file's path, or the path alone: never built from the Host header,
    which the client chooses."""
    path = request.app.url_path_for("image_file", image_id=image_id)
    base: str = request.app.state.settings.server.public_base_url
    return base.rstrip("/") + str(path)


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True,
             responses=error_responses(400, 401, 413, 429, 500, 503, 504))
async def generate_images(req: ImageGenerationRequest, request: Request, response: Response) -> ImagesResponse:
    """Generate ``n`` images for ``prompt``; same seed, same request -> byte-identical PNGs."""
    service = request.app.state.service
    service.require_ready()
    batch = service.to_batch(req)
    out = await service.run(batch, request.headers.get("x-sdserve-timeout-s"), request.is_disconnected,
                            api_key_id(request.scope))
    out.trace_headers(response)
    if out.result.interrupted:  # POST /sdapi/v1/interrupt by the same caller: decoded from the latents so far
        response.headers["x-sdserve-interrupted"] = f"{out.result.steps_done}/{batch.steps}"
    if req.response_format == "url":
        store = request.app.state.image_store
        data = [ImageData(url=image_link(request, store.put(p))) for p in out.pngs]
    else:
        data = [ImageData(b64_json=b64(p)) for p in out.pngs]
    return ImagesResponse(created=int(time.time()), data=data)


@router.get("/v1/images/files/{image_id}.png", name="image_file", response_class=Response,
            responses={200: {"content": {"image/png": {}}}, **error_responses(404)})
async def image_file(image_id: str, request: Request) -> Response:
    """An image from a `response_format: url` response; kept for a short time in a bounded store."""
    return Response(request.app.state.image_store.get(image_id), media_type="image/png")


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    """OpenAI's model list: the one served model, with its family, native size, prediction type, text encoders,
    VAE scaling factor and whether CFG runs by default (engines/protocol.py ModelInfo.family_summary)."""
    info = request.app.state.engine.info
    return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0, "owned_by": "sdserve",
                                        **info.family_summary()}, *alias_models(request.app.state.settings, info)]}
