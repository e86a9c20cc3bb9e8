"""Step-level batching: requests join and leave the running batch at step boundaries.

Per step key (engines' ``Engine.step_key``: the size's pipeline, the latent shape and the LoRA set) a running set
of rows; every tick runs one denoiser evaluation over all of a set's rows (CFG rows included), then each request's
own step graph with its coefficients, timestep and history. A request that finished its steps is decoded and
answered at once; a waiting compatible request is encoded and joins before the next tick. Rows may differ in prompt,
seed, steps, sampler, guidance, strength (an edit joins at its start step) and CFG. A short request therefore
waits one tick to start, never a whole long generation.

Policy:
- **Row budget per tick**: one denoiser call takes at most ``max_batch`` images (the TensorRT profiles and the
  memory plan are sized for it; a larger request runs alone). Up to ``max_running`` images are *resident*: encoded,
  with their state on the device (latents, history, input and output: a few MB per image), waiting for their turn
  at a tick.
- **Who runs in a tick: shortest remaining first, filled to the budget.** Rows are taken by the evaluations they
  have left, fewest first, until the call holds ``max_batch`` images: a 4-step request that arrives while 50-step
  rows run is in the very next call and every call after it until it is done, and the rest of the budget goes to
  the rows closest to finishing (each call as full as the budget allows: on a CPU a call of four images costs about
  twice one image's, not four times). A row left out ``STARVATION_TICKS`` ticks in a row goes first in the next
  one, so a stream of short requests delays a long one but never stops it. (Why not round robin inside a set: it
  makes every request as slow as the set's total work; why not FIFO: that is head-of-line blocking again.)
- **Across sets (sizes, LoRA sets): round robin**, one tick each in turn: every running size advances each round,
  so a small size is never starved by a large one (a deadline-aware order would need per-shape tick costs the cost
  model does not yet separate from encode and decode).
- **Admission** keeps its meaning: requests become resident FIFO while the resident images stay within
  ``max_running``; the queue, 429s and admission by cost are the micro-batcher's.
- **At every tick boundary**: a row whose deadline passed leaves (504) and frees its slot; a row whose client went
  away leaves; an interrupted row (``/sdapi/v1/interrupt``) is decoded where it is (A1111's interrupt); a stop
  (``abandon``) ends every row; drain waits for the rows like for batches.
- Batches the engine runs whole (``step_key`` None: a pipeline without stages) run between two rounds of ticks,
  through the micro-batcher's path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import BatchResult, Engine, StepRun
from server.admission import Cost, CostModel
from server.batcher import Batcher, Job, Progress
from server.errors import DeadlineExceededError
from server.metrics import Metrics

log = logging.getLogger(__name__)
WHOLE = ("whole",)
"""The key of requests the engine runs whole."""
STARVATION_TICKS = 16
"""Ticks of its set a resident row may be left out of before it joins the next one whatever its length."""


@dataclass
class RunningSet:
    key: Hashable
    jobs: list[Job] = field(default_factory=list)

    @property
    def images(self) -> int:
        return sum(j.images for j in self.jobs)


class StepBatcher(Batcher):
    """The queue of Batcher with a step-level loop: see the module docstring."""

    def __init__(self, engine: Engine, metrics: Metrics, lock: asyncio.Lock, max_queue: int, max_batch: int,
                 max_delay_s: float, cost: CostModel | None = None, max_running: int = 32) -> None:
        super().__init__(engine, metrics, lock, max_queue, max_batch, max_delay_s, cost)
        self.max_running = max(max_running, max_batch)
        self._skipped: dict[int, int] = {}
        """Consecutive ticks of its set each resident job was left out of (by job id)."""
        self._shared: dict[int, int] = {}
        """The most images any tick of each job ran with (by job id): its x-sdserve-batch-size."""
        self.sets: dict[Hashable, RunningSet] = {}
        self._turn = 0
        self._keys: dict[int, Hashable] = {}
        """Each queued job's step key, computed once (by job id)."""
        self._ticks_since_whole = 1 << 30
        """Ticks since a request ran whole: the next one waits until every running set ticked once."""

    def _rows(self) -> list[Job]:
        return [job for s in self.sets.values() for job in s.jobs]

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.running > 0 or bool(self.sets)

    def progress_for(self, owner: str | None) -> Progress | None:
        """The caller's oldest running request (else the oldest running one; else a batch run whole)."""
        rows = self._rows()
        mine = [j for j in rows if j.owner == owner] or rows
        if not mine:
            return self.progress
        job = min(mine, key=lambda j: j.enqueued)
        run = job.run
        if run is None:
            return self.progress
        return Progress(run.steps_done, run.steps_total, job.started, job.images)

    async def run(self) -> None:
        """The step loop (a lifespan task)."""
        while True:
            if not self.queue and not self.sets:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._idle.clear()
            try:
                await self._round()
            except Exception as exc:  # a defect here must fail the rows, not leave every request hanging
                log.exception("step loop failed; failing the running requests")
                for running in list(self.sets.values()):
                    for job in list(running.jobs):
                        self._leave(running, job, exc)
                self.sets.clear()

    async def _round(self) -> None:
        whole = await self._admit()
        if whole:
            await self._execute(whole)
        key = self._next_key()
        if key is not None:
            await self._tick(self.sets[key])
        elif not whole and self.queue:  # nothing could start (cannot happen: a full set is running); yield
            await asyncio.sleep(0)

    def _key(self, job: Job) -> Hashable:
        if id(job) not in self._keys:
            found = self.engine.step_key(job.batch)
            self._keys[id(job)] = WHOLE if found is None else found
        return self._keys[id(job)]

    async def _admit(self) -> list[Job]:
        """Begin every queued request while the resident images stay within max_running (FIFO). Returns the oldest
        whole-run request and those it merges with, when one is at the front of what can start."""
        whole_waits = False
        for job in list(self.queue):
            if job not in self.queue:  # dropped while an earlier one began
                continue
            try:
                key = self._key(job)
            except Exception as exc:  # the engine refuses the batch (e.g. a size it does not serve)
                self._fail_queued(job, exc)
                continue
            if key == WHOLE:
                if not whole_waits and self._ticks_since_whole >= len(self.sets):
                    self._ticks_since_whole = 0
                    return self._take_whole(job)
                whole_waits = True  # after every running set ticked once; requests behind it may begin
                continue
            resident = sum(s.images for s in self.sets.values())
            if resident and resident + job.images > self.max_running:
                break  # FIFO: nothing overtakes a request waiting for room
            await self._begin(job, key)
        return []

    def _take_whole(self, head: Job) -> list[Job]:
        """``head`` and the compatible whole-run requests behind it, up to max_batch images."""
        self.queue.remove(head)
        taken, images = [head], head.images
        for job in list(self.queue):
            if job.group == head.group and images + job.images <= self.max_batch and self._key(job) == WHOLE:
                self.queue.remove(job)
                taken.append(job)
                images += job.images
        for job in taken:
            self._keys.pop(id(job), None)
        self._gauge()
        return taken

    def _fail_queued(self, job: Job, exc: Exception) -> None:
        self._drop(job)
        self._keys.pop(id(job), None)
        if not job.future.done():
            job.future.set_exception(exc)

    async def _begin(self, job: Job, key: Hashable) -> None:
        self.queue.remove(job)
        self._keys.pop(id(job), None)
        self._gauge()
        if job.deadline is not None and time.monotonic() >= job.deadline:
            job.state = "dropped"
            self.metrics.cancelled.labels("deadline").inc()
            if not job.future.done():
                job.future.set_exception(DeadlineExceededError("deadline passed before the request started"))
            return
        if job.cancelled or job.future.done():
            job.state = "dropped"
            return
        job.state, job.started = "running", time.perf_counter()
        self.metrics.queue_seconds.observe(time.monotonic() - job.enqueued)
        self.running += 1
        try:
            async with self.lock:
                job.run = await run_in_threadpool(self.engine.begin, job.batch)
        except Exception as exc:
            self._done(job)
            if not job.future.done():
                job.future.set_exception(exc)
            return
        self.sets.setdefault(key, RunningSet(key)).jobs.append(job)

    def _next_key(self) -> Hashable | None:
        keys = [k for k, s in self.sets.items() if s.jobs]
        if not keys:
            return None
        key = keys[self._turn % len(keys)]
        self._turn += 1
        return key

    def _pick(self, running: RunningSet) -> list[Job]:
        """This tick's rows: starved rows first, then shortest remaining first, up to the budget (module doc)."""
        def left(job: Job) -> int:
            run = job.run
            return 0 if run is None else max(0, run.steps_total - run.steps_done)

        order = sorted(running.jobs, key=lambda j: (self._skipped.get(id(j), 0) < STARVATION_TICKS, left(j),
                                                     j.enqueued))
        lead = order[0]
        picked, images = [lead], lead.images
        for job in order[1:]:
            if images + job.images <= self.max_batch:
                picked.append(job)
                images += job.images
        for job in running.jobs:
            self._skipped[id(job)] = 0 if job in picked else self._skipped.get(id(job), 0) + 1
        return picked

    async def _tick(self, running: RunningSet) -> None:
        self._ticks_since_whole += 1
        await self._boundary(running)
        if not running.jobs:
            self.sets.pop(running.key, None)
            return
        picked = self._pick(running)
        runs = [j.run for j in picked if j.run is not None]
        start = time.perf_counter()
        try:
            async with self.lock:
                await run_in_threadpool(self.engine.tick, runs)
        except Exception as exc:  # every row of the set gets the failure; none hangs
            for job in list(running.jobs):
                self._leave(running, job, exc)
            self.sets.pop(running.key, None)
            return
        elapsed = time.perf_counter() - start
        self.metrics.batch_size.observe(sum(j.images for j in picked))
        self.metrics.unet_step_seconds.observe(elapsed)
        now = time.monotonic()
        images = sum(j.images for j in picked)
        for job in picked:
            if job.first_step_s is None:
                job.first_step_s = now - job.enqueued
            self._shared[id(job)] = max(self._shared.get(id(job), 0), images)
        for job in picked:
            if job.run is not None and job.run.finished:
                await self._finish(running, job)
        await self._boundary(running)
        if not running.jobs:
            self.sets.pop(running.key, None)

    async def _boundary(self, running: RunningSet) -> None:
        """Rows that stop here: a stop, a passed deadline, a client gone; an interrupted row is decoded where it
        is."""
        now = time.monotonic()
        for job in list(running.jobs):
            if self.abandon:
                self._leave(running, job, NotReadyError("server stopped before this request completed: retry it on "
                                                        "another replica"))
            elif job.deadline is not None and now >= job.deadline:
                done = job.run.steps_done if job.run is not None else 0
                total = job.run.steps_total if job.run is not None else job.batch.steps
                self.metrics.cancelled.labels("deadline").inc()
                self._leave(running, job, DeadlineExceededError(
                    f"deadline passed after {done} of {total} steps: the request left the running batch there, "
                    "nothing more is computed for it"))
            elif job.cancelled:
                self._leave(running, job, None)
        for job in [j for j in running.jobs if j.interrupted]:
            await self._finish(running, job, stopped=True)

    def _leave(self, running: RunningSet, job: Job, exc: Exception | None) -> None:
        if job in running.jobs:
            running.jobs.remove(job)
        try:
            if job.run is not None:
                self.engine.discard(job.run)
        finally:
            self._done(job)
        if exc is not None and not job.future.done():
            job.future.set_exception(exc)

    def _done(self, job: Job) -> None:
        job.state = "done"
        self.running -= 1
        self._skipped.pop(id(job), None)
        self._shared.pop(id(job), None)

    async def _finish(self, running: RunningSet, job: Job, stopped: bool = False) -> None:
        if job not in running.jobs or job.run is None:
            return
        running.jobs.remove(job)
        run: StepRun = job.run
        try:
            async with self.lock:
                result = await run_in_threadpool(self.engine.finish, run, stopped)
        except Exception as exc:
            self._done(job)
            if not job.future.done():
                job.future.set_exception(exc)
            return
        shared = self._shared.get(id(job), job.images)
        self._done(job)
        elapsed = time.perf_counter() - job.started
        self.last_provider = result.provider
        self.cost.observe(Cost(job.batch.width, job.batch.height, result.steps_done, job.images),
                          result.timings.total or elapsed)
        m = self.metrics
        m.compute_seconds.observe(result.timings.total or elapsed)
        m.images.inc(len(result.images))
        self.stats.batch_seconds = elapsed if not self.stats.batches else 0.8 * self.stats.batch_seconds + 0.2 * elapsed
        self.stats.batches += 1
        self.stats.sizes.append(job.images)
        if not job.future.done():
            job.future.set_result(BatchResult(result.images, result.provider, result.timings, shared,
                                              result.steps_done, result.interrupted, result.adapted,
                                              job.first_step_s or 0.0, result.cache))
