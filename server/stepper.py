"""Step-level batching: requests join and leave the running batch at step boundaries.

Per step key (engines' ``Engine.step_key``: the size's pipeline, the latent shape and the LoRA set) a running set
of rows. The loop runs one *operation* at a time: a request's **begin** (encode, noise, edit preparation), a **tick**
of one set (one denoiser evaluation over the picked rows, CFG rows included, then each request's own step graph
with its coefficients, timestep and history), a part of a request's **decode**, or its **finish** (the last part of
its decode; answered at once). Rows may differ
in prompt, seed, steps, sampler, guidance, strength (an edit joins at its start step) and CFG.

Policy: **smallest slowdown first, bounded bypass, deadline guard**.
- **Which operation runs next**: that of the request with the smallest *work left x whole work*, where work is
  images x (steps + ``FINISH_EVALS`` for the decode) x the size's work per step (pixels; a DiT's tokens); oldest
  first among equals. This is Smith's rule weighted by 1 / whole work: the order that keeps the sum of slowdowns
  (latency over solo latency) smallest. A 1-image 4-step request (6 x 6) that arrives while 4-image 50-step
  requests run (208 x 208 at the start, 8 x 208 with only their decode left) is begun, ticked and decoded before
  any of their operations: it waits for the operation in flight only, never for a whole generation. Among requests
  of equal size the one with the least left goes first, and a request with only its decode left goes before longer
  work begins (a 1-image request's decode, 2 x 52, before a new 20-step one, 22 x 22). Across sets (sizes, LoRA
  sets) the same order holds: the set of the request that ranks first ticks.
  Why not round robin across sets or rows: it makes every request as slow as the total work in flight; why not
  FIFO: that is head-of-line blocking again; why not the work left alone (SRPT, best for the mean latency): a
  4-image request a few steps or a decode from its end then goes before a 1-image request that just arrived,
  which costs the short one about its own length again and the long one nothing it would notice.
- **A decode is split in parts** of ``decode_images`` images (``[queue] decode_images``, 1 by default), each an
  operation of its own: a short request that arrives while a 4-image request decodes waits for one image's decode,
  not four (on a CPU a decode costs the same per image either way; on a GPU one image already fills it at the
  served sizes).
- **A tick is filled to the budget**: the lead row's set gives the call its other rows, least work first, until
  the call holds ``max_batch`` images (the TensorRT profiles and the memory plan are sized for it; a larger
  request runs alone). A queued request of that set that fits the room left begins first, so it joins this very
  call: a call of four images costs about twice one image's on a CPU, and about one image's on a GPU.
- **Bounded bypass**: each operation run for a smaller request (less whole work) while a larger one could have
  run counts as one bypass of the larger one; after ``BYPASS_LIMIT`` bypasses in a row, the larger one's next
  operation goes first (then it counts again). A stream of short requests therefore takes at most that many
  operations in a row from a long one (which still fills their ticks when there is room), and never stops it.
  Requests of equal whole work do not count against each other: among them the one with the least left goes
  first, which finishes them in order without starving any (a later equal request has more left), so equal long
  requests do not push each other, or a starved one, ahead of short requests every few operations.
- **Deadline guard**: a request whose deadline is nearer than ``URGENT_FACTOR`` x its estimated remaining time is
  urgent and goes first (earliest deadline first), so bypass never turns into a 504.
- **Runs**: operations the loop would choose one after another with nothing new to decide on (the ticks of the
  same rows, the parts of one decode, then the finish of the row they completed when it ranks first) run back to
  back in one call of the engine's thread, not one event-loop hop each (``_run_bound``, ``_then_finish``): the
  order is the same, and a run ends at the next boundary when a request is queued, interrupted or gone, on a stop,
  when a row finishes, before a waiting request reaches its bypass limit or turns urgent, and before a deadline.
  On a CPU the hop and the decision cost about a millisecond per operation under load, 5-7% of a tick.
- **Residency**: up to ``max_running`` images are encoded, with their state on the device (latents, history,
  input and output: a few MB per image); a queued request begins when its images fit.
- **Admission** keeps its meaning: the queue, 429s and admission by cost are the micro-batcher's.
- **At every operation boundary**: a row whose deadline passed leaves (504) and frees its slot; a row whose client
  went away leaves; an interrupted row (``/sdapi/v1/interrupt``) is decoded where it is, first (A1111's
  interrupt); a stop (``abandon``) ends every row; drain waits for the rows like for batches.
- Batches the engine runs whole (``step_key`` None: a pipeline without stages) run between two rounds of ticks,
  through the micro-batcher's path.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

from engines.errors import NotReadyError
from engines.protocol import Engine, StepRun
from engines.types.request import BatchResult
from server.admission import Cost, CostModel
from server.batcher import Batcher, Job, Progress
from server.errors import DeadlineExceededError
from server.metrics import Metrics

log = logging.getLogger(__name__)
WHOLE = ("whole",)
"""The key of requests the engine runs whole."""
BYPASS_LIMIT = 16
"""Operations a waiting request may be bypassed by smaller ones in a row before its own goes first."""
FINISH_EVALS = 2
"""A decode costs about this many denoiser evaluations of the same images (CPU and GPU alike, SD 1.5 to SDXL)."""
URGENT_FACTOR = 2.0
"""A request whose deadline is nearer than this many times its estimated remaining seconds goes first."""
MAX_RUN = 64
"""Operations of one kind for the same rows run back to back in the engine's thread at most (a run)."""
BEGIN, TICK, FINISH = "begin", "tick", "finish"


