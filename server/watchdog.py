"""The runtime watchdog: keeps proving the fast path after boot, and flips /ready to 503 with reasons on evidence
that this replica's fast path broke (provider changed, output drift or an invalid canary, the livelock/idle-GPU
signature, new ORT error events, model files changed); recovers after ``recover_after`` clean checks in a row.
Slowness is measured per step and reported with the contention seen on the node (server/slowness.py); it flips
/ready only where the profile asks and nothing on the node explains it."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError, SdserveError
from engines.protocol import Engine
from engines.types.health import GpuSample, TelemetrySource
from server.contention import ContentionProbe, Counters
from server.metrics import Metrics
from server.service import ImageService
from server.settings import Settings
from server.slowness import Slowness
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
        self.since: dict[str, int] = {}
        """The check (its number) that first found each active problem."""
        self.clean = 0
        self.skipped = 0
        self.boot_provider = ""
        self.last_canary_provider = ""
        self.slowness = Slowness(settings.watchdog)
        self.probe = ContentionProbe(self._gpu_processes)
        self._counters: Counters | None = None
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
        self._contention()
        probed = await self._canary(problems)
        probed = self._provider(problems) or probed
        probed = await self._signature(problems) or probed
        probed = await self._files(problems) or probed
        self._ort_events(problems)
        self.checks += 1
        self._apply(problems, probed or bool(problems))
        self._load_metrics()

    def expect_provider(self, provider: str) -> None:
        """The provider the self-test proved (boot): any other one reported later is evidence, not load."""
        self.boot_provider = provider

    def _provider(self, problems: dict[str, str]) -> bool:
        if not self.boot_provider:
            return False
        # what ran since the previous check only: a stale provider must not keep a recovered replica degraded
        seen = {p for p in (self.last_canary_provider, self.service.batcher.last_provider) if p}
        self.last_canary_provider = self.service.batcher.last_provider = ""
        changed = sorted(p for p in seen if p != self.boot_provider)
        if changed:
            problems["provider_changed"] = (f"provider changed since boot: {', '.join(changed)} runs the UNet, the "
                                            f"self-test proved {self.boot_provider}")
        return bool(seen)

    def _contention(self) -> None:
        """Contention since the previous check (the whole interval, traffic included)."""
        start, self._counters = self._counters, self.probe.read()
        if start is not None:
            self.slowness.note_contention(self.probe.since(start))

    async def _canary(self, problems: dict[str, str]) -> bool:
        cfg = self.settings.watchdog
        if (self.service.busy or self.service.idle_for() < cfg.idle_before_canary_s) \
                and self.skipped < cfg.canary_max_skips:
            self.skipped += 1
            return False  # yield to real traffic (at most canary_max_skips checks in a row)
        self.skipped = 0
        async with self.service.lock:
            start = self.probe.read()
            try:
                result = await run_in_threadpool(self.engine.canary)
            except SdserveError as exc:  # e.g. the pipeline refusing NaN/inf output: the canary is invalid
                problems["canary_invalid"] = f"canary failed: {str(exc)[:200]}"
                return True
            window = self.probe.since(start)
        self.metrics.canary_seconds.observe(result.seconds)
        self.last_canary_provider = result.provider
        self.last["canary"] = {"shape": result.shape, "seconds": round(result.seconds, 4),
                               "baseline_s": round(result.baseline_s, 4), "steps": result.steps,
                               "ratio": round(result.seconds / result.baseline_s, 2) if result.baseline_s else None,
                               "distance": result.distance, "contention": window.as_dict()}
        if result.problem:
            problems["canary_invalid"] = f"canary output invalid: {result.problem}"
        if result.distance > result.tolerance:
            problems["output_drift"] = (f"canary output drifted: fingerprint distance {result.distance:.1f} over "
                                        f"tolerance {result.tolerance}")
        drift = self.slowness.observe(result, window)
        if drift:
            problems["latency_drift"] = drift
        elif self.slowness.hard_streak and "latency_drift" in self.active:
            problems["latency_drift"] = self.active["latency_drift"]  # not yet clean
        return True

    def _load_metrics(self) -> None:
        m, sl = self.metrics, self.slowness
        m.slowdown.set(sl.ratio if sl.ratio is not None else math.nan)
        m.slow.set(1 if sl.slow else 0)
        m.contention.set(1 if sl.contended else 0)
        c = sl.contention
        if c is not None:
            for gauge, value in ((m.cpu_pressure, c.cpu_pressure_percent), (m.cpu_steal, c.steal_percent),
                                 (m.load_per_cpu, c.load_per_cpu)):
                gauge.set(math.nan if value is None else value)
            m.gpu_others.labels(m.gpu).set(math.nan if c.gpu_other_processes is None else c.gpu_other_processes)

    @property
    def load(self) -> dict[str, Any]:
        """Slowness and contention as /ready's ``load`` and /performance report them."""
        return {**self.slowness.report(), "checks": self.checks}

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

    def _gpu_processes(self) -> int | None:
        others = getattr(self.telemetry, "other_processes", None)
        return int(others(self.settings.runtime.device_id)) if callable(others) else None

    def _ort_events(self, problems: dict[str, str]) -> None:
        for event in self.engine.ort_events():
            self.metrics.ort_events.labels(event.kind).inc()
            if event.severity == "error":
                problems["ort_event"] = f"ONNX Runtime after boot: {event.kind}: {event.line[:200]}"

    def _apply(self, problems: dict[str, str], conclusive: bool) -> None:
        if problems:
            self.clean = 0
            for code in problems.keys() - self.active.keys():
                self.since[code] = self.checks
            self.active.update(problems)
        elif conclusive and self.active:
            self.clean += 1
            if self.clean >= self.settings.watchdog.recover_after:
                log.warning("watchdog: recovered after %d clean checks", self.clean)
                self.active.clear()
                self.since.clear()
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
                "active": dict(self.active), "active_since_check": dict(self.since),
                "strikes": self.slowness.slow_streak, "hard_strikes": self.slowness.hard_streak,
                "clean_streak": self.clean, "load": self.load,
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
