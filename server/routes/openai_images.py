"""OpenAI Images API: POST /v1/images/generations."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response

from engines.errors import NotReadyError
from server.schemas import ImageData, ImageGenerationRequest, ImagesResponse
from server.service import b64

router = APIRouter(tags=["openai"])


@router.post("/v1/images/generations", response_model=ImagesResponse)
async def generate_images(req: ImageGenerationRequest, request: Request, response: Response) -> ImagesResponse:
    """Generate ``n`` images for ``prompt``; same seed, same request -> byte-identical PNGs."""
    state = request.app.state.server_state
    if not state.ready:
        raise NotReadyError(f"server is {state.state}: " + "; ".join(state.reasons) if state.reasons
                            else f"server is {state.state}", permanent=state.state == "failed")
    service = request.app.state.service
    out = await service.generate(service.to_batch(req))
    timings = out.result.timings
    response.headers["Server-Timing"] = (f"queue;dur={out.queue_seconds * 1000:.1f}, "
                                         f"compute;dur={timings.get('total', 0.0) * 1000:.1f}, "
                                         f"encode;dur={out.encode_seconds * 1000:.1f}")
    response.headers["x-sdserve-provider"] = out.result.provider
    response.headers["x-sdserve-seeds"] = ",".join(str(g.seed) for g in out.result.images)
    return ImagesResponse(created=int(time.time()), data=[ImageData(b64_json=b64(p)) for p in out.pngs])
