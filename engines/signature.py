"""The GPU signature classifier: tells computing from spinning from idle from CPU fallback.

A pure function of NVML readings and thresholds (from config), so `sdserve doctor --watch` and the runtime
watchdog share it. The field's numbers: livelock reads SM 96-99%, memory controller 0-1%, ~38 W on a card whose
healthy work on the same model reads memory 18-41% and 115-143 W.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engines.telemetry import GpuSample

Verdict = Literal["idle", "healthy_compute", "memory_bound", "livelock", "fallback_suspected", "inconclusive"]


class SignatureThresholds(BaseModel):
    """Thresholds of the classifier (``[signature]`` in a profile)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    busy_sm_percent: float = Field(95.0, ge=0, le=100)
    """SM utilization at or above which the card counts as fully busy."""
    livelock_max_memory_percent: float = Field(2.0, ge=0, le=100)
    """Busy SMs with the memory controller at or below this are not doing real work."""
    livelock_max_power_fraction: float = Field(0.5, gt=0, le=1)
    """...and drawing at most this fraction of the healthy working power."""
    working_power_w: float | None = Field(None, gt=0)
    """Healthy working draw of this card under this model; default: 40% of the enforced power limit."""
    idle_sm_percent: float = Field(10.0, ge=0, le=100)
    """At or below: the GPU is doing (almost) nothing."""
    memory_bound_percent: float = Field(60.0, ge=0, le=100)
    """Memory controller at or above this while SMs are below busy: memory-bound work."""


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    reason: str
    sm_percent: float
    memory_percent: float
    power_w: float


def classify(samples: Sequence[GpuSample], requests_running: bool,
             thresholds: SignatureThresholds | None = None) -> Classification:
    """Median readings over ``samples`` -> a verdict with the numbers that decided it."""
    t = thresholds or SignatureThresholds()
    if not samples:
        return Classification("inconclusive", "no samples", 0.0, 0.0, 0.0)
    sm = statistics.median(s.sm_percent for s in samples)
    mem = statistics.median(s.memory_percent for s in samples)
    power = statistics.median(s.power_w for s in samples)
    limit = statistics.median(s.power_limit_w for s in samples)
    working = t.working_power_w or 0.4 * limit
    numbers = f"SM {sm:.0f}%, memory controller {mem:.0f}%, {power:.0f} W"
    if sm >= t.busy_sm_percent and mem <= t.livelock_max_memory_percent \
            and power <= t.livelock_max_power_fraction * working:
        return Classification("livelock", f"livelock signature: {numbers} (busy SMs moving no memory, "
                              f"power under {t.livelock_max_power_fraction * working:.0f} W)", sm, mem, power)
    if sm <= t.idle_sm_percent:
        if requests_running:
            return Classification("fallback_suspected", f"GPU idle while requests run: {numbers} "
                                  "(work is running somewhere else: CPU fallback suspected)", sm, mem, power)
        return Classification("idle", f"idle: {numbers}", sm, mem, power)
    if mem >= t.memory_bound_percent and sm < t.busy_sm_percent:
        return Classification("memory_bound", f"memory-bound: {numbers}", sm, mem, power)
    return Classification("healthy_compute", f"healthy compute: {numbers}", sm, mem, power)
