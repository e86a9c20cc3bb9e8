"""Slowness, told apart from a broken fast path.

The canary's per-step time against its boot baseline says how slow this replica is right now; the contention
observed over the same window (server/contention.py) says whether the node's load explains it.
Load is shared by every replica on a node, so a load-driven flip empties the Service at peak: slowness is
reported (/ready's ``load``, /performance, metrics) and alerted, and removes a replica only where the profile asks
(``watchdog.latency_unready = "corroborated"``) and it is corroborated: at least ``unready_drift_factor`` x
baseline for ``drift_consecutive`` checks in a row with no contention observed in any of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engines.types.health import CanaryCheck
from server.contention import Contention, ContentionThresholds, explanations
from server.settings import WatchdogSettings


def thresholds(cfg: WatchdogSettings) -> ContentionThresholds:
    return ContentionThresholds(cfg.contention_cpu_pressure_percent, cfg.contention_steal_percent,
                                cfg.contention_load_per_cpu)


@dataclass
class Slowness:
    """The running assessment; ``observe`` once per canary, ``note_contention`` once per watchdog check."""

    cfg: WatchdogSettings
    slow_streak: int = 0
    """Canaries in a row over ``drift_factor``."""
    hard_streak: int = 0
    """Canaries in a row over ``unready_drift_factor`` with no contention observed."""
    ratio: float | None = None
    per_step_s: float | None = None
    baseline_per_step_s: float | None = None
    contention: Contention | None = None
    explained_by: list[str] = field(default_factory=list)

    def note_contention(self, contention: Contention) -> None:
        self.contention = contention
        self.explained_by = explanations(contention, thresholds(self.cfg))

    def observe(self, result: CanaryCheck, canary_window: Contention | None) -> str | None:
        """Update the streaks with one canary; returns the unready reason when slowness is corroborated."""
        self.ratio = result.seconds / result.baseline_s if result.baseline_s > 0 else 1.0
        steps = max(1, result.steps)
        self.per_step_s, self.baseline_per_step_s = result.seconds / steps, result.baseline_s / steps
        explained = list(self.explained_by)
        if canary_window is not None:
            explained += [e for e in explanations(canary_window, thresholds(self.cfg)) if e not in explained]
            self.explained_by = explained
        self.slow_streak = self.slow_streak + 1 if self.ratio > self.cfg.drift_factor else 0
        hard = self.ratio >= self.cfg.unready_drift_factor and not explained
        self.hard_streak = self.hard_streak + 1 if hard else 0
        if self.cfg.latency_unready == "corroborated" and self.hard_streak >= self.cfg.drift_consecutive:
            return (f"latency drift: canary {result.shape} {self.per_step_s * 1000:.1f} ms/step vs boot "
                    f"{self.baseline_per_step_s * 1000:.1f} ms/step (x{self.ratio:.1f} >= "
                    f"x{self.cfg.unready_drift_factor}) for {self.hard_streak} consecutive checks, no contention "
                    "observed on the node")
        return None

    @property
    def slow(self) -> bool:
        return self.slow_streak >= self.cfg.drift_consecutive

    @property
    def contended(self) -> bool:
        return bool(self.explained_by)

    def report(self) -> dict[str, Any]:
        """What /ready's ``load`` and /performance show: slow or not, why, and whether it may flip readiness."""
        return {"slow": self.slow, "slowdown_ratio": None if self.ratio is None else round(self.ratio, 2),
                "canary_ms_per_step": _ms(self.per_step_s), "baseline_ms_per_step": _ms(self.baseline_per_step_s),
                "contended": self.contended, "explained_by": list(self.explained_by),
                "contention": self.contention.as_dict() if self.contention else None,
                "latency_unready": self.cfg.latency_unready, "drift_factor": self.cfg.drift_factor,
                "unready_drift_factor": self.cfg.unready_drift_factor}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
