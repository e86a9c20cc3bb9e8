"""The runtime watchdog: keeps proving the fast path after boot, and flips /ready to 503 with reasons when it
degrades (latency drift, output drift, the livelock/idle-GPU signature, new ORT error events); recovers after
``recover_after`` clean checks in a row."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import Engine, GpuSample, TelemetrySource
from server.metrics import Metrics
from server.service import ImageService
from server.settings import Settings
from server.state import ServerState

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, engine: Engine, service: ImageService, state: ServerState, settings: Settings,
                 metrics: Metrics) -> None:
        self.engine, self.service, self.state, self.settings = engine, service, state, settings
        self.metrics = metrics
        self._telemetry: TelemetrySource | None = None
        self._telemetry_opened = False
        self.injected: TelemetrySource | None = None
        """A telemetry trace injected through /debug/faults (dev only); replaces NVML while set."""
        self.active: dict[str, str] = {}
        self.strikes = 0
        self.clean = 0
        self.checks = 0
        self.last: dict[str, Any] = {}

    async def run(self) -> None:
        cfg = self.settings.watchdog
        while True:
            await asyncio.sleep(cfg.interval_s)
            if self.state.state not in ("ready", "degraded"):
                continue
            try:
                await self.check()
            except Exception:  # the watchdog must outlive any single failed check
                log.exception("watchdog check failed")

    async def check(self) -> None:
        problems: dict[str, str] = {}
        probed = await self._canary(problems)
        probed = await self._signature(problems) or probed
        probed = await self._files(problems) or probed
        self._ort_events(problems)
        self.checks += 1
        self._apply(problems, probed or bool(problems))

    async def _canary(self, problems: dict[str, str]) -> bool:
        cfg = self.settings.watchdog
        if self.service.busy or self.service.idle_for() < cfg.idle_before_canary_s:
            return False  # yield to real traffic
        async with self.service.lock:
            result = await run_in_threadpool(self.engine.canary)
        self.metrics.canary_seconds.observe(result.seconds)
        ratio = result.seconds / result.baseline_s if result.baseline_s > 0 else 1.0
        self.last["canary"] = {"shape": result.shape, "seconds": round(result.seconds, 4),
                               "baseline_s": round(result.baseline_s, 4), "ratio": round(ratio, 2),
                               "distance": result.distance}
        if result.problem:
            problems["canary_invalid"] = f"canary output invalid: {result.problem}"
        if result.distance > result.tolerance:
            problems["output_drift"] = (f"canary output drifted: fingerprint distance {result.distance:.1f} over "
                                        f"tolerance {result.tolerance}")
        self.strikes = self.strikes + 1 if ratio > cfg.drift_factor else 0
        if self.strikes >= cfg.drift_consecutive:
            problems["latency_drift"] = (f"latency drift: canary {result.shape} took {result.seconds:.3f}s vs boot "
                                         f"baseline {result.baseline_s:.3f}s (x{ratio:.1f} > x{cfg.drift_factor}) "
                                         f"for {self.strikes} consecutive checks")
        elif self.strikes and "latency_drift" in self.active:
            problems["latency_drift"] = self.active["latency_drift"]  # not yet clean
        return True

    @property
    def telemetry(self) -> TelemetrySource | None:
        """The engine's telemetry, opened on first use (after boot: preflight has proven NVML starts)."""
        if not self._telemetry_opened:
            self._telemetry, self._telemetry_opened = self.engine.telemetry(), True
        return self._telemetry

    async def _signature(self, problems: dict[str, str]) -> bool:
        source = self.injected or self.telemetry
        if source is None:
            return False
        samples: list[GpuSample] = []
        window, device = self.settings.watchdog.telemetry_window_s, self.settings.runtime.device_id
        for _ in range(max(1, int(window / 0.1))):
            samples.append(await run_in_threadpool(source.sample, device))
            await asyncio.sleep(0.1)
        latest = samples[-1]
        self.metrics.set_gpu(latest.sm_percent, latest.memory_percent, latest.power_w, latest.memory_used_bytes)
        result = self.engine.signature(samples, self.service.busy)
        self.last["signature"] = {"verdict": result.verdict, "reason": result.reason}
        if result.verdict in ("livelock", "fallback_suspected"):
            problems[result.verdict] = result.reason
        return True

    async def _files(self, problems: dict[str, str]) -> bool:
        """engine.check_health: a model file changed on disk since boot degrades /ready naming it."""
        try:
            await run_in_threadpool(self.engine.check_health)
        except NotReadyError as exc:
            problems["model_files"] = str(exc)
        return set(self.active) == {"model_files"}  # a clean result counts toward recovery only from this one

    def _ort_events(self, problems: dict[str, str]) -> None:
        for event in self.engine.ort_events():
            self.metrics.ort_events.labels(event.kind).inc()
            if event.severity == "error":
                problems["ort_event"] = f"ONNX Runtime after boot: {event.kind}: {event.line[:200]}"

    def _apply(self, problems: dict[str, str], conclusive: bool) -> None:
        if problems:
            self.clean = 0
            self.active.update(problems)
        elif conclusive and self.active:
            self.clean += 1
            if self.clean >= self.settings.watchdog.recover_after:
                log.warning("watchdog: recovered after %d clean checks", self.clean)
                self.active.clear()
        if self.active and self.state.state != "degraded":
            log.error("watchdog: degraded: %s", "; ".join(self.active.values()))
            self.state.set("degraded", list(self.active.values()))
        elif self.active and self.state.reasons != list(self.active.values()):
            self.state.set("degraded", list(self.active.values()))
        elif not self.active and self.state.state == "degraded":
            self.state.set("ready", self.state_reasons_when_ready())
        self.metrics.set_degraded(set(self.active))
        self.metrics.ready.set(1 if self.state.ready else 0)

    def state_reasons_when_ready(self) -> list[str]:
        return ["accelerated: false (dev profile, CPU allowed)"] if self.settings.runtime.allow_cpu else []

    def snapshot(self) -> dict[str, Any]:
        cfg = self.settings.watchdog
        return {"enabled": cfg.enabled, "interval_s": cfg.interval_s, "checks": self.checks,
                "active": dict(self.active), "strikes": self.strikes, "clean_streak": self.clean,
                "telemetry": "injected trace" if self.injected else ("nvml" if self._telemetry else "none"),
                "last": self.last}


class TraceTelemetry:
    """Replays recorded samples in a loop: fault injection for the watchdog, and offline analysis."""

    def __init__(self, samples: list[GpuSample]) -> None:
        if not samples:
            raise ValueError("a telemetry trace needs at least one sample")
        self._samples = samples
        self._next = 0

    def sample(self, device_index: int) -> GpuSample:
        value = self._samples[self._next % len(self._samples)]
        self._next += 1
        return value
