"""The one metrics module (prometheus-client). Units in names; labels from closed sets, never a prompt."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Container, Mapping
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.platform_collector import PlatformCollector

from engines.types.model import LoraStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
OTHER_TENANT = "other"
"""The tenant label of every request whose tenant is not configured (an unconfigured key, no valid key at all)."""
UNAUTHENTICATED_TENANT = "default"
"""The one tenant of a server without auth (server/tenant_config.py DEFAULT_TENANT)."""
REFUSAL_LIMITS = ("in_flight", "images_queued", "images_per_minute", "estimated_wait", "queue_full", "busy")
"""What a 429 was over: a tenant's limits (TenantLimitError.limit), admission by cost (the estimated wait behind the
work ahead), the bounded queue, and ``busy`` for a shared pool with no room (the image decoders)."""


def tenant_series(label: str | None, configured: Container[str], auth: bool) -> str:
    """The ``tenant`` label of a request's series, from a closed set: a configured tenant's label, ``other`` for
    anything else with auth on (an unconfigured key's id never becomes a label), ``default`` without auth."""
    if not auth:
        return UNAUTHENTICATED_TENANT
    return label if label is not None and label in configured else OTHER_TENANT


@dataclass
class Refusal:
    """One HTTP request's 429 cause, noted where the refusal is decided and read by the metrics middleware."""

    limit: str | None = None


REFUSAL: ContextVar[Refusal | None] = ContextVar("sdserve_refusal", default=None)
"""Set by the metrics middleware for each request; None outside one."""


def note_refusal(limit: str) -> None:
    """Name the limit the current request was refused over (the first one named stays)."""
    refusal = REFUSAL.get()
    if refusal is not None and refusal.limit is None:
        refusal.limit = limit


DEGRADED_REASONS = ("boot_failed", "latency_drift", "output_drift", "canary_invalid", "livelock",
                    "fallback_suspected", "ort_event", "provider_changed", "model_files")


class Metrics:
    """All series of one server; a registry per app keeps test servers apart."""

    def __init__(self, device_id: int = 0) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, open fds, ...
        PlatformCollector(registry=r)  # python_info
        self.gpu = str(device_id)
        self.requests = Counter("sdserve_requests_total", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.request_seconds = Histogram("sdserve_request_duration_seconds", "End-to-end request time",
                                         ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("sdserve_queue_wait_seconds", "Time waiting for the engine",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("sdserve_compute_seconds", "Engine time per batch",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.images = Counter("sdserve_images_generated_total", "Images generated", registry=r)
        self.images_by_mode = Counter("sdserve_images_by_mode_total", "Images returned by route and mode "
                                      "(txt2img, img2img, inpaint)", ["route", "mode"], registry=r)
        self.batch_size = Histogram("sdserve_batch_size_images", "Images per executed batch",
                                    buckets=(1, 2, 4, 8, 16), registry=r)
        self.unet_step_seconds = Histogram("sdserve_unet_step_seconds", "Denoising time per step (UNet + step)",
                                           buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                    5, 10, 30, 120), registry=r)
        self.ready = Gauge("sdserve_ready", "1 when /ready is 200", registry=r)
        self.degraded = Gauge("sdserve_degraded", "1 for each active degradation reason", ["reason"], registry=r)
        self.provider = Gauge("sdserve_provider_info", "Execution provider in use per component",
                              ["component", "provider"], registry=r)
        self.ort_events = Counter("sdserve_ort_events_total", "Classified ONNX Runtime log events (fallbacks "
                                  "included)", ["kind"], registry=r)
        self.queue_depth = Gauge("sdserve_queue_depth", "Requests waiting for the engine", registry=r)
        self.cancelled = Counter("sdserve_requests_cancelled_total", "Requests dropped before running",
                                 ["reason"], registry=r)
        self.canary_seconds = Histogram("sdserve_canary_seconds", "Watchdog canary latency",
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.gpu_sm = Gauge("sdserve_gpu_sm_utilization_percent", "NVML SM utilization", ["gpu"], registry=r)
        self.gpu_mem = Gauge("sdserve_gpu_memory_controller_utilization_percent", "NVML memory-controller "
                             "utilization", ["gpu"], registry=r)
        self.gpu_power = Gauge("sdserve_gpu_power_watts", "NVML power draw", ["gpu"], registry=r)
        self.gpu_mem_used = Gauge("sdserve_gpu_memory_used_bytes", "NVML memory used", ["gpu"], registry=r)
        self.slowdown = Gauge("sdserve_canary_slowdown_ratio", "Canary per-step time over its boot baseline",
                              registry=r)
        self.slow = Gauge("sdserve_slow", "1 while the canary is over watchdog.drift_factor for drift_consecutive "
                          "checks (reported; it turns /ready 503 only when the profile asks and nothing explains it)",
                          registry=r)
        self.contention = Gauge("sdserve_contention", "1 while observed contention (CPU pressure, steal, other GPU "
                                "processes) is over the profile's thresholds", registry=r)
        self.cpu_pressure = Gauge("sdserve_host_cpu_pressure_percent", "Share of the last window a runnable task "
                                  "waited for a CPU (/proc/pressure/cpu some)", registry=r)
        self.cpu_steal = Gauge("sdserve_host_cpu_steal_percent", "CPU steal in the last window", registry=r)
        self.load_per_cpu = Gauge("sdserve_host_load_per_cpu", "1-minute load average per usable CPU", registry=r)
        self.gpu_others = Gauge("sdserve_gpu_other_processes", "Other compute processes on this GPU (NVML)", ["gpu"],
                                registry=r)
        self.refused = Counter("sdserve_requests_refused_total", "Requests refused at admission by their estimated "
                               "cost", ["reason"], registry=r)
        self.provenance_images = Counter("sdserve_provenance_images_total", "Images returned, by provenance outcome "
                                         "(signed, unsigned) and reason (off, no_credential, signing_failed)",
                                         ["outcome", "reason"], registry=r)
        self.provenance_seconds = Histogram("sdserve_provenance_sign_seconds", "C2PA signing time per image",
                                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=r)
        self.provenance_bytes = Histogram("sdserve_provenance_added_bytes", "Bytes the signed C2PA manifest adds "
                                          "per image", buckets=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
                                          registry=r)
        self.watermark_images = Counter("sdserve_watermark_images_total", "Images returned with [provenance] "
                                        "watermark on, by outcome (marked, skipped) and reason (too_small, "
                                        "unsupported_image, unreadable)", ["outcome", "reason"], registry=r)
        self.provenance_expiry = Gauge("sdserve_provenance_certificate_expiry_timestamp_seconds", "Unix time the "
                                       "signing certificate expires (NaN without one)", registry=r)
        self._lora_metrics(r)
        self._tenant_metrics(r)
        for gauge in (self.slowdown, self.cpu_pressure, self.cpu_steal, self.load_per_cpu):
            gauge.set(math.nan)  # unknown until the watchdog's first window
        self.gpu_others.labels(self.gpu).set(math.nan)
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason).set(0)
        self.set_gpu(math.nan, math.nan, math.nan, math.nan)  # unknown until a sample arrives
        self.ready.set(0)
        self.queue_depth.set(0)

    def set_gpu(self, sm: float, mem: float, power_w: float, used_bytes: float) -> None:
        self.gpu_sm.labels(self.gpu).set(sm)
        self.gpu_mem.labels(self.gpu).set(mem)
        self.gpu_power.labels(self.gpu).set(power_w)
        self.gpu_mem_used.labels(self.gpu).set(used_bytes)

    def _tenant_metrics(self, r: CollectorRegistry) -> None:
        """Per tenant, beside the server-wide series (which keep their labels): ``tenant`` is a configured label,
        ``other`` or ``default`` (tenant_series), never a key, key id or prompt."""
        self.tenant_requests = Counter("sdserve_tenant_requests_total", "HTTP requests by tenant, route and status",
                                       ["tenant", "route", "status"], registry=r)
        self.tenant_request_seconds = Histogram("sdserve_tenant_request_duration_seconds", "End-to-end request "
                                                "time by tenant and route", ["tenant", "route"],
                                                buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_images = Counter("sdserve_tenant_images_generated_total", "Images generated by tenant",
                                     ["tenant"], registry=r)
        self.tenant_queue_seconds = Histogram("sdserve_tenant_queue_wait_seconds", "Time a request's batch waited "
                                              "for the engine by tenant (Server-Timing's queue: submitted to "
                                              "done, less its compute)", ["tenant"], buckets=LATENCY_BUCKETS,
                                              registry=r)
        self.tenant_refused = Counter("sdserve_tenant_rate_limited_total", "429 answers by tenant and the limit "
                                      "refusing them (" + ", ".join(REFUSAL_LIMITS) + ")", ["tenant", "limit"],
                                      registry=r)
        self.tenant_slo = Gauge("sdserve_tenant_slo_p95_seconds", "Generation p95 (end to end) each configured "
                                "tenant is judged against (its auth.tenants slo.p95_s, else the default 30 s); "
                                "tenants without a series are judged against 30 s", ["tenant"], registry=r)
        self._slo_tenants: set[str] = set()

    def set_tenant_slos(self, slos: Mapping[str, float]) -> None:
        """The SLO gauge exactly as ``slos`` (tenant series label -> p95 seconds): a tenant no longer in it loses its
        series, so no stale threshold stays exported."""
        for label in self._slo_tenants - set(slos):
            self.tenant_slo.remove(label)
        for label, seconds in slos.items():
            self.tenant_slo.labels(label).set(seconds)
        self._slo_tenants = set(slos)

    def _lora_metrics(self, r: CollectorRegistry) -> None:
        self.lora_merges = Counter("sdserve_lora_merges_total", "LoRA adapter sets merged on the device (not found "
                                   "in the merged-set cache)", registry=r)
        self.lora_hits = Counter("sdserve_lora_cache_hits_total", "Batches whose LoRA adapter set was already "
                                 "merged", registry=r)
        self.lora_evictions = Counter("sdserve_lora_cache_evictions_total", "Merged LoRA sets evicted to stay "
                                      "under [runtime.lora] cache_mb", registry=r)
        self.lora_uncacheable = Counter("sdserve_lora_uncacheable_total", "Merged LoRA sets larger than the whole "
                                        "cache budget (merged for their batch only)", registry=r)
        self.lora_merge_seconds = Counter("sdserve_lora_merge_seconds_total", "Seconds spent merging LoRA sets",
                                          registry=r)
        self.lora_cache_bytes = Gauge("sdserve_lora_cache_bytes", "Device bytes held by merged LoRA sets",
                                      registry=r)
        self.lora_cache_sets = Gauge("sdserve_lora_cache_sets", "Merged LoRA sets in the cache", registry=r)
        self._lora_seen = LoraStats()

    def observe_lora(self, stats: LoraStats) -> None:
        """The engine's cumulative merged-set figures, as counters (increments since the last call) and gauges."""
        seen, self._lora_seen = self._lora_seen, stats
        self.lora_merges.inc(max(0, stats.misses - seen.misses))
        self.lora_hits.inc(max(0, stats.hits - seen.hits))
        self.lora_evictions.inc(max(0, stats.evictions - seen.evictions))
        self.lora_uncacheable.inc(max(0, stats.uncacheable - seen.uncacheable))
        self.lora_merge_seconds.inc(max(0.0, stats.merge_seconds_total - seen.merge_seconds_total))
        self.lora_cache_bytes.set(stats.cached_bytes)
        self.lora_cache_sets.set(stats.cached_sets)

    def set_degraded(self, active: set[str]) -> None:
        for reason in DEGRADED_REASONS:
            self.degraded.labels(reason).set(1 if reason in active else 0)


class Exposition:
    """/metrics text, rendered in a worker thread, one rendering at a time: a scrape takes the newest rendering
    that started no earlier than ``max_age_s`` before it arrived, else renders. A burst of scrapes (/metrics is
    unauthenticated with keys on) thus shares a few renderings instead of running thousands on the event loop,
    which stalled /health for 8.9 s (issue 32); with ``max_age_s`` 0 nothing older than the scrape is served."""

    def __init__(self, registry: CollectorRegistry, max_age_s: float) -> None:
        self.registry, self.max_age_s = registry, max_age_s
        self.renders = 0
        self._text, self._started = b"", -math.inf
        self._lock = asyncio.Lock()

    async def text(self) -> bytes:
        asked = time.monotonic()
        async with self._lock:
            if self._started < asked - self.max_age_s:  # no rendering fresh enough for this scrape yet
                started = time.monotonic()
                self._text = await asyncio.to_thread(generate_latest, self.registry)
                self._started = started
                self.renders += 1
            return self._text
