"""The GPU signature classifier: tells computing from spinning from idle from CPU fallback.

A pure function of NVML readings and thresholds (from config), so `sdserve doctor --watch` and the runtime
watchdog share it. The field's numbers: livelock reads SM 96-99%, memory controller 0-1%, ~38 W on a card whose
healthy work on the same model reads memory 18-41% and 115-143 W.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from engines.config import SignatureThresholds
from engines.types.health import GpuSample, Signature


def classify(samples: Sequence[GpuSample], requests_running: bool,
             thresholds: SignatureThresholds | None = None) -> Signature:
    """Median readings over ``samples`` -> a verdict with the numbers that decided it."""
    t = thresholds or SignatureThresholds()
    if not samples:
        return Signature("inconclusive", "no samples", 0.0, 0.0, 0.0)
    sm = statistics.median(s.sm_percent for s in samples)
    mem = statistics.median(s.memory_percent for s in samples)
    power = statistics.median(s.power_w for s in samples)
    limit = statistics.median(s.power_limit_w for s in samples)
    working = t.working_power_w or 0.4 * limit
    numbers = f"SM {sm:.0f}%, memory controller {mem:.0f}%, {power:.0f} W"
    if sm >= t.busy_sm_percent and mem <= t.livelock_max_memory_percent \
            and power <= t.livelock_max_power_fraction * working:
        return Signature("livelock", f"livelock signature: {numbers} (busy SMs moving no memory, "
                              f"power under {t.livelock_max_power_fraction * working:.0f} W)", sm, mem, power)
    if sm <= t.idle_sm_percent:
        if requests_running:
            return Signature("fallback_suspected", f"GPU idle while requests run: {numbers} "
                                  "(work is running somewhere else: CPU fallback suspected)", sm, mem, power)
        return Signature("idle", f"idle: {numbers}", sm, mem, power)
    if mem >= t.memory_bound_percent and sm < t.busy_sm_percent:
        return Signature("memory_bound", f"memory-bound: {numbers}", sm, mem, power)
    return Signature("healthy_compute", f"healthy compute: {numbers}", sm, mem, power)
