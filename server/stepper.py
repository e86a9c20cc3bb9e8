"""Step-level batching: requests join and leave the running batch at step boundaries.

Per step key (engines' ``Engine.step_key``: the size's pipeline, the latent shape and the LoRA set) a running set
of rows. The loop runs one *operation* at a time: a request's **begin** (encode, noise, edit preparation), a **tick**
of one set (one denoiser evaluation over the picked rows, CFG rows included, then each request's own step graph
with its coefficients, timestep and history), a part of a request's **decode** (``decode_images`` images, ``[queue]
decode_images``, 1 by default: on a CPU a decode costs the same per image either way; on a GPU one image already
fills it at the served sizes), or its **finish** (the last part of its decode; answered at once). Rows may differ
in prompt, seed, steps, sampler, guidance, strength (an edit joins at its start step) and CFG.

Which operation runs next, how many run back to back and who counts as bypassed is the policy, pure and tested on
plain data: server/step_policy.py (smallest slowdown first, bounded bypass, deadline guard, why). This module runs
it: each request's :class:`~server.step_policy.Record` lives on its ``Job``, refreshed with its progress before
each decision.
- **Runs**: operations the policy would choose one after another with nothing new to decide on run back to back in
  one call of the engine's thread, not one event-loop hop each (``run_bound``, ``finish_next``): the order is the
  same; a run ends at the next boundary when a request is queued, interrupted or gone (``Batcher.watch``), on a
  stop, when a row finishes, and within the policy's bounds. On a CPU the hop and the decision cost about a
  millisecond per operation under load, 5-7% of a tick.
- **Threads**: the scheduler's state (the sets, the records) is written on the event loop's thread; the engine calls
  run in the engine's thread (``run_in_threadpool``) while the loop waits for them, so a run reads its own rows'
  records there and writes only theirs. ``on_loop_thread`` and ``on_engine_thread`` enforce which is which at the
  top of the methods of each side.
- **Residency**: up to ``max_running`` images are encoded, with their state on the device (latents, history,
  input and output: a few MB per image); a queued request begins when its images fit.
- **Admission** keeps its meaning: the queue, 429s and admission by cost are the micro-batcher's.
- **At every operation boundary**: a row whose deadline passed leaves (504) and frees its slot; a row whose client
  went away leaves; an interrupted row (``/sdapi/v1/interrupt``) is decoded where it is, first (A1111's
  interrupt); a stop (``abandon``) ends every row; drain waits for the rows like for batches.
- Batches the engine runs whole (``step_key`` None: the Engine protocol allows it; every pipeline in engines/ is
  staged today, the test fakes run whole) run between operations when their turn comes (``Turns``), through the
  micro-batcher's path (``Batcher.execute``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import Engine, StepRun
from engines.types.request import BatchResult
from server.admission import Cost, CostModel
from server.batcher import Batcher, Job, Progress
from server.errors import DeadlineExceededError
from server.metrics import Metrics
from server.step_policy import (
    BEGIN,
    DEFAULT_TENANT,
    FINISH,
    TICK,
    WHOLE,
    Candidate,
    Decision,
    Rank,
    Record,
    Share,
    Turns,
    candidates,
    choose,
    count_bypass,
    finish_next,
    prepare,
    run_bound,
    waits,
)

log = logging.getLogger(__name__)
Operation = Decision[Job]
"""What the loop runs next (the policy's decision; each candidate's item is its Job)."""


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def on_loop_thread() -> None:
    """Fail unless the caller runs on the event loop's thread: the scheduler's state is written there only."""
    if not _on_loop():
        raise AssertionError("a step loop method ran off the event loop's thread")


def on_engine_thread() -> None:
    """Fail unless the caller runs off the event loop, in the engine's thread (``run_in_threadpool``): it blocks on
    the engine while the loop waits for it."""
    if _on_loop():
        raise AssertionError("an engine-thread method ran on the event loop's thread")


@dataclass
class RunningSet:
    key: Hashable
    jobs: list[Job] = field(default_factory=list)

    @property
    def images(self) -> int:
        return sum(j.images for j in self.jobs)


@dataclass
class Ended:
    """A job's finish (its result, or its failure) run in the engine's thread at the end of a run of operations."""

    job: Job
    result: BatchResult | None = None
    error: Exception | None = None


class StepBatcher(Batcher):
    """The queue of Batcher with a step-level loop: see the module docstring."""

    def __init__(self, engine: Engine, metrics: Metrics, lock: asyncio.Lock, max_queue: int, max_batch: int,
                 max_delay_s: float, cost: CostModel | None = None, max_running: int = 32,
                 decode_images: int = 1, weights: Mapping[str, float] | None = None) -> None:
        """``weights``: tenant label -> its weight in the fair share (``settings.auth.tenants``; unknown: 1.0)."""
        super().__init__(engine, metrics, lock, max_queue, max_batch, max_delay_s, cost)
        self.max_running = max(max_running, max_batch)
        self.decode_images = max(1, decode_images)
        self.sets: dict[Hashable, RunningSet] = {}
        self.turns = Turns()
        """Requests run whole take turns with the running sets."""
        self.share = Share(weights if weights is not None else {})
        """The tenants' fair share (step_policy.Share: their virtual times)."""
        self._nudged = threading.Event()
        """Set when a request is queued, interrupted or gone: a run of operations ends at the next boundary."""
        self.watch(self._nudged.set)

    def rows(self) -> list[Job]:
        return [job for s in self.sets.values() for job in s.jobs]

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.running > 0 or bool(self.sets)

    def ahead_seconds(self, costs: Sequence[Cost] | None = None, owner: str | None = None) -> float:
        """Estimated seconds a new request of ``costs`` (one request's jobs; the first one's wait) from ``owner``
        would wait: the work the policy would run before it (its rank among the queued and running requests,
        step_policy.waits), not the whole queue. Without ``costs``: every admitted job's (the micro-batcher's)."""
        if not costs:
            return super().ahead_seconds()
        on_loop_thread()
        c = costs[0]
        estimate = self.cost.estimate(c)
        new = Record(c.images, c.steps, self.cost.work(c.width, c.height) / self.cost.work(64, 64), time.monotonic(),
                     tenant=owner or DEFAULT_TENANT, estimate_s=None if estimate is None else estimate.seconds)
        others = [self._sync(job) for job in [*self.rows(), *self.queue]]
        return waits([*others, new], self.share)[id(new)]

    def progress_for(self, owner: str | None) -> Progress | None:
        """The caller's oldest running request (else the oldest running one; else a batch run whole)."""
        rows = self.rows()
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
                await self.rest()
                continue
            try:
                await self._round()
            except Exception as exc:  # a defect here must fail the rows, not leave every request hanging
                log.exception("step loop failed; failing the running requests")
                for running in list(self.sets.values()):
                    for job in list(running.jobs):
                        self._leave(running, job, exc)
                self.sets.clear()

    async def _round(self) -> None:
        self._nudged.clear()  # what happens from here on ends a run of operations (run_bound)
        whole = self._admit()
        if whole:
            await self.execute(whole)
            return
        self._boundary()
        now = time.monotonic()
        op = self._choose(now)
        if op is None:  # nothing can start (cannot happen: something resident could); yield
            await asyncio.sleep(0)
            return
        lead = op.lead.item
        running = None if op.kind == BEGIN else self.sets.get(op.lead.key)
        if op.kind == BEGIN:
            self._count_bypass(op, 1)
            await self._begin(lead, self._key(lead))
        elif op.kind == TICK and running is not None:
            await self._tick(running, op, *self._run_bound(op, now))
        elif running is not None and lead.images - op.lead.record.decoded > self.decode_images:
            await self._decode(running, op, *self._run_bound(op, now))
        elif running is not None:
            self._count_bypass(op, 1)
            await self._finish(running, lead, stopped=lead.interrupted)
        for key in [k for k, s in self.sets.items() if not s.jobs]:
            self.sets.pop(key)

    def _record(self, job: Job) -> Record:
        """The job's scheduler record, made when the loop first sees it (its size's work per step computed once)."""
        if job.record is None:
            b = job.batch
            job.record = Record(job.images, b.steps, self.cost.work(b.width, b.height) / self.cost.work(64, 64),
                                job.enqueued, job.deadline, tenant=job.owner or DEFAULT_TENANT)
        return job.record

    def _sync(self, job: Job) -> Record:
        """The job's record with its progress and interrupt as of now (and its estimate: the deadline guard's, and
        the work ahead of others)."""
        record, run = self._record(job), job.run
        record.steps_left = None if run is None else max(0, run.steps_total - run.steps_done)
        record.finished = run is not None and run.finished
        record.interrupted = job.interrupted
        estimate = self.cost.estimate(self.cost.cost_of(job.batch))
        record.estimate_s = None if estimate is None else estimate.seconds
        return record

    def _key(self, job: Job) -> Hashable:
        record = self._record(job)
        if record.key is None:
            found = self.engine.step_key(job.batch)
            record.key = WHOLE if found is None else found
        return record.key

    def _admit(self) -> list[Job]:
        """Step keys of the queued requests (a refused one fails here). Returns the oldest whole-run request and
        those it merges with, once every running set had an operation since the last whole run."""
        for job in list(self.queue):
            if job not in self.queue:  # dropped while an earlier one began
                continue
            try:
                key = self._key(job)
            except Exception as exc:  # the engine refuses the batch (e.g. a size it does not serve)
                self._fail_queued(job, exc)
                continue
            if key == WHOLE and self.turns.due(len(self.sets)):
                self.turns.took()
                return self._take_whole(job)
        return []

    def _take_whole(self, head: Job) -> list[Job]:
        """``head`` and the compatible whole-run requests behind it, up to max_batch images."""
        taken, images, room = [head], head.images, self.room(head)
        for job in list(self.queue):
            if (job is not head and job.group == head.group and images + job.images <= room
                    and self._key(job) == WHOLE):
                taken.append(job)
                images += job.images
        self.take(taken)
        return taken

    def _fail_queued(self, job: Job, exc: Exception) -> None:
        self.drop(job)
        if not job.future.done():
            job.future.set_exception(exc)

    def _choose(self, now: float) -> Operation | None:
        on_loop_thread()
        queued = [(self._sync(job), job) for job in self.queue]
        running = {key: [(self._sync(job), job) for job in s.jobs] for key, s in self.sets.items()}
        prepare([r for r, _ in queued] + [r for rows in running.values() for r, _ in rows], self.share)
        rooms = {self._record(job).key: self.room(job) for job in [*self.queue, *self.rows()]}
        return choose(candidates(running, queued, self.max_running), now, self.max_batch, rooms)

    def _count_bypass(self, op: Operation, times: int) -> None:
        """``times`` operations like ``op`` ran: the bypass counts (step_policy.count_bypass) and the turns."""
        on_loop_thread()
        self.turns.ran(times)
        count_bypass(op.lead.record, op.ran, op.waiting, times)
        self.share.charge(op.kind, op.ran, times, self.decode_images)

    def _run_bound(self, op: Operation, now: float) -> tuple[int, float]:
        """How many operations like ``op`` may run back to back in the engine's thread, and until when: the policy's
        bounds (step_policy.run_bound); news (``_nudged``) ends a run at the next boundary besides."""
        on_loop_thread()
        whole_in = self.turns.left(len(self.sets)) if any(self._record(j).key == WHOLE for j in self.queue) else None
        return run_bound(op, [self._sync(job) for job in [*self.rows(), *self.queue]], now, whole_in, self.share,
                         self.decode_images)

    def _go_on(self, runs: list[StepRun], done: int, most: int, until: float) -> bool:
        """Whether a run of operations goes on after ``done`` of them (in the engine's thread: reads flags only)."""
        return (done < most and not self._nudged.is_set() and not self.abandon and time.monotonic() < until
                and not any(r.finished for r in runs))

    def _then_finish(self, jobs: list[Job], done: int, most: int, until: float, runner_up: Rank | None) -> Ended | None:
        """The finish of one of ``jobs`` that a run of operations just completed, in the same thread call, when it
        is the operation the loop would choose next: nothing new arrived, the run's bounds leave room for one more,
        and the policy picks it (step_policy.finish_next). The loop waits meanwhile; the rows' records are this
        run's to write; the loop applies the result."""
        on_engine_thread()
        if done >= most or self._nudged.is_set() or self.abandon or time.monotonic() >= until:
            return None
        k = finish_next([self._sync(job) for job in jobs], time.monotonic(), runner_up, self.decode_images)
        run = None if k is None else jobs[k].run
        if k is None or run is None:
            return None
        try:
            return Ended(jobs[k], self.engine.finish(run, False))
        except Exception as exc:  # the loop answers it, like a finish it ran itself
            return Ended(jobs[k], error=exc)

    async def _begin(self, job: Job, key: Hashable) -> None:
        self.take([job])
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

    def _ticks(self, op: Operation, most: int, until: float) -> tuple[list[tuple[float, float]], Ended | None]:
        """Ticks of the operation's rows back to back (a run, ``_run_bound``): (seconds, monotonic end) of each;
        then the finish of a row they completed when it goes next (``_then_finish``)."""
        on_engine_thread()
        picked = [c.item for c in op.rows]
        runs = [j.run for j in picked if j.run is not None]
        done: list[tuple[float, float]] = []
        while not done or self._go_on(runs, len(done), most, until):
            start = time.perf_counter()
            self.engine.tick(runs)
            done.append((time.perf_counter() - start, time.monotonic()))
        return done, self._then_finish(picked, len(done), most, until, op.runner_up)

    async def _tick(self, running: RunningSet, op: Operation, most: int, until: float) -> None:
        picked = [c.item for c in op.rows]
        try:
            async with self.lock:
                ticks, ended = await run_in_threadpool(self._ticks, op, most, until)
        except Exception as exc:  # every row of the set gets the failure; none hangs
            self._count_bypass(op, 1)
            for job in list(running.jobs):
                self._leave(running, job, exc)
            self.sets.pop(running.key, None)
            return
        self._count_bypass(op, len(ticks))
        images = sum(j.images for j in picked)
        shape = picked[0].batch
        tokens = self.cost.cost_of(shape).tokens  # an edit's steps are learned under its reference tokens
        for elapsed, _ in ticks:
            self.metrics.batch_size.observe(images)
            self.metrics.unet_step_seconds.observe(elapsed)
            self.cost.observe_step(shape.width, shape.height, images, elapsed, **({"tokens": tokens} if tokens else {}))
        for job in picked:
            if job.first_step_s is None:
                job.first_step_s = ticks[0][1] - job.enqueued
            record = self._record(job)
            record.shared = images if record.shared is None else max(record.shared, images)
        self._end_run(running, op, ended)

    def _boundary(self) -> None:
        """Rows that stop here: a stop, a passed deadline, a client gone (an interrupted row is decoded where it
        is: its finish goes first)."""
        on_loop_thread()
        now = time.monotonic()
        for running in list(self.sets.values()):
            for job in list(running.jobs):
                if self.abandon:
                    self._leave(running, job, NotReadyError("server stopped before this request completed: retry "
                                                            "it on another replica"))
                elif job.deadline is not None and now >= job.deadline:
                    done = job.run.steps_done if job.run is not None else 0
                    total = job.run.steps_total if job.run is not None else job.batch.steps
                    self.metrics.cancelled.labels("deadline").inc()
                    self._leave(running, job, DeadlineExceededError(
                        f"deadline passed after {done} of {total} steps: the request left the running batch there, "
                        "nothing more is computed for it"))
                elif job.cancelled:
                    self._leave(running, job, None)
            if not running.jobs:
                self.sets.pop(running.key, None)

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

    def _decodes(self, op: Operation, most: int, until: float) -> tuple[int, Ended | None]:
        """Parts of the lead's decode back to back (a run, ``_run_bound``), all but the last; then its finish when
        it goes next (``_then_finish``). Returns how many parts ran."""
        on_engine_thread()
        job, record, run = op.lead.item, op.lead.record, op.lead.item.run
        assert run is not None
        parts = 0
        while not parts or (self._go_on([], parts, most, until) and job.images - record.decoded > self.decode_images):
            self.engine.decode(run, self.decode_images)
            record.decoded += self.decode_images
            parts += 1
        return parts, self._then_finish([job], parts, most, until, op.runner_up)

    async def _decode(self, running: RunningSet, op: Operation, most: int, until: float) -> None:
        """Parts of a finished job's decode (``decode_images`` images each, at most ``most``); the last part is its
        finish."""
        if op.lead.item.run is None:
            return
        try:
            async with self.lock:
                parts, ended = await run_in_threadpool(self._decodes, op, most, until)
        except Exception as exc:
            self._count_bypass(op, 1)
            self._leave(running, op.lead.item, exc)
            return
        self._count_bypass(op, parts)
        self._end_run(running, op, ended)

    def _end_run(self, running: RunningSet, op: Operation, ended: Ended | None) -> None:
        """Account for and answer the finish a run ended with (``_then_finish``), if it did: one more operation."""
        if ended is not None:
            finish = Candidate(FINISH, self._record(ended.job), running.key, ended.job)
            self._count_bypass(Operation(FINISH, finish, [finish], op.waiting), 1)
            self._finished(running, ended)

    async def _finish(self, running: RunningSet, job: Job, stopped: bool = False) -> None:
        if job not in running.jobs or job.run is None:
            return
        run: StepRun = job.run
        try:
            async with self.lock:
                ended = Ended(job, await run_in_threadpool(self.engine.finish, run, stopped))
        except Exception as exc:
            ended = Ended(job, error=exc)
        self._finished(running, ended)

    def _finished(self, running: RunningSet, ended: Ended) -> None:
        """Answer a finished job (its images, or its failure) and account for it."""
        on_loop_thread()
        job, result = ended.job, ended.result
        if job in running.jobs:
            running.jobs.remove(job)
        shared = job.images if job.record is None or job.record.shared is None else job.record.shared
        self._done(job)
        if result is None:
            if not job.future.done():
                job.future.set_exception(ended.error or RuntimeError("finish returned nothing"))
            return
        elapsed = time.perf_counter() - job.started
        self.last_provider = result.provider
        self.cost.observe(self.cost.cost_of(job.batch, steps=result.steps_done, images=job.images),
                          result.timings.total or elapsed, result.timings)
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
