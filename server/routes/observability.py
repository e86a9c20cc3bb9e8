"""/metrics and /performance: never shed, never behind auth."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["observability"])


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus exposition."""
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/performance")
async def performance(request: Request) -> dict[str, Any]:
    """Boot baseline per canary shape (p50/p95 vs budget, GPU utilization vs floor), live p50/p95 per shape,
    images/min and drift against the baseline."""
    report = request.app.state.engine.capabilities().self_test
    baseline = [{"shape": s.shape, "p50_s": s.p50_s, "p95_s": s.p95_s, "budget_s": s.budget_s,
                 "gpu_util_percent": s.gpu_util_percent, "gpu_util_floor": s.gpu_util_floor}
                for s in (report.shapes if report else ())]
    performance: dict[str, Any] = request.app.state.service.performance(baseline)
    return performance
