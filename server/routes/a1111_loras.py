"""The adapter library on A1111's routes: ``GET /sdapi/v1/loras`` (A1111's shape: name, alias, path, metadata) and
``POST /sdapi/v1/refresh-loras`` (scan the folder again). Paths are relative to the library folder; files the
server refuses (pickle, truncated, oversized header, another family's LoRA) are listed with ``problem``, so an
operator sees why a name does not work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from engines.protocol import LoraInfo

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])


def _a1111(f: LoraInfo) -> dict[str, Any]:
    return {"name": f.name, "alias": f.alias, "path": f.path, "metadata": f.metadata, "sha256": f.sha256,
            "size": f.size, "components": f.components, "problem": f.problem or None}


@router.get("/loras")
async def loras(request: Request) -> list[dict[str, Any]]:
    """Every LoRA file of the library ([runtime.lora] dir), usable or not (``problem``)."""
    return [_a1111(f) for f in request.app.state.engine.loras()]


@router.post("/refresh-loras")
async def refresh_loras(request: Request) -> list[dict[str, Any]]:
    """Scan the library again (hashing new and changed files off the event loop); answers the new listing
    (A1111 answers null, which clients ignore)."""
    found = await run_in_threadpool(request.app.state.engine.refresh_loras)
    return [_a1111(f) for f in found]
