"""Probes and the capability snapshot."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)
router = APIRouter(tags=["probes"])


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: 200 whenever the process can answer."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only when the model is loaded and proven; 503 with the state and reasons otherwise."""
    state = request.app.state.server_state
    body = {"state": state.state, "reasons": state.reasons}
    return JSONResponse(body, status_code=200 if state.ready else 503)


@router.get("/capabilities")
async def capabilities(request: Request) -> dict[str, Any]:
    """The capability snapshot, with the serving state and its history."""
    caps = request.app.state.engine.capabilities()
    extra: dict[str, Any] = {"profile": request.app.state.settings.profile,
                             "server": request.app.state.server_state.snapshot(),
                             "watchdog": request.app.state.watchdog.snapshot()}
    if not caps.accelerated:
        extra["warning"] = "NOT ACCELERATED: " + "; ".join(caps.verdict.reasons[:3])
        log.warning("capabilities read: %s", extra["warning"])
    return {**caps.model_dump(mode="json"), **extra}
