"""OpenAI Images API: POST /v1/images/generations (b64_json or url), GET /v1/images/files/{id}.png."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from server.schemas import ImageData, ImageGenerationRequest, ImagesResponse
from server.service import b64

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations", response_model=ImagesResponse, response_model_exclude_none=True)
async def generate_images(req: ImageGenerationRequest, request: Request, response: Response) -> ImagesResponse:
    """Generate ``n`` images for ``prompt``; same seed, same request -> byte-identical PNGs."""
    service = request.app.state.service
    service.require_ready()
    batch = service.to_batch(req)
    out = await service.run(batch, request.headers.get("x-sdserve-timeout-s"), request.is_disconnected)
    out.trace_headers(response)
    if req.response_format == "url":
        store = request.app.state.image_store
        data = [ImageData(url=str(request.url_for("image_file", image_id=store.put(p)))) for p in out.pngs]
    else:
        data = [ImageData(b64_json=b64(p)) for p in out.pngs]
    return ImagesResponse(created=int(time.time()), data=data)


@router.get("/v1/images/files/{image_id}.png", name="image_file", response_class=Response,
            responses={200: {"content": {"image/png": {}}}, 404: {"description": "unknown or expired"}})
async def image_file(image_id: str, request: Request) -> Response:
    """An image from a `response_format: url` response; kept for a short time in a bounded store."""
    return Response(request.app.state.image_store.get(image_id), media_type="image/png")
