"""Fault injection behind an explicit interface (never monkey-patching): created only when the profile allows it
(the dev profile's ``debug.fault_injection``), so production cannot be slowed down by a request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaultInjector:
    latency_s: float = 0.0
    """Extra seconds added to every batch, inside the execution lock (a slow GPU, as the server sees it)."""
