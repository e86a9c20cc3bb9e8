"""Fault injection (mounted only when the dev profile sets debug.fault_injection): latency added to every batch,
a GPU telemetry trace the watchdog reads instead of NVML, drifted or NaN canary output and a changed provider."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engines.types.health import GpuSample
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
    output_shift: float = Field(0.0, ge=-255, le=255, description="Pixel units added to the canary's output "
                                "(fingerprint drift); 0 removes it.")
    nan_canary: bool = Field(False, description="The canary's decode yields NaN/inf.")
    provider: str = Field("", max_length=64, description="Provider reported in place of the session's; empty "
                          "removes it.")
    step_latency_s: float = Field(0.0, ge=0, le=60, description="Seconds added to every denoiser tick of "
                                  "step-level batching; 0 removes it.")


@router.put("/faults")
async def set_faults(faults: Faults, request: Request) -> dict[str, Any]:
    injected = request.app.state.faults
    injected.latency_s, injected.output_shift = faults.latency_s, faults.output_shift
    injected.nan_canary, injected.provider = faults.nan_canary, faults.provider
    injected.step_latency_s = faults.step_latency_s
    trace = [GpuSample(s.sm_percent, s.memory_percent, s.power_w, s.power_limit_w)
             for s in faults.telemetry_trace or []]
    request.app.state.watchdog.injected = TraceTelemetry(trace) if trace else None
    return {**faults.model_dump(exclude={"telemetry_trace"}), "telemetry_trace": len(trace)}