@dataclass
class RunningSet:
    key: Hashable
    jobs: list[Job] = field(default_factory=list)

    @property
    def images(self) -> int:
        return sum(j.images for j in self.jobs)


@dataclass
class Operation:
    """What the loop runs next: ``kind`` for ``lead`` (a tick also runs ``rows``, the lead's included)."""

    kind: str
    lead: Job
    rows: list[Job] = field(default_factory=list)
    running: RunningSet | None = None
    waiting: list[Job] = field(default_factory=list)
    """Every job that had an operation it could run (bypass counts)."""
    first: bool = False
    """The lead goes first as interrupted, starved or urgent (tier 0): the loop decides again after it."""
    runner_up: tuple[int, float, float] | None = None
    """The best priority among the candidates this operation leaves out (None: none)."""


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
                 decode_images: int = 1) -> None:
        super().__init__(engine, metrics, lock, max_queue, max_batch, max_delay_s, cost)
        self.max_running = max(max_running, max_batch)
        self.decode_images = max(1, decode_images)
        self._decoded: dict[int, int] = {}
        """Images of each finished job decoded so far (by job id)."""
        self._work: dict[int, float] = {}
        """Each job's relative work per image-step at its size (by job id)."""
        self._bypassed: dict[int, int] = {}
        """Operations run for smaller requests in a row while each job waited (by job id)."""
        self._shared: dict[int, int] = {}
        """The most images any tick of each job ran with (by job id): its x-sdserve-batch-size."""
        self.sets: dict[Hashable, RunningSet] = {}
        self._keys: dict[int, Hashable] = {}
        """Each queued job's step key, computed once (by job id)."""
        self._ops_since_whole = 1 << 30
        """Operations since a request ran whole: the next one waits until every running set had one."""
        self._nudged = threading.Event()
        """Set when a request is queued, interrupted or gone: a run of operations ends at the next boundary."""

    def _notify(self) -> None:
        self._nudged.set()
        super()._notify()

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
        self._nudged.clear()  # what happens from here on ends a run of operations (_run_bound)
        whole = self._admit()
        if whole:
            await self._execute(whole)
            return
        self._boundary()
        now = time.monotonic()
        op = self._choose(now)
        if op is None:  # nothing can start (cannot happen: something resident could); yield
            await asyncio.sleep(0)
            return
        left = op.lead.images - self._decoded.get(id(op.lead), 0)
        if op.kind == BEGIN:
            self._count_bypass(op, 1)
            await self._begin(op.lead, self._key(op.lead))
        elif op.kind == TICK and op.running is not None:
            await self._tick(op.running, op, *self._run_bound(op, now))
        elif op.running is not None and left > self.decode_images:
            await self._decode(op.running, op, *self._run_bound(op, now))
        elif op.running is not None:
            self._count_bypass(op, 1)
            await self._finish(op.running, op.lead, stopped=op.lead.interrupted)
        for key in [k for k, s in self.sets.items() if not s.jobs]:
            self.sets.pop(key)

    def _key(self, job: Job) -> Hashable:
        if id(job) not in self._keys:
            found = self.engine.step_key(job.batch)
            self._keys[id(job)] = WHOLE if found is None else found
        return self._keys[id(job)]

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
            if key == WHOLE and self._ops_since_whole >= len(self.sets):
                self._ops_since_whole = 0
                return self._take_whole(job)
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
            self._forget(job)
        self._gauge()
        return taken

    def _fail_queued(self, job: Job, exc: Exception) -> None:
        self._drop(job)
        self._forget(job)
        if not job.future.done():
            job.future.set_exception(exc)

    def _forget(self, job: Job) -> None:
        for table in (self._keys, self._work, self._bypassed, self._shared, self._decoded):
            table.pop(id(job), None)

    def _scale(self, job: Job) -> float:
        """The job's work per image-step relative to 64x64 (pixels, or a DiT's tokens), computed once."""
        if id(job) not in self._work:
            b = job.batch
            self._work[id(job)] = self.cost.work(b.width, b.height) / self.cost.work(64, 64)
        return self._work[id(job)]

    def _whole(self, job: Job) -> float:
        """The job's whole work in image-evaluations at its size: images x (steps + ``FINISH_EVALS``)."""
        return job.images * (job.batch.steps + FINISH_EVALS) * self._scale(job)

    def _left(self, job: Job) -> float:
        """The job's remaining work in image-evaluations at its size: its images x (steps left + its decode, about
        ``FINISH_EVALS`` evaluations; once its steps are done, the images not yet decoded x ``FINISH_EVALS``),
        scaled by the size's relative work per step (pixels, or a DiT's tokens)."""
        run = job.run
        if run is not None and (run.finished or job.interrupted):  # its decode only, what is left of it
            return (job.images - self._decoded.get(id(job), 0)) * FINISH_EVALS * self._scale(job)
        steps = job.batch.steps if run is None else max(0, run.steps_total - run.steps_done)
        return job.images * (steps + FINISH_EVALS) * self._scale(job)

    def _priority(self, job: Job, now: float) -> tuple[int, float, float]:
        """Smaller first: (0, deadline, enqueued) for an interrupted, starved or urgent job, else (1, work left x
        whole work, enqueued): Smith's rule with weights 1 / whole work, the order that keeps the sum of slowdowns
        (latency over solo latency) smallest; among requests of equal work, the least left first."""
        due = job.deadline if job.deadline is not None else math.inf
        if job.interrupted or self._bypassed.get(id(job), 0) >= BYPASS_LIMIT:
            return (0, due, job.enqueued)
        left, whole = self._left(job), self._whole(job)
        if job.deadline is not None:
            estimate = self.cost.estimate(job.cost)
            seconds = 0.0 if estimate is None else estimate.seconds * left / whole
            if job.deadline - now <= URGENT_FACTOR * seconds:
                return (0, due, job.enqueued)
        return (1, left * whole, job.enqueued)

    def _candidates(self) -> list[tuple[str, Job, RunningSet | None]]:
        """Every job with an operation it could run now: resident rows (tick, or finish when done or interrupted)
        and queued requests whose images fit the residency budget (begin)."""
        found: list[tuple[str, Job, RunningSet | None]] = []
        for running in self.sets.values():
            for job in running.jobs:
                done = job.run is None or job.run.finished or job.interrupted
                found.append((FINISH if done else TICK, job, running))
        resident = sum(s.images for s in self.sets.values())
        for job in self.queue:
            if self._keys.get(id(job), WHOLE) == WHOLE:
                continue
            if not resident or resident + job.images <= self.max_running:
                found.append((BEGIN, job, None))
        return found

    def _choose(self, now: float) -> Operation | None:
        found = self._candidates()
        if not found:
            return None
        ranked = sorted((self._priority(c[1], now), k) for k, c in enumerate(found))  # each priority once
        order = [found[k] for _, k in ranked]
        kind, lead, running = order[0]
        op = Operation(kind, lead, [lead], running, [job for _, job, _ in found], ranked[0][0][0] == 0)
        if kind == TICK and running is not None:
            images = lead.images
            for other_kind, job, other in order[1:]:
                if other is running and other_kind == TICK and images + job.images <= self.max_batch:
                    op.rows.append(job)
                    images += job.images
            for other_kind, job, _ in order[1:]:  # a queued request that fits the call's room begins first
                if (other_kind == BEGIN and self._keys.get(id(job)) == running.key
                        and images + job.images <= self.max_batch):
                    return Operation(BEGIN, job, [job], None, op.waiting, op.first)
        ran = {id(job) for job in op.rows}
        op.runner_up = next((p for p, k in ranked if id(found[k][1]) not in ran), None)
        return op

    def _count_bypass(self, op: Operation, times: int) -> None:
        """Every waiting job with more whole work than the lead that ``times`` operations like this one leave out
        is bypassed that many times more; a job that runs starts counting again."""
        lead = self._whole(op.lead)
        ran = {id(j) for j in op.rows}
        self._ops_since_whole += times
        for job in op.waiting:
            if id(job) in ran:
                self._bypassed.pop(id(job), None)
            elif self._whole(job) > lead:
                self._bypassed[id(job)] = self._bypassed.get(id(job), 0) + times

    def _run_bound(self, op: Operation, now: float) -> tuple[int, float]:
        """How many operations like ``op`` (a tick of the same rows, the next parts of the same decode) may run
        back to back in the engine's thread, and until when (monotonic): a *run*, one thread hop instead of one
        per operation. With nothing new, they are what the loop would choose one by one: the rows they run only
        move further ahead of the rest. What changes the choice without news bounds them: a waiting request
        reaching its bypass limit (the count), a deadline passing or a request turning urgent (the time). A row
        finishing, a request queued, interrupted or gone, and a stop end the run at the next boundary
        (``_nudged``, checked after every operation); a lead that goes first as urgent or starved runs one."""
        if op.first:
            return 1, now
        ran = {id(j) for j in op.rows}
        lead = self._whole(op.lead)
        most, until = MAX_RUN, math.inf
        for job in op.waiting:
            if id(job) not in ran and self._whole(job) > lead:
                most = min(most, BYPASS_LIMIT - self._bypassed.get(id(job), 0))
        if any(self._keys.get(id(job)) == WHOLE for job in self.queue):  # it runs once every set had an operation
            most = min(most, len(self.sets) - self._ops_since_whole)
        for job in [*self._rows(), *self.queue]:
            if job.deadline is None:
                continue
            until = min(until, job.deadline)
            estimate = self.cost.estimate(job.cost)
            if id(job) not in ran and estimate is not None:
                until = min(until, job.deadline - URGENT_FACTOR * estimate.seconds * self._left(job) / self._whole(job))
        return max(1, most), until

    def _go_on(self, runs: list[StepRun], done: int, most: int, until: float) -> bool:
        """Whether a run of operations goes on after ``done`` of them (in the engine's thread: reads flags only)."""
        return (done < most and not self._nudged.is_set() and not self.abandon and time.monotonic() < until
                and not any(r.finished for r in runs))

    def _then_finish(self, jobs: list[Job], done: int, most: int, until: float,
                     runner_up: tuple[int, float, float] | None) -> Ended | None:
        """The finish of one of ``jobs`` that a run of operations just completed, in the same thread call, when it
        is the operation the loop would choose next: nothing new arrived, the run's bounds leave room for one more,
        it ranks before the run's other rows and every request the run left out (their priorities do not change
        within the bounds), and what is left of its decode is one part. Runs in the engine's thread while the loop
        waits for it (the scheduler's tables are not written meanwhile); the loop applies the result."""
        if done >= most or self._nudged.is_set() or self.abandon or time.monotonic() >= until:
            return None
        now = time.monotonic()
        for job in jobs:  # they ran: their bypass counts start again (as _count_bypass does after the run)
            self._bypassed.pop(id(job), None)
        best, k = min((self._priority(job, now), k) for k, job in enumerate(jobs))
        job, run = jobs[k], jobs[k].run
        if (run is None or not run.finished or job.interrupted or (runner_up is not None and not best < runner_up)
                or job.images - self._decoded.get(id(job), 0) > self.decode_images):
            return None
        try:
            return Ended(job, self.engine.finish(run, False))
        except Exception as exc:  # the loop answers it, like a finish it ran itself
            return Ended(job, error=exc)

    async def _begin(self, job: Job, key: Hashable) -> None:
        self.queue.remove(job)
        self._keys.pop(id(job), None)
        self._gauge()
        if job.deadline is not None and time.monotonic() >= job.deadline:
            job.state = "dropped"
            self._forget(job)
            self.metrics.cancelled.labels("deadline").inc()
            if not job.future.done():
                job.future.set_exception(DeadlineExceededError("deadline passed before the request started"))
            return
        if job.cancelled or job.future.done():
            job.state = "dropped"
            self._forget(job)
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
        runs = [j.run for j in op.rows if j.run is not None]
        done: list[tuple[float, float]] = []
        while not done or self._go_on(runs, len(done), most, until):
            start = time.perf_counter()
            self.engine.tick(runs)
            done.append((time.perf_counter() - start, time.monotonic()))
        return done, self._then_finish(op.rows, len(done), most, until, op.runner_up)

    async def _tick(self, running: RunningSet, op: Operation, most: int, until: float) -> None:
        picked = op.rows
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
        for elapsed, _ in ticks:
            self.metrics.batch_size.observe(images)
            self.metrics.unet_step_seconds.observe(elapsed)
        for job in picked:
            if job.first_step_s is None:
                job.first_step_s = ticks[0][1] - job.enqueued
            self._shared[id(job)] = max(self._shared.get(id(job), 0), images)
        self._end_run(running, op, ended)

    def _boundary(self) -> None:
        """Rows that stop here: a stop, a passed deadline, a client gone (an interrupted row is decoded where it
        is: its finish goes first)."""
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
        self._forget(job)

    def _decodes(self, op: Operation, most: int, until: float) -> tuple[int, Ended | None]:
        """Parts of the lead's decode back to back (a run, ``_run_bound``), all but the last; then its finish when
        it goes next (``_then_finish``). Returns how many parts ran."""
        job, run = op.lead, op.lead.run
        assert run is not None
        parts = 0
        while not parts or (self._go_on([], parts, most, until)
                            and job.images - self._decoded.get(id(job), 0) > self.decode_images):
            self.engine.decode(run, self.decode_images)
            self._decoded[id(job)] = self._decoded.get(id(job), 0) + self.decode_images
            parts += 1
        return parts, self._then_finish([job], parts, most, until, op.runner_up)

    async def _decode(self, running: RunningSet, op: Operation, most: int, until: float) -> None:
        """Parts of a finished job's decode (``decode_images`` images each, at most ``most``); the last part is its
        finish."""
        if op.lead.run is None:
            return
        try:
            async with self.lock:
                parts, ended = await run_in_threadpool(self._decodes, op, most, until)
        except Exception as exc:
            self._count_bypass(op, 1)
            self._leave(running, op.lead, exc)
            return
        self._count_bypass(op, parts)
        self._end_run(running, op, ended)

    def _end_run(self, running: RunningSet, op: Operation, ended: Ended | None) -> None:
        """Account for and answer the finish a run ended with (``_then_finish``), if it did: one more operation."""
        if ended is not None:
            self._count_bypass(Operation(FINISH, ended.job, [ended.job], running, op.waiting), 1)
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
        job, result = ended.job, ended.result
        if job in running.jobs:
            running.jobs.remove(job)
        shared = self._shared.get(id(job), job.images)
        self._done(job)
        if result is None:
            if not job.future.done():
                job.future.set_exception(ended.error or RuntimeError("finish returned nothing"))
            return
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
