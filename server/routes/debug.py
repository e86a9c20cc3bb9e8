"""Fault injection (mounted only when the dev profile sets debug.fault_injection): latency added to every batch,
and a GPU telemetry trace the watchdog reads instead of NVML."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engines.protocol import GpuSample
from server.watchdog import TraceTelemetry

router = APIRouter(prefix="/debug", tags=["debug"])


class TraceSample(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sm_percent: float = Field(..., ge=0, le=100)
    memory_percent: float = Field(..., ge=0, le=100)
    power_w: float = Field(..., ge=0)
    power_limit_w: float = Field(..., gt=0)


class Faults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(0.0, ge=0, le=60, description="Seconds added to every batch; 0 removes it.")
    telemetry_trace: list[TraceSample] | None = Field(None, description="Replayed GPU samples; null removes it.")


@router.put("/faults")
async def set_faults(faults: Faults, request: Request) -> dict[str, Any]:
    request.app.state.faults.latency_s = faults.latency_s
    trace = [GpuSample(s.sm_percent, s.memory_percent, s.power_w, s.power_limit_w)
             for s in faults.telemetry_trace or []]
    request.app.state.watchdog.injected = TraceTelemetry(trace) if trace else None
    return {"latency_s": faults.latency_s, "telemetry_trace": len(trace)}
