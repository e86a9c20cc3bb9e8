"""Probes and the capability snapshot. /health and /ready are unauthenticated: they say the state, reason codes and
short reasons (no filesystem paths); the details are in /capabilities, behind the key when auth is on."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from server.schemas import error_responses

log = logging.getLogger(__name__)
router = APIRouter(tags=["probes"])


class HealthResponse(BaseModel):
    status: str


class ReadyResponse(BaseModel):
    state: str
    codes: list[str]
    """Machine-readable reasons: the watchdog's (latency_drift, model_files, ...) or a failed boot's exit code."""
    reasons: list[str]
    load: dict[str, Any] | None = None
    """Slowness and the contention observed on the node (reported; a flip needs evidence, see docs/operating.md)."""


@router.get("/health", response_model=HealthResponse)
@router.head("/health", response_model=HealthResponse, description="Liveness without a body (HEAD).")
async def health() -> dict[str, str]:
    """Liveness: 200 whenever the process can answer."""
    return {"status": "ok"}


@router.get("/ready", response_model=ReadyResponse,
            responses={503: {"model": ReadyResponse, "description": "not ready: booting, degraded, draining, failed"}})
@router.head("/ready", response_model=ReadyResponse, description="Readiness as a status code only (HEAD).",
             responses={503: {"model": ReadyResponse, "description": "not ready: booting, degraded, draining, failed"}})
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only when the model is loaded and proven; 503 with the state and reasons otherwise."""
    state = request.app.state.server_state
    if state.state == "degraded":
        codes = list(request.app.state.watchdog.active)
    else:
        codes = state.codes or ([] if state.ready else [state.state])
    body = {"state": state.state, "codes": codes, "reasons": state.reasons, "load": request.app.state.watchdog.load}
    return JSONResponse(body, status_code=200 if state.ready else 503)


@router.get("/capabilities", responses=error_responses(401))
async def capabilities(request: Request) -> dict[str, Any]:
    """The capability snapshot, with the serving state and its history."""
    caps = request.app.state.engine.capabilities()
    extra: dict[str, Any] = {"profile": request.app.state.settings.profile,
                             "server": request.app.state.server_state.snapshot(),
                             "watchdog": request.app.state.watchdog.snapshot(),
                             "provenance": request.app.state.service.provenance.snapshot(),
                             "step_cache": request.app.state.service.caching.snapshot(),
                             "tenants": request.app.state.tenants.snapshot()}
    if not caps.accelerated:
        extra["warning"] = "NOT ACCELERATED: " + "; ".join(caps.verdict.reasons[:3])
        log.warning("capabilities read: %s", extra["warning"])
    return {**caps.model_dump(mode="json"), **extra}
