"""The engine's health evidence: canary fingerprints and watchdog checks, fault injection, GPU telemetry samples and
the signature a window of them shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

THUMB = 8
"""Canary fingerprints are THUMB x THUMB block means."""


def fingerprint(image: np.ndarray) -> np.ndarray:
    """8x8 block means of an HxWx3 uint8 image, in pixel units (0..255): the canary fingerprint that selftest.json
    records, the watchdog compares and `sdserve gate` compares across rollouts."""
    h, w = image.shape[:2]
    rows, cols = np.linspace(0, h, THUMB + 1).astype(int), np.linspace(0, w, THUMB + 1).astype(int)
    pixels = image.astype(np.float64)
    return np.array([[pixels[rows[i]:rows[i + 1], cols[j]:cols[j + 1]].mean(axis=(0, 1)) for j in range(THUMB)]
                     for i in range(THUMB)])


@dataclass(frozen=True)
class CanaryCheck:
    """One watchdog canary: its latency against the boot baseline, its output against the boot output."""

    shape: str
    seconds: float
    baseline_s: float
    distance: float
    tolerance: float
    problem: str | None = None
    steps: int = 0
    """Denoising steps the canary ran (its per-step time is seconds / steps)."""
    provider: str = ""
    """The provider the canary's batch reported (a change since boot is evidence, not load)."""


@dataclass
class Faults:
    """Fault injection behind an explicit interface (never monkey-patching): created only when the dev profile sets
    ``debug.fault_injection``, so production cannot be slowed down by a request."""

    latency_s: float = 0.0
    """Extra seconds added to every batch, inside the execution lock (a slow GPU, as the server sees it)."""
    output_shift: float = 0.0
    """Pixel units added to the canary's output (a fast path that computes something else: fingerprint drift)."""
    nan_canary: bool = False
    """The canary's decode yields NaN/inf (refused as the pipeline refuses it)."""
    provider: str = ""
    """Reported in place of the session's provider (a provider that changed under the server); empty: none."""
    step_latency_s: float = 0.0
    """Extra seconds added to every denoiser tick of step-level batching, inside the execution lock (a slow
    denoiser: requests arriving meanwhile join the running ones at the next boundary)."""


@dataclass(frozen=True)
class GpuSample:
    sm_percent: float
    """SM (kernel) utilization, %."""
    memory_percent: float
    """Memory-controller utilization, %."""
    power_w: float
    power_limit_w: float
    memory_used_bytes: int = 0
    memory_total_bytes: int = 0
    """The device's memory (0: unknown): with ``memory_used_bytes``, what is free (admission's device budget)."""


class TelemetrySource(Protocol):
    def sample(self, device_index: int) -> GpuSample: ...


SignatureVerdict = Literal["idle", "healthy_compute", "memory_bound", "livelock", "fallback_suspected", "inconclusive"]


@dataclass(frozen=True)
class Signature:
    """The GPU signature over a window of samples: computing, spinning, idle or CPU fallback."""

    verdict: SignatureVerdict
    reason: str
    sm_percent: float
    memory_percent: float
    power_w: float
