"""Step-level batching's verbs on the engine's pipelines (engines/protocol.py Engine.step_key, begin, tick, decode,
finish, discard): each batch denoised step by step in its own buffer scope, every call under the engine's lock."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence

from engines.errors import InvalidRequestError
from engines.lora.active import Adapters, Weights
from engines.pipelines.contract import Begun, Pipeline, PipelineOutput, Stepwise
from engines.protocol import StepRun
from engines.types.health import Faults
from engines.types.request import Batch, BatchResult, control_key

Result = Callable[[Batch, Pipeline, PipelineOutput, Mapping[str, object], set[str], bool], BatchResult]
"""The engine's answer for a finished batch: (batch, pipeline, output, merged weights, adapted components,
stopped) -> the result ``generate`` would return, refused alike (all-black images, LoRA that did not apply)."""


class Scopes:
    """Buffer scope names for running batches: the lowest free number, so a scope's buffers are reused by the next
    batch that takes it instead of growing the buffer cache."""

    def __init__(self) -> None:
        self._used: set[int] = set()

    def take(self) -> str:
        k = next(i for i in range(len(self._used) + 1) if i not in self._used)
        self._used.add(k)
        return f"run{k}/"

    def free(self, scope: str) -> None:
        self._used.discard(int(scope.removeprefix("run").rstrip("/")))


@dataclasses.dataclass(eq=False)
class Stepping:
    """A batch being denoised step by step (Engine.begin): its pipeline, staged state, LoRA weights and scope."""

    pipeline: Pipeline
    stages: Stepwise
    begun: Begun
    weights: Mapping[str, object]
    adapters: Adapters
    scope: str
    released: bool = False

    @property
    def steps_done(self) -> int:
        return int(self.begun.state.done)

    @property
    def steps_total(self) -> int:
        return self.begun.steps_total

    @property
    def finished(self) -> bool:
        return self.begun.finished


class StepVerbs:
    """The engine's step verbs. The engine stays the owner of its pipelines, LoRA library and lock: it hands in how
    to pick a batch's pipeline, check and merge its LoRA set, and answer a finished batch."""

    def __init__(self, lock: threading.Lock, faults: Faults | None, pipeline_for: Callable[[Batch], Pipeline],
                 check_loras: Callable[[Batch], None], weights: Callable[[Batch], Weights],
                 result: Result) -> None:
        """``weights`` runs under ``lock`` (a merge runs on the device like a step)."""
        self._lock = lock
        self._faults = faults
        self._pipeline_for = pipeline_for
        self._check_loras = check_loras
        self._weights = weights
        self._result = result
        self._scopes = Scopes()
        """Buffer scopes of the batches denoised side by side."""

    def step_key(self, batch: Batch) -> Hashable | None:
        """(size's pipeline, width, height, LoRA set, ControlNet set) for a pipeline staged for step-level
        batching; None for one that runs batches whole."""
        pipeline = self._pipeline_for(batch)
        if pipeline.stepwise() is None:
            return None
        return (id(pipeline), batch.width, batch.height, batch.lora_key, control_key(batch.control))

    def begin(self, batch: Batch) -> StepRun:
        pipeline = self._pipeline_for(batch)
        stages = pipeline.stepwise()
        if stages is None:
            raise InvalidRequestError("this model runs batches whole (no step-level batching)", param="model")
        self._check_loras(batch)
        with self._lock:
            weights = self._weights(batch)
            adapters = Adapters(weights)
            scope = self._scopes.take()
            try:
                with pipeline.runtime.scoped(scope):
                    begun = stages.begin(batch, adapters=adapters)
            except BaseException:
                self._scopes.free(scope)
                raise
        return Stepping(pipeline, stages, begun, weights, adapters, scope)

    def tick(self, runs: Sequence[StepRun]) -> None:
        steps = [_stepping(run) for run in runs if not run.finished]
        if not steps:
            return
        first = steps[0]
        if any(s.pipeline is not first.pipeline for s in steps):
            raise ValueError("a tick runs the rows of one pipeline (one step key)")
        runtime = first.pipeline.runtime
        with self._lock:
            start = time.perf_counter()
            with runtime.one_tick():  # on a shared stream: one synchronize at the end, not one per run
                first.stages.run_denoiser([s.begun.state for s in steps])
                for s in steps:
                    with runtime.scoped(s.scope):
                        first.stages.advance(s.begun.state)
            if self._faults is not None and self._faults.step_latency_s > 0:
                time.sleep(self._faults.step_latency_s)
            elapsed = time.perf_counter() - start
        rows = sum(len(s.begun.batch.images) for s in steps)
        for s in steps:  # each batch's share of the tick, by its images
            s.begun.denoise_s += elapsed * len(s.begun.batch.images) / rows

    def decode(self, run: StepRun, images: int) -> None:
        s = _stepping(run)
        with self._lock, s.pipeline.runtime.scoped(s.scope):
            s.stages.decode(s.begun, images)

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        s = _stepping(run)
        s.begun.stopped = s.begun.stopped or stopped
        try:
            with self._lock, s.pipeline.runtime.scoped(s.scope):
                out = s.stages.finish(s.begun)
                if self._faults is not None and self._faults.latency_s > 0:
                    time.sleep(self._faults.latency_s)
        finally:
            self.discard(run)
        return self._result(s.begun.batch, s.pipeline, out, s.weights, s.adapters.adapted, s.begun.stopped)

    def discard(self, run: StepRun) -> None:
        s = _stepping(run)
        if not s.released:
            s.released = True
            self._scopes.free(s.scope)


def _stepping(run: StepRun) -> Stepping:
    if not isinstance(run, Stepping):
        raise TypeError(f"not a run this engine began: {type(run).__name__}")
    return run
