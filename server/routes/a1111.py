"""AUTOMATIC1111-compatible API: POST /sdapi/v1/txt2img, GET /sdapi/v1/samplers, GET /sdapi/v1/sd-models.
Validation errors are 422 with FastAPI's `detail` list (what A1111 clients expect)."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from engines.errors import InvalidRequestError
from server.schemas import ImageGenerationRequest, Prompt
from server.service import b64

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])

SAMPLERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Euler": ("euler", ("k_euler",)),
    "Euler a": ("euler_a", ("k_euler_a",)),
    "DDIM": ("ddim", ()),
    "DPM++ 2M": ("dpmpp_2m", ("k_dpmpp_2m",)),
}
_BY_NAME = {alias.lower(): ours for name, (ours, aliases) in SAMPLERS.items() for alias in (name, *aliases)}


class Txt2ImgRequest(BaseModel):
    """The A1111 txt2img fields sdserve honours; other A1111 fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: Prompt = Field(..., description="What to draw.")
    negative_prompt: str = ""
    seed: int = Field(-1, ge=-1, le=2**32 - 1, description="-1 = random")
    steps: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0, le=30)
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    batch_size: int = Field(1, ge=1)
    n_iter: int = Field(1, ge=1)
    sampler_name: str | None = Field(None, description="Euler, Euler a, DDIM, DPM++ 2M")
    sampler_index: str | None = Field(None, description="legacy alias of sampler_name")
    scheduler: str | None = Field(None, description="A1111 noise schedule; only Automatic is supported")
    # Features sdserve does not implement: accepted only when off, refused (422) rather than silently ignored.
    enable_hr: bool = False
    restore_faces: bool = False
    tiling: bool = False
    script_name: str | None = None
    alwayson_scripts: dict[str, Any] = Field(default_factory=dict)

    def refuse_unsupported(self) -> None:
        for name in ("enable_hr", "restore_faces", "tiling", "script_name", "alwayson_scripts"):
            if getattr(self, name):
                raise InvalidRequestError(f"{name} is not supported by sdserve", param=name)


class Txt2ImgResponse(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str
    """JSON text, as A1111 returns it."""


def _sampler(req: Txt2ImgRequest) -> str | None:
    name = req.sampler_name or req.sampler_index
    if name is None:
        return None
    ours = _BY_NAME.get(name.lower())
    if ours is None:
        raise InvalidRequestError(f"unknown sampler {name!r}; available: {list(SAMPLERS)}", param="sampler_name")
    if req.scheduler not in (None, "", "Automatic", "automatic"):
        raise InvalidRequestError(f"scheduler {req.scheduler!r} is not supported (only Automatic)", param="scheduler")
    return ours


def _openai_request(req: Txt2ImgRequest, seed: int) -> ImageGenerationRequest:
    """The A1111 fields as the one request model the service validates (size built from the integers)."""
    size = f"{req.width}x{req.height}" if req.width is not None and req.height is not None else None
    return ImageGenerationRequest.model_construct(
        prompt=req.prompt, negative_prompt=req.negative_prompt, n=req.batch_size, size=size, seed=seed % 2**32,
        steps=req.steps, guidance_scale=req.cfg_scale, scheduler=_sampler(req), response_format="b64_json",
        model=None, user=None, quality=None, style=None)


@router.post("/txt2img", response_model=Txt2ImgResponse)
async def txt2img(req: Txt2ImgRequest, request: Request, response: Response) -> Txt2ImgResponse:
    """batch_size images per iteration, n_iter iterations; image i uses seed + i."""
    service = request.app.state.service
    service.require_ready()
    req.refuse_unsupported()
    max_n = request.app.state.settings.limits.max_n
    for name, value in (("batch_size", req.batch_size), ("n_iter", req.n_iter)):
        if value > max_n:
            raise InvalidRequestError(f"{name} must be at most {max_n}, got {value}", param=name)
    if (req.width is None) != (req.height is None):
        raise InvalidRequestError("give both width and height, or neither", param="width")
    seed = req.seed if req.seed >= 0 else secrets.randbelow(2**32 - 1024)
    batches = [service.to_batch(_openai_request(req, seed + i * req.batch_size)) for i in range(req.n_iter)]
    timeout = request.headers.get("x-sdserve-timeout-s")
    outs = await asyncio.gather(*(service.run(b, timeout, request.is_disconnected) for b in batches))
    outs[-1].trace_headers(response)
    warnings = outs[0].warnings
    first = batches[0]
    seeds = [g.seed for out in outs for g in out.result.images]
    info = {"prompt": req.prompt, "negative_prompt": req.negative_prompt, "seed": seeds[0], "all_seeds": seeds,
            "all_prompts": [req.prompt] * len(seeds), "width": first.width, "height": first.height,
            "sampler_name": next(k for k, v in SAMPLERS.items() if v[0] == first.scheduler), "cfg_scale":
            first.images[0].guidance_scale, "steps": first.steps, "batch_size": req.batch_size, "n_iter": req.n_iter,
            "sd_model_name": request.app.state.engine.info.name, "warnings": warnings}
    return Txt2ImgResponse(images=[b64(p) for out in outs for p in out.pngs],
                           parameters=req.model_dump(), info=json.dumps(info))


@router.get("/samplers")
async def samplers() -> list[dict[str, Any]]:
    return [{"name": name, "aliases": list(aliases), "options": {}} for name, (_, aliases) in SAMPLERS.items()]


@router.get("/scripts")
async def scripts() -> dict[str, list[str]]:
    """No A1111 scripts or extensions are available (clients probe this)."""
    return {"txt2img": [], "img2img": []}


@router.get("/sd-models")
async def sd_models(request: Request) -> list[dict[str, Any]]:
    info = request.app.state.engine.info
    short = info.digest[:10] if info.digest else ""
    return [{"title": f"{info.name} [{short}]" if short else info.name, "model_name": info.name, "hash": short,
             "sha256": info.digest, "filename": info.name, "config": None}]
