"""The adapter library on A1111's routes: ``GET /sdapi/v1/loras`` (A1111's shape: name, alias, path, metadata) and
``POST /sdapi/v1/refresh-loras`` (scan the folder again). Paths are relative to the library folder; files the
server refuses (pickle, truncated, oversized header, another family's LoRA) are listed with ``problem``, so an
operator sees why a name does not work.

Neither route works on the event loop: a listing can be tens of MB (every file's metadata), so its JSON (and its
gzip form, sent to clients that accept it) is built in a worker thread once per scan and the bytes are reused until
the next one; requests arriving while it is built wait for that build without a thread each (issue 57: 16 clients
x 3 listings took 5.3 s each and held /health over 1 s); a refresh runs in a worker thread,
and concurrent refreshes share one: a caller that arrives while one runs waits (without a thread) and gets the
result of the next, so a flood of refreshes holds at most one worker thread and runs at most two scans.

Tenants (issue 52 point 4): the library is one, shared by every tenant. Its listing is read-only and open to all; a
refresh changes what every tenant sees, so it is a tenant's right only where its config says so
(``lora_refresh = true``, server/tenant_config.py; without auth, everyone's), else 403 naming the setting."""

from __future__ import annotations

import asyncio
import gzip
import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import Response

from engines.protocol import Engine
from engines.types.model import LoraInfo
from server.middleware import tenant_label
from server.tenants import TenantRegistry

router = APIRouter(prefix="/sdapi/v1", tags=["automatic1111"])
LISTED: dict[int | str, dict[str, Any]] = {200: {
    "content": {"application/json": {"schema": {"type": "array", "items": {"type": "object"}}}},
    "description": "Every file of the library: name, alias, path, metadata, sha256, size, components, problem"}}


def _a1111(f: LoraInfo) -> dict[str, Any]:
    return {"name": f.name, "alias": f.alias, "path": f.path, "metadata": f.metadata, "sha256": f.sha256,
            "size": f.size, "components": f.components, "problem": f.problem or None}


def build(files: tuple[LoraInfo, ...]) -> tuple[bytes, bytes]:
    """(JSON, its gzip) of the listing of ``files`` (run in a worker thread)."""
    # one item at a time: a worker thread gives the GIL back between items, never for one long dump;
    # ASCII escapes: a file's metadata may hold lone surrogates ("\ud800" in its JSON), never UTF-8
    body = b"[" + b",".join(json.dumps(_a1111(f)).encode() for f in files) + b"]"
    return body, gzip.compress(body, compresslevel=6, mtime=0)


class Listing:
    """The listing's bytes, built once per scan: keyed by the scan's tuple (the engine hands out a new one per
    scan), built in a worker thread by the first request that finds it stale, while later ones wait on the
    event loop (no thread each) and take the same bytes."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._for: tuple[LoraInfo, ...] | None = None
        self._bodies = (b"[]", gzip.compress(b"[]", mtime=0))
        self.builds = 0
        """Listings built so far (one per scan however many requests ask)."""

    async def body(self, files: tuple[LoraInfo, ...]) -> tuple[bytes, bytes]:
        """(JSON, gzip) of the listing of ``files``."""
        async with self._lock:
            if files is not self._for:
                self.builds += 1
                self._bodies = await run_in_threadpool(build, files)
                self._for = files
            return self._bodies


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


def may_refresh(registry: TenantRegistry | None, label: str) -> str | None:
    """None when tenant ``label`` may rescan the library, else why not (the 403's message, naming the setting)."""
    if registry is None or not registry.enabled:
        return None
    tenants = registry.current
    config = tenants.by_label.get(label)
    if config is not None:
        return None if config.lora_refresh else (
            f"tenant {label!r} may not rescan the LoRA library (shared by every tenant): its [[auth.tenants]] entry "
            "needs lora_refresh = true; GET /sdapi/v1/loras stays readable")
    if not any(t.digests for t in tenants.tenants):
        return None  # auth with keys but no tenants: one trust domain, as before tenants
    return ("this key is in no tenant and may not rescan the LoRA library (shared by every tenant): only tenants "
            "with lora_refresh = true in their [[auth.tenants]] entry may; GET /sdapi/v1/loras stays readable")


def _reply(request: Request, bodies: tuple[bytes, bytes]) -> Response:
    """The listing, gzip-encoded for a client that accepts it (a tenth of the bytes to write)."""
    if "gzip" in request.headers.get("accept-encoding", "").lower():
        return Response(bodies[1], media_type="application/json",
                        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return Response(bodies[0], media_type="application/json", headers={"Vary": "Accept-Encoding"})


@router.get("/loras", responses=LISTED)
async def loras(request: Request) -> Response:
    """Every LoRA file of the library ([runtime.lora] dir), usable or not (``problem``)."""
    listing, _ = _state(request)
    return _reply(request, await listing.body(request.app.state.engine.loras()))


@router.post("/refresh-loras", responses={**LISTED, 403: {"description": "The tenant may not rescan the "
                                                                          "library (lora_refresh)"}})
async def refresh_loras(request: Request) -> Response:
    """Scan the library again (new and changed files hashed off the event loop, unchanged ones kept); answers
    the new listing (A1111 answers null, which clients ignore). 403 for a tenant without ``lora_refresh``."""
    refused = may_refresh(getattr(request.app.state, "tenants", None), tenant_label(request.scope))
    if refused is not None:
        raise HTTPException(403, refused)
    listing, refresher = _state(request)
    found = await refresher(request.app.state.engine)
    return _reply(request, await listing.body(found))
