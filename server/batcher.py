"""Bounded queue and micro-batcher in front of the engine.

One executing batch per model at a time. Requests wait in a bounded queue (full -> 429 at once, with Retry-After
estimated from the queue and recent batch times). The batcher takes the oldest request and, within
``max_queue_delay_ms``, every compatible one behind it (same size, steps, sampler, LoRA adapter set, and for edits
the same mode -- img2img or inpainting -- and strength; prompts, seeds, guidance, images and masks are per image) up to
``max_batch`` images, runs them as one batch and splits the result back per request. A request whose deadline
passes before it starts is dropped (504); a cancelled request (client gone) is dropped likewise.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import Engine, StepRun
from engines.types.request import Batch, BatchResult
from server.admission import Cost, CostModel
from server.errors import DeadlineExceededError, JobInterruptedError, QueueFullError
from server.metrics import Metrics
from server.step_policy import Record

JobState = Literal["queued", "running", "done", "dropped"]


@dataclass(eq=False)
class Job:
    batch: Batch
    future: asyncio.Future[BatchResult]
    enqueued: float
    deadline: float | None
    owner: str | None = None
    """Who submitted it (the API key id; None without auth): /sdapi/v1/interrupt stops the caller's jobs only."""
    state: JobState = "queued"
    interrupted: bool = False
    cancelled: bool = False
    """The client went away while the job ran: step-level batching drops its rows at the next boundary."""
    started: float = 0.0
    """perf_counter when it started running (progress)."""
    first_step_s: float | None = None
    """Seconds from enqueue to the end of its first denoiser evaluation."""
    run: StepRun | None = None
    """Its rows in a running set (step-level batching, server/stepper.py); None while queued or run whole."""
    record: Record | None = None
    """The step scheduler's record of it (server/step_policy.py: its work, progress, bypasses, decoded images);
    None until the step loop sees it, and under micro-batching."""

    @property
    def images(self) -> int:
        return len(self.batch.images)

    @property
    def cost(self) -> Cost:
        return Cost(self.batch.width, self.batch.height, self.batch.steps, self.images)

    @property
    def group(self) -> tuple[object, ...]:
        """Requests merge into one batch only when everything but the per-image settings is equal."""
        b = self.batch
        return (b.width, b.height, b.steps, b.scheduler, b.truncate_prompts, b.original_size, b.crops_coords_top_left,
                b.mode, b.strength, b.overlay, b.lora_key, b.cache)


@dataclass
class Progress:
    """The executing batch, as /sdapi/v1/progress reports it."""

    steps_done: int
    steps_total: int
    started: float
    images: int


@dataclass
class BatchStats:
    batch_seconds: float = 0.0
    """EWMA of executed batch wall time."""
    batches: int = 0
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=1000))


