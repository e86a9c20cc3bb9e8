"""The engine protocol: the only way server/ reaches inference, with typed requests, results and reports.

Nothing crossing this boundary is a ``dict[str, Any]``: the capability snapshot, the self-test report, the GPU
signature and ORT log events are frozen types, and their JSON shape is their ``model_dump(mode="json")``
(engines/schemas/capabilities.schema.json is tested against it). The types live in engines/types/ by concern
(request, model, health, snapshot); this module holds the verbs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Protocol

from engines.types.health import CanaryCheck, GpuSample, Signature, TelemetrySource
from engines.types.model import LoraInfo, LoraStats, ModelInfo
from engines.types.request import Batch, BatchResult, LoraUse, StepHook
from engines.types.snapshot import Capabilities, CheckResult, OrtEvent, SelfTestReport


class StepRun(Protocol):
    """One admitted batch denoised step by step beside others (step-level batching): Engine.begin makes it,
    Engine.tick advances it one denoiser evaluation, Engine.decode decodes a part of it, Engine.finish decodes the
    rest and returns it, Engine.discard drops it."""

    @property
    def steps_done(self) -> int: ...

    @property
    def steps_total(self) -> int: ...

    @property
    def finished(self) -> bool:
        """Every evaluation ran: the next call for it is ``finish``."""


class Engine(Protocol):
    """Lifecycle verbs of an inference engine."""

    def preflight(self) -> tuple[CheckResult, ...]:
        """Check the runtime and device before any model loads; raises when the policy cannot be met."""

    def load(self) -> None:
        """Build sessions under the provider policy; raises NotReadyError when the policy cannot be met."""

    def self_test(self) -> SelfTestReport:
        """Run canaries on the loaded model; raises SelfTestError when the output or latency is wrong."""

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        """Run one batch; raises InvalidRequestError for requests the model cannot serve. ``on_step`` reports
        progress after every step and may stop the batch there."""

    def step_key(self, batch: Batch) -> Hashable | None:
        """Batches with equal keys may share denoiser calls step by step (same model size, latent shape and LoRA
        set; prompts, seeds, steps, samplers, guidance and strengths may differ); None: this batch runs whole
        through ``generate``."""

    def begin(self, batch: Batch) -> StepRun:
        """Encode ``batch`` and prepare its denoising state (its own device buffers); raises like ``generate``."""

    def tick(self, runs: Sequence[StepRun]) -> None:
        """One denoiser evaluation for every run (equal step keys, none finished), in one call where the model
        allows, then each run's own step."""

    def decode(self, run: StepRun, images: int) -> None:
        """Decode up to ``images`` more of a run's images (kept with it) once its denoising is over: a decode
        split in parts, so a short request waits for one part at most, not a whole batch's."""

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        """Decode ``run`` where its denoising is (all steps, or where ``stopped`` cut it: an interrupt), what
        ``decode`` did not yet, and free its state."""

    def discard(self, run: StepRun) -> None:
        """Free a run that will not be finished (deadline, cancelled, stop)."""

    def canary(self) -> CanaryCheck:
        """Run one canary now (the watchdog calls this while no request runs)."""

    def record_fingerprints(self) -> Path:
        """Run every canary shape once and store the outputs' fingerprints next to the model."""

    def check_health(self) -> None:
        """Raise NotReadyError when the engine can no longer serve on its proven path."""

    def capabilities(self) -> Capabilities:
        """The capability snapshot: providers, options, checks, verdict."""

    def telemetry(self) -> TelemetrySource | None:
        """The device's telemetry (NVML on a GPU); None on the CPU or when NVML cannot start."""

    def signature(self, samples: list[GpuSample], requests_running: bool) -> Signature:
        """Classify a window of telemetry samples (healthy compute, livelock, idle, fallback suspected)."""

    def ort_events(self) -> list[OrtEvent]:
        """Classified ONNX Runtime log lines printed since the last call (after boot)."""

    @property
    def info(self) -> ModelInfo:
        """The loaded model's serving limits."""

    def loras(self) -> tuple[LoraInfo, ...]:
        """The adapter library's files (empty without [runtime.lora] dir)."""

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        """Scan the adapter library again (new, changed and removed files)."""

    def lora_cost_s(self, uses: tuple[LoraUse, ...]) -> float:
        """Seconds an adapter set costs before its batch's first step: 0 when cached (or none), else its merge,
        priced by the bytes it writes. InvalidRequestError (param ``loras``) for a set over the LoRA budget."""

    def lora_stats(self) -> LoraStats:
        """The merged-set cache's cumulative figures (all zero without a LoRA library)."""

    def close(self) -> None:
        """Release sessions and device buffers."""
