"""The adapter library on A1111's routes: ``GET /sdapi/v1/loras`` (A1111's shape: name, alias, path, metadata) and
``POST /sdapi/v1/refresh-loras`` (scan the folder again). Paths are relative to the library folder; files the
server refuses (pickle, truncated, oversized header, another family's LoRA) are listed with ``problem``, so an
operator sees why a name does not work.

Neither route works on the event loop: a listing can be tens of MB (every file's metadata), so its JSON is built
in a worker thread once per scan and the bytes are reused until the next one; a refresh runs in a worker thread,
and concurrent refreshes share one: a caller that arrives while one runs waits (without a thread) and gets the
result of the next, so a flood of refreshes holds at most one worker thread and runs at most two scans."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from engines.protocol import Engine
from engines.types.model import LoraInfo

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])
LISTED: dict[int | str, dict[str, Any]] = {200: {
    "content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}},
    "description": "Every file of the library: name, alias, path, metadata, sha256, size, components, problem"}}


def _a1111(f: LoraInfo) -> dict[str, Any]:
    return {"name": f.name, "alias": f.alias, "path": f.path, "metadata": f.metadata, "sha256": f.sha256,
            "size": f.size, "components": f.components, "problem": f.problem or None}


class Listing:
    """The listing's JSON bytes, built once per scan (the engine hands out a new tuple per scan)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._for: tuple[LoraInfo, ...] | None = None
        self._body = b"[]"

    def body(self, files: tuple[LoraInfo, ...]) -> bytes:
        with self._lock:
            if files is not self._for:
                # one item at a time: a worker thread gives the GIL back between items, never for one long dump;
                # ASCII escapes: a file's metadata may hold lone surrogates ("\ud800" in its JSON), never UTF-8
                self._body = b"[" + b",".join(json.dumps(_a1111(f)).encode() for f in files) + b"]"
                self._for = files
            return self._body


class Refresher:
    """Concurrent refreshes coalesced (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._asked = self._done = 0
        self._result: tuple[LoraInfo, ...] = ()

    async def __call__(self, engine: Engine) -> tuple[LoraInfo, ...]:
        self._asked += 1
        ticket = self._asked
        async with self._lock:
            if self._done < ticket:
                covers = self._asked  # every caller so far asked before this scan starts
                self._result = await run_in_threadpool(engine.refresh_loras)
                self._done = covers
            return self._result


def _state(request: Request) -> tuple[Listing, Refresher]:
    state = request.app.state
    if getattr(state, "lora_routes", None) is None:
        state.lora_routes = (Listing(), Refresher())
    pair: tuple[Listing, Refresher] = state.lora_routes
    return pair


@router.get("/loras", responses=LISTED)
async def loras(request: Request) -> Response:
    """Every LoRA file of the library ([runtime.lora] dir), usable or not (``problem``)."""
    listing, _ = _state(request)
    engine = request.app.state.engine
    body = await run_in_threadpool(lambda: listing.body(engine.loras()))
    return Response(body, media_type="application/json")


@router.post("/refresh-loras", responses=LISTED)
async def refresh_loras(request: Request) -> Response:
    """Scan the library again (new and changed files hashed off the event loop, unchanged ones kept); answers
    the new listing (A1111 answers null, which clients ignore)."""
    listing, refresher = _state(request)
    found = await refresher(request.app.state.engine)
    body = await run_in_threadpool(listing.body, found)
    return Response(body, media_type="application/json")
