"""The serving object every generation route goes through: readiness gate, request -> engine batch (validated
against the profile's limits and the model), the bounded queue and micro-batcher, cancellation when the client goes
away, PNG encoding, prompt-truncation warnings and the headers that trace one request."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from engines.errors import InvalidRequestError, NotReadyError
from engines.protocol import Engine
from engines.types.request import Batch, BatchResult, LoraUse
from server import headers, lora_prompt
from server.admission import CostModel, MemoryAsk, MemoryBudget, admit, admit_memory, input_sizes, memory_budget
from server.batcher import Batcher
from server.caching import Caching
from server.caching import header_value as cache_header
from server.errors import ClientGoneError, QueueFullError, TenantLimitError
from server.generation import STEP_CACHE, GenerationRequest
from server.lora_prompt import header_value
from server.metrics import Metrics, note_refusal, tenant_series
from server.provenance import Provenance
from server.request_rules import build_batch as build_batch  # its old home: importers still find it here
from server.request_rules import generation_batches
from server.settings import Settings
from server.state import ServerState
from server.stepper import StepBatcher
from server.tenant_config import DEFAULT_TENANT
from server.tenants import REQUEST, TenantQuotas, TenantRegistry

log = logging.getLogger(__name__)


def encode_png(image: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    return buffer.getvalue()


@dataclass(frozen=True)
class Sample:
    at: float
    shape: str
    seconds: float
    images: int


@dataclass(frozen=True)
class Generated:
    pngs: list[bytes]
    """The encoded images: PNG unless the request asked for another output_format."""
    result: BatchResult
    queue_seconds: float
    encode_seconds: float
    warnings: list[str]
    model: str = ""
    """The served model id that ran (x-sdserve-model: an alias in the request still names the real model)."""
    loras: tuple[LoraUse, ...] = ()
    """The adapter set that ran (x-sdserve-loras)."""

    def trace_headers(self, response: Response) -> None:
        """Server-Timing, provider, seeds, executed batch size and warnings of one request."""
        response.headers["Server-Timing"] = (f"queue;dur={self.queue_seconds * 1000:.1f}, "
                                             f"compute;dur={self.result.timings.total * 1000:.1f}, "
                                             f"encode;dur={self.encode_seconds * 1000:.1f}, "
                                             f"first-step;dur={self.result.first_step_s * 1000:.1f}")
        response.headers[headers.PROVIDER] = self.result.provider
        response.headers[headers.SEEDS] = ",".join(str(g.seed) for g in self.result.images)
        response.headers[headers.BATCH_SIZE] = str(self.result.executed)
        headers.put(response.headers, headers.LORAS, header_value(self.loras))
        if self.warnings:
            headers.put(response.headers, headers.WARNINGS, "; ".join(self.warnings))
        if self.result.cache is not None:
            response.headers[headers.CACHE] = cache_header(self.result.cache)
        if self.model:
            headers.put(response.headers, headers.MODEL, self.model)


Disconnected = Callable[[], Awaitable[bool]]
Encoder = Callable[[Any], bytes]
"""PIL image -> file bytes (encode_png, or server.encoding.ImageFormat.encode for output_format)."""
CLIENT_POLL_S = 0.1


class ImageService:
    """Requests -> the micro-batcher -> PNGs. ``lock`` is held while the engine runs a batch (requests and watchdog
    canaries alike), so there is one executing batch at a time."""

    def __init__(self, engine: Engine, settings: Settings, metrics: Metrics, state: ServerState,
                 window_s: float = 300.0, tenants: TenantRegistry | None = None) -> None:
        """``tenants``: the registry the auth middleware resolves keys with (one is read from ``settings.auth``
        when not given)."""
        self.engine = engine
        self.state = state
        self.settings = settings
        self.metrics = metrics
        self.provenance = Provenance.create(settings.provenance, metrics)
        self.caching = Caching(settings.cache)
        """The step-cache policy and the gate's verdicts per shape (filled at boot)."""
        """The signing stage (server/provenance_stage.py); require without a usable key raises here, before boot."""
        self.lock = asyncio.Lock()
        self.tenants = tenants or TenantRegistry(settings.auth)
        self.quotas = TenantQuotas(self.tenants)
        """Each tenant's images queued, its token bucket, its largest size and steps (server/tenants.py)."""
        q = settings.queue
        self.cost = CostModel()
        self.batcher: Batcher = StepBatcher(
            engine, metrics, self.lock, q.max_size, q.max_batch, q.max_queue_delay_ms / 1000, self.cost,
            q.max_running, q.decode_images, weights=self.tenants.weights) if q.batching == "step" else Batcher(
            engine, metrics, self.lock, q.max_size, q.max_batch, q.max_queue_delay_ms / 1000, self.cost)
        self.memory = MemoryBudget()
        """What one batch's working memory may take (``measure_memory``, at boot)."""
        self._rooms: dict[tuple[int, int, int | None], int] = {}
        self.batcher.call_images = self.call_images
        self.window_s = window_s
        self.recent: deque[Sample] = deque(maxlen=10_000)
        self._last_done = time.monotonic()
        self._owners: Counter[str | None] = Counter()
        """Callers with a request in flight (stop() interrupts their running batches)."""
        self.stopping = False

    def require_ready(self) -> None:
        """503 unless the fast path is proven (retryable unless the boot failed for good)."""
        if self.state.ready:
            return
        reasons = "; ".join(self.state.reasons)
        message = f"server is {self.state.state}" + (f": {reasons}" if reasons else "")
        raise NotReadyError(message, permanent=self.state.state == "failed")

    def to_batches(self, req: GenerationRequest) -> list[Batch]:
        """The request as the engine's batches (``req.batches`` of them: server/request_rules.py
        ``generation_batches``), each one's step cache decided by the policy and the gate (server/caching.py; a
        request asking where the cache cannot run is a 4xx naming step_cache)."""
        batches = generation_batches(req, self.settings, self.engine.info, lora_prompt.by_name(self.engine.loras()))
        caches = [self.caching.spec_for(req.step_cache, b) for b in batches]
        return [dataclasses.replace(b, cache=c) if c is not None else b for b, c in zip(batches, caches, strict=True)]

    def to_batch(self, req: GenerationRequest) -> Batch:
        """``to_batches`` of a one-batch request (the OpenAI routes)."""
        return self.to_batches(dataclasses.replace(req, batches=1))[0]

    async def run(self, batch: Batch, timeout_header: str | None, disconnected: Disconnected,
                  owner: str | None = None, encode: Encoder = encode_png) -> Generated:
        """Queue ``batch`` under the request's deadline for ``owner`` (the caller's API key id: whose requests
        /sdapi/v1/interrupt stops); drop it if the client disconnects, answer 503 if the server stops first.
        Refused at admission (4xx / 429) when its estimated cost cannot finish before the deadline."""
        return (await self.run_all([batch], timeout_header, disconnected, owner, encode))[0]

    def preadmit(self, batches: list[Batch], timeout_header: str | None, owner: str | None = None) -> float:
        """Admission: the request's estimated cost against its deadline (4xx when it cannot finish alone, 429
        behind the work ahead, priced as the step policy would rank ``owner``'s request under fair share; None:
        the current request's tenant). The edit routes call it before decoding any upload, and ``run_all`` again
        once the images are ready. Returns the deadline, which bounds the decoding too."""
        if owner is None and (request := REQUEST.get()) is not None:
            owner = request.tenant
        deadline = self.deadline(timeout_header)
        self.admit_memory(batches)
        source = headers.TIMEOUT if timeout_header is not None else "queue.request_timeout_s"
        # A set over the LoRA budget is refused here by name (InvalidRequestError, param loras), not as a deadline.
        merges = sum(self.engine.lora_cost_s(b.loras) for b in {b.lora_key: b for b in batches}.values())
        try:
            if merges:  # an adapter set not cached is merged before its first step
                source += f", less {merges:.2f}s to merge a LoRA set not yet cached"
            costs = [self.cost.cost_of(b) for b in batches]
            admit(self.cost, costs, self.batcher.ahead_seconds(costs, owner), deadline - time.monotonic() - merges,
                  source)
        except (InvalidRequestError, QueueFullError) as exc:
            self.metrics.refused.labels("over_deadline").inc()
            if isinstance(exc, QueueFullError):
                note_refusal("estimated_wait")
            raise
        return deadline

    def admit_memory(self, batches: list[Batch], size: tuple[int, int] | None = None, encode: bool | None = None,
                     size_param: str = "size") -> None:
        """Admission by memory (server/admission.py): 4xx when a batch's estimated peak cannot fit the budget.
        ``size``/``encode``: the batches as a Hires fix second pass at that size (checked before the first pass
        runs); ``size_param``: the field that set the size. A second pass larger than the request's tenant may ask
        (server/tenants.py) is refused here too, before the first pass runs."""
        q = self.settings.queue
        request = REQUEST.get()
        if size is not None and request is not None:
            self.quotas.check_shape(request.tenant, [dataclasses.replace(b, width=size[0], height=size[1])
                                                     for b in batches], size_param)
        asks = []
        for b in batches:
            width, height = size or (b.width, b.height)
            n, encodes = len(b.images), _encodes(b) if encode is None else encode
            # the calls the scheduler makes: a denoiser call shares only what fits (call_images); under step-level
            # batching a request's decode runs decode_images at a time (its VAE encode, all of them at its begin)
            decode = max(n, q.max_batch) if q.batching != "step" else n if encodes else min(n, q.decode_images)
            asks.append(MemoryAsk(width, height, n, max(n, self.call_images(width, height)), decode, encodes,
                                  self.engine.info.references(input_sizes(b)), size_param,
                                  second_pass=size is not None, controls=len(b.control)))
        try:
            admit_memory(self.engine.info.memory, self.memory, asks)
        except InvalidRequestError:
            self.metrics.refused.labels("over_memory").inc()
            raise

    def call_images(self, width: int, height: int) -> int:
        """Images one denoiser call at ``width`` x ``height`` may hold: ``[queue] max_batch``, or fewer when the
        model's memory estimate of the denoiser stage says a fuller call would not fit the budget (at least 1: a
        request admitted alone runs in a call of its own). The scheduler shares calls up to it; admission prices it."""
        max_batch, model, budget = self.settings.queue.max_batch, self.engine.info.memory, self.memory.bytes
        if model is None or budget is None:
            return max_batch
        key = (width, height, budget)
        if key not in self._rooms:
            if len(self._rooms) >= 1024:
                self._rooms.clear()
            fits = (k for k in range(max_batch, 1, -1)
                    if dict(model.need(width, height, k, 1).stages).get("denoiser", 0) <= budget)
            self._rooms[key] = next(fits, 1)
        return self._rooms[key]

    def measure_memory(self) -> MemoryBudget:
        """The memory budget, once the self-test has warmed the model: ``[limits] memory_budget_mb``, else the
        device's free memory (NVML) or the container's limit less this process's resident memory."""
        runtime, sample = self.settings.runtime, None
        telemetry = self.engine.telemetry() if runtime.device == "cuda" else None
        if telemetry is not None:
            try:
                sample = telemetry.sample(runtime.device_id)
            except Exception as exc:  # a MIG slice has no utilization; the budget is then unknown
                log.warning("no NVML reading for the memory budget: %s", exc)
        self.memory = memory_budget(self.settings.limits.memory_budget_mb, runtime.device, sample)
        log.info("memory budget per batch: %s", "unknown" if self.memory.bytes is None else
                 f"{self.memory.bytes / (1 << 30):.2f} GiB ({self.memory.source})")
        return self.memory

    async def run_all(self, batches: list[Batch], timeout_header: str | None, disconnected: Disconnected,
                      owner: str | None = None, encode: Encoder = encode_png) -> list[Generated]:
        """Several batches of one request under one deadline (A1111's n_iter), admitted on their total cost and
        queued one after another, so other callers' requests interleave between them. ``owner`` is the request's
        tenant (None: ``default``): its largest size and steps (400), then its quotas (429 with Retry-After:
        images queued, images per minute) are checked before anything is queued."""
        tenant = owner or DEFAULT_TENANT
        self.quotas.check_shape(tenant, batches)
        deadline = self.preadmit(batches, timeout_header, tenant)
        try:
            with self.quotas.admit(tenant, sum(len(b.images) for b in batches)):
                return [await self._run(b, deadline, disconnected, owner, encode) for b in batches]
        except TenantLimitError as exc:
            note_refusal(exc.limit)
            raise

    async def _run(self, batch: Batch, deadline: float, disconnected: Disconnected, owner: str | None,
                   encode: Encoder) -> Generated:
        task = asyncio.ensure_future(self.generate(batch, deadline, owner, encode))
        self._owners[owner] += 1
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=CLIENT_POLL_S)
                if self.stopping:
                    await _cancel(task)
                    raise NotReadyError("server stopped before this request completed: retry it on another "
                                        "replica")
                if done:
                    out = task.result()
                    series = tenant_series(owner, self.tenants.current.by_label, self.tenants.enabled)
                    self.metrics.tenant_images.labels(series).inc(len(out.result.images))
                    self.metrics.tenant_queue_seconds.labels(series).observe(out.queue_seconds)
                    return out
                if await disconnected():
                    await _cancel(task)
                    self.metrics.cancelled.labels("disconnect").inc()
                    raise ClientGoneError("client disconnected before the response was ready; its request was "
                                          "dropped")
        finally:
            self._owners[owner] -= 1
            if not self._owners[owner]:
                del self._owners[owner]

    def seed_costs(self, shapes: list[tuple[str, float]], steps: int) -> None:
        """The cost model's first figures: the self-test's p50 per shape ("WxHxB") at the canary ``steps``."""
        for key, p50_s in shapes:
            width, height, batch = (int(v) for v in key.split("x"))
            self.cost.seed(width, height, batch, steps, p50_s)

    def stop(self) -> None:
        """Stop at once (a second SIGTERM/SIGINT): every request still waiting answers 503 within CLIENT_POLL_S
        (its queued job is dropped), the running batch stops at its next step boundary, nothing new is queued."""
        self.stopping = True
        self.batcher.draining = True
        self.batcher.abandon = True
        for owner in list(self._owners):
            self.batcher.interrupt(owner, queued_too=False)

    @property
    def waiting(self) -> int:
        """Requests waiting for a result right now (queued or in the executing batch)."""
        return sum(self._owners.values())

    async def quiesce(self, timeout_s: float) -> bool:
        """Wait until every waiting request has answered (after stop()); False when ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.waiting

    async def settle(self, timeout_s: float) -> bool:
        """Wait until no batch is executing (the engine is then safe to close); False when ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while self.batcher.running and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.batcher.running

    @property
    def busy(self) -> bool:
        return self.batcher.busy or self.lock.locked()

    def idle_for(self) -> float:
        return time.monotonic() - self._last_done

    def deadline(self, header: str | None) -> float:
        """Monotonic deadline: the profile's request timeout, shortened (never extended) by the header."""
        timeout = self.settings.queue.request_timeout_s
        if header is not None:
            try:
                asked = float(header)
            except ValueError:
                raise InvalidRequestError(f"x-sdserve-timeout-s {header!r} is not a number of seconds",
                                          param=headers.TIMEOUT) from None
            if not 0 < asked <= 3600:
                raise InvalidRequestError("x-sdserve-timeout-s must be in (0, 3600]", param=headers.TIMEOUT)
            timeout = min(timeout, asked)
        return time.monotonic() + timeout

    async def generate(self, batch: Batch, deadline: float | None = None, owner: str | None = None,
                       encode: Encoder = encode_png) -> Generated:
        start = time.perf_counter()
        try:
            result = await self.batcher.submit(batch, deadline, owner)
        except QueueFullError:
            note_refusal("queue_full")
            raise
        except InvalidRequestError as exc:
            if exc.param != "cache":
                raise
            # The engine names its batch's field; a client sent step_cache (both APIs).
            raise InvalidRequestError(exc.message, param=STEP_CACHE) from exc
        finally:
            self._last_done = time.monotonic()
            self.metrics.observe_lora(self.engine.lora_stats())
        t = time.perf_counter()
        pngs = await run_in_threadpool(lambda: [encode(g.image) for g in result.images])
        compute = result.timings.total
        self.recent.append(Sample(time.time(), f"{batch.width}x{batch.height}x{result.executed}", compute,
                                  len(result.images)))
        return Generated(pngs, result, max(0.0, t - start - compute), time.perf_counter() - t,
                         self._warnings(batch, result), self.engine.info.name, batch.loras)

    def _warnings(self, batch: Batch, result: BatchResult) -> list[str]:
        """What the pipeline truncated (it tokenized each prompt once), in the tokens of the encoders that read the
        prompt (ModelInfo.prompt_limits), and a negative prompt the model does not read at the request's guidance
        (ModelInfo.reads_negative: guidance-distilled models, or CFG off)."""
        info = self.engine.info
        limits = info.prompt_limits or ((info.max_prompt_tokens, "CLIP tokens"),)
        read = " and ".join(f"{tokens} {label}" for tokens, label in limits)
        first = result.images[0]
        found = [f"{name} truncated to {read}" if len(limits) == 1 else
                 f"{name} truncated: the text encoders read at most {read} of it"
                 for name, cut in (("prompt", first.prompt_truncated), ("negative_prompt",
                                                                       first.negative_prompt_truncated)) if cut]
        spec = batch.images[0]
        if spec.negative_prompt.strip() and info.reads_negative is not None and \
                not info.reads_negative(spec.guidance_scale):
            found.append(f"negative_prompt ignored: {info.name} does not read a negative prompt at guidance "
                         f"{spec.guidance_scale:g} (no classifier-free guidance)")
        return found

    def performance(self, baseline: list[dict[str, Any]]) -> dict[str, Any]:
        """Boot baseline vs live figures over the last ``window_s`` seconds, per shape."""
        now = time.time()
        recent = [s for s in self.recent if now - s.at <= self.window_s]
        live: dict[str, dict[str, float]] = {}
        for key in sorted({s.shape for s in recent}):
            times = [s.seconds for s in recent if s.shape == key]
            live[key] = {"count": len(times), "p50_s": float(np.percentile(times, 50)),
                         "p95_s": float(np.percentile(times, 95))}
        drift = {key: round(live[key]["p50_s"] / b["p50_s"], 3) for b in baseline
                 for key in [b["shape"]] if key in live and b["p50_s"] > 0}
        images = sum(s.images for s in recent)
        span = max(60.0, min(self.window_s, now - min((s.at for s in recent), default=now)))
        b = self.batcher
        return {"window_s": self.window_s, "baseline": baseline, "live": live,
                "images_per_minute": round(images * 60.0 / span, 3), "drift_p50_ratio": drift,
                "cost_s_per_image_step": self.cost.snapshot(),
                "queue": {"depth": len(b.queue), "max_size": b.max_queue, "peak": b.peak_queue,
                          "max_batch": b.max_batch, "batch_seconds_ewma": round(b.stats.batch_seconds, 4)}}


def _encodes(batch: Batch) -> bool:
    """The VAE encoder runs for this batch: an edit from pixels (a latent Hires fix pass brings its latents)."""
    return any(s.edit is not None and s.edit.latents is None for s in batch.images)


async def _cancel(task: asyncio.Future[Generated]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