class Batcher:
    def __init__(self, engine: Engine, metrics: Metrics, lock: asyncio.Lock, max_queue: int, max_batch: int,
                 max_delay_s: float, cost: CostModel | None = None) -> None:
        self.engine, self.metrics, self.lock = engine, metrics, lock
        self.cost = cost or CostModel()
        self.abandon = False
        """Set by a stop: the executing batch ends at its next step boundary without decoding (exit within the
        drain bound plus at most one step)."""
        self.max_queue, self.max_batch, self.max_delay_s = max_queue, max_batch, max_delay_s
        self.queue: deque[Job] = deque()
        self._live: list[Job] = []
        self.running = 0
        self.draining = False
        self.stats = BatchStats()
        self.peak_queue = 0
        self.progress: Progress | None = None
        self.last_provider = ""
        """The provider the last executed batch reported (the watchdog compares it with the boot one)."""
        self._wake = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self.call_images: Callable[[int, int], int] = lambda width, height: self.max_batch
        """Images one denoiser call at (width, height) may hold: ``max_batch``, fewer where the memory budget says
        (ImageService.call_images, set at boot). A request with more images than that runs in a call of its own."""

    def room(self, job: Job) -> int:
        """Images a denoiser call at ``job``'s size may hold (``call_images`` within ``max_batch``, at least 1)."""
        return max(1, min(self.max_batch, self.call_images(job.batch.width, job.batch.height)))

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.running > 0

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: queued batches ahead times recent batch time."""
        per_batch = self.stats.batch_seconds or 1.0
        ahead = math.ceil(sum(j.images for j in self.queue) / self.max_batch) + 1
        return max(1, math.ceil(ahead * per_batch))

    def ahead_seconds(self, costs: Sequence[Cost] | None = None, owner: str | None = None) -> float:
        """Estimated seconds of admitted work a new job (of ``costs``, from ``owner``) would wait behind: the
        executing batch's remaining steps and every queued job (the cost model's estimates; 0 for what it cannot
        estimate yet): first come, first served, the micro-batcher's order. The step loop's is its policy's."""
        running = 0.0
        if self.progress is not None and self._live:
            b = self._live[0].batch
            whole = self.cost.total([self.cost.cost_of(b, images=self.progress.images)])
            running = whole * (1 - self.progress.steps_done / max(1, self.progress.steps_total))
        for job in self.rows():
            if job.run is not None:
                left = 1 - job.run.steps_done / max(1, job.run.steps_total)
                running += self.cost.total([self.cost.cost_of(job.batch)]) * left
        return running + self.cost.total(self.cost.cost_of(job.batch) for job in self.queue)

    def rows(self) -> list[Job]:
        """Jobs running step by step (none under micro-batching)."""
        return []

    def progress_for(self, owner: str | None) -> Progress | None:
        """What /sdapi/v1/progress reports: the executing batch (micro-batching)."""
        return self.progress

    def interrupt(self, owner: str | None, queued_too: bool = True) -> tuple[int, int]:
        """Stop ``owner``'s jobs: queued ones are dropped (JobInterruptedError), running ones stop at the next step
        boundary once every job in their batch is interrupted. Returns (running, queued) jobs hit."""
        queued = [j for j in self.queue if j.owner == owner] if queued_too else []
        for job in queued:
            self.drop(job)
            if not job.future.done():
                job.future.set_exception(JobInterruptedError("request interrupted (POST /sdapi/v1/interrupt) "
                                                             "before it started"))
        running = [j for j in [*self._live, *self.rows()] if j.owner == owner and not j.interrupted]
        for job in running:
            job.interrupted = True
        if running:
            self._notify()
        return len(running), len(queued)

    def watch(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (in the event loop) whenever something a loop must decide on happens: a request queued,
        interrupted or gone."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        """Something the loop must decide on happened (a request queued, interrupted or gone)."""
        for listener in self._listeners:
            listener()
        self._wake.set()

    async def rest(self) -> None:
        """Wait, idle, until something a loop must decide on happens."""
        self._wake.clear()
        await self._wake.wait()

    async def submit(self, batch: Batch, deadline: float | None, owner: str | None = None) -> BatchResult:
        """Queue ``batch`` and wait for its result; raises QueueFullError, DeadlineExceededError, NotReadyError,
        JobInterruptedError."""
        if self.draining:
            raise NotReadyError("server is draining: send the request to another replica")
        if len(self.queue) >= self.max_queue:
            raise QueueFullError(f"queue full ({self.max_queue} requests waiting)", self.retry_after())
        job = Job(batch, asyncio.get_running_loop().create_future(), time.monotonic(), deadline, owner)
        self.queue.append(job)
        self.peak_queue = max(self.peak_queue, len(self.queue))
        self._gauge()
        self._notify()
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except TimeoutError:
            if job.state == "queued":
                self.drop(job)
                self.metrics.cancelled.labels("deadline").inc()
                raise DeadlineExceededError(f"deadline passed after {time.monotonic() - job.enqueued:.2f}s in the "
                                            "queue; the request was not started") from None
            return await job.future  # already running: its result is on the way
        except asyncio.CancelledError:  # the client went away
            if job.state == "queued":
                self.drop(job)
            job.cancelled = True
            self._notify()
            raise

    def drop(self, job: Job) -> None:
        """Drop a queued job (its answer is the caller's)."""
        job.state = "dropped"
        if job in self.queue:
            self.queue.remove(job)
        self._gauge()

    def _gauge(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))

    def take(self, jobs: Iterable[Job]) -> None:
        """Take queued ``jobs`` out of the queue to run them."""
        for job in jobs:
            self.queue.remove(job)
        self._gauge()

    def _take(self) -> list[Job]:
        """The oldest job and the compatible ones behind it, up to max_batch images (FIFO within a group)."""
        head = self.queue.popleft()
        taken, images, room = [head], head.images, self.room(head)
        for job in list(self.queue):
            if job.group == head.group and images + job.images <= room:
                self.queue.remove(job)
                taken.append(job)
                images += job.images
        self._gauge()
        return taken

    async def run(self) -> None:
        """The batching loop (a lifespan task)."""
        while True:
            if not self.queue:
                await self.rest()
                continue
            head = self.queue[0]
            if sum(j.images for j in self.queue if j.group == head.group) < self.room(head):
                wait = head.enqueued + self.max_delay_s - time.monotonic()
                if wait > 0:  # give compatible requests a moment to join
                    await asyncio.sleep(wait)
            if not self.queue:
                continue
            await self.execute(self._take())

    def _start(self, jobs: list[Job]) -> list[Job]:
        """The jobs still worth running (a job whose deadline passed in the queue gets its 504 here)."""
        now = time.monotonic()
        live = []
        for job in jobs:
            if job.deadline is not None and now >= job.deadline:
                job.state = "dropped"
                self.metrics.cancelled.labels("deadline").inc()
                if not job.future.done():
                    job.future.set_exception(DeadlineExceededError("deadline passed before the request started"))
            else:
                job.state = "running"
                live.append(job)
        return live

    def _step_hook(self, live: list[Job], start: float, images: int) -> Callable[[int, int], bool]:
        def on_step(done: int, total: int) -> bool:  # runs in the engine's thread, between steps
            self.progress = Progress(done, total, start, images)
            now = time.monotonic()
            for job in live:
                if job.first_step_s is None:
                    job.first_step_s = now - job.enqueued
            if self.abandon:  # raising skips the decode: a stop costs at most the step that was running
                raise NotReadyError("server stopped before this request completed: retry it on another replica")
            if all(j.deadline is not None and time.monotonic() >= j.deadline for j in live):
                raise DeadlineExceededError(f"deadline passed after {done} of {total} steps: the batch was stopped "
                                            "there, nothing more is computed for it")
            return not all(j.interrupted for j in live)

        return on_step

    async def execute(self, jobs: list[Job]) -> None:
        """Run ``jobs`` (compatible, taken from the queue) as one batch through the engine's ``generate`` and answer
        each with its images or the failure."""
        live = self._start(jobs)
        if not live:
            return
        merged = replace(live[0].batch, images=tuple(s for j in live for s in j.batch.images))
        self.running += 1
        start = time.perf_counter()
        on_step = self._step_hook(live, start, len(merged.images))
        try:
            async with self.lock:
                for job in live:
                    self.metrics.queue_seconds.observe(time.monotonic() - job.enqueued)
                self._live, self.progress = live, Progress(0, merged.steps, start, len(merged.images))
                result = await run_in_threadpool(self.engine.generate, merged, on_step)
        except Exception as exc:  # every waiting request gets the failure; none hangs
            for job in live:
                job.state = "done"
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        finally:
            self.running -= 1
            self._live, self.progress = [], None
        elapsed = time.perf_counter() - start
        self.last_provider = result.provider
        self.cost.observe(self.cost.cost_of(merged, steps=result.steps_done),
                          result.timings.total or elapsed, result.timings)
        m = self.metrics
        m.compute_seconds.observe(result.timings.total or elapsed)
        m.batch_size.observe(len(merged.images))
        m.images.inc(len(result.images))
        m.unet_step_seconds.observe(result.timings.denoise / max(1, merged.steps))
        self.stats.batch_seconds = elapsed if not self.stats.batches else 0.8 * self.stats.batch_seconds + 0.2 * elapsed
        self.stats.batches += 1
        self.stats.sizes.append(len(merged.images))
        offset = 0
        for job in live:
            part = result.images[offset:offset + job.images]
            offset += job.images
            job.state = "done"
            if not job.future.done():
                job.future.set_result(BatchResult(part, result.provider, result.timings, len(merged.images),
                                                  result.steps_done, result.interrupted, result.adapted,
                                                  job.first_step_s or 0.0, result.cache))

    async def drain(self, timeout: float) -> int:
        """Stop accepting; let queued and running work finish within ``timeout``; fail what is left (503).
        Returns how many requests were failed."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = 0
        while self.queue:
            job = self.queue.popleft()
            job.state = "dropped"
            if not job.future.done():
                job.future.set_exception(NotReadyError("server shut down before this request started: retry it"))
                self.metrics.cancelled.labels("drain").inc()
                failed += 1
        self._gauge()
        return failed
