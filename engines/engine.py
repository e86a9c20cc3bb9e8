"""OrtEngine: the engine protocol on ONNX Runtime, with preflight against the version matrix and a capability
snapshot that says whether the fast path is really running."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from PIL import Image

from engines import architectures
from engines.artifact_checks import ANY, ArtifactChecks
from engines.config import (
    Canary,
    CanarySuite,
    Matrix,
    RuntimeSettings,
    SelfTestPlan,
    Shape,
    SignatureThresholds,
)
from engines.errors import (
    ArtifactError,
    GpuUnavailableError,
    InferenceError,
    InvalidRequestError,
    NotReadyError,
    SdserveError,
    SelfTestError,
    VersionMismatchError,
)
from engines.health import boot_fit, controlnet_canary, request_memory, selftest, signature
from engines.health.capabilities import Proven, snapshot
from engines.health.integrity import IntegrityWatcher
from engines.health.preflight import Check, Observations, evaluate, failures, gather
from engines.lora.active import Adapters, Weights
from engines.pipelines.contract import Pipeline, PipelineOutput
from engines.pipelines.ort_model import OrtModel
from engines.protocol import StepRun
from engines.runtime.libdeps import preload
from engines.runtime.ortlog import StderrTee
from engines.runtime.sessions import Runtime
from engines.steps import StepVerbs
from engines.types.health import CanaryCheck, Faults, GpuSample, Signature, TelemetrySource, fingerprint
from engines.types.model import LoraInfo, LoraStats, ModelInfo
from engines.types.request import Batch, BatchResult, EditImage, GeneratedImage, LoraUse, StepHook
from engines.types.snapshot import Capabilities, CheckResult, OrtEvent, SelfTestReport

if TYPE_CHECKING:
    from engines.lora.manager import LoraManager

log = logging.getLogger(__name__)


UNFIT = (SdserveError, OSError, ValueError, KeyError, TypeError)
"""What a ControlNet folder that does not fit the model raises while it is attached (refused, never fatal)."""


def _describe(checks: list[Check]) -> str:
    return "; ".join(f"{c.name}: found {c.observed}, expected {c.expected} ({c.remediation})" for c in checks)


class OrtEngine:
    """One model on one device. ``generate`` runs one batch at a time (a lock), never concurrently."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings, matrix: Matrix | None = None,
                 plan: SelfTestPlan | None = None, faults: Faults | None = None,
                 signature_thresholds: SignatureThresholds | None = None, watch_ort_log: bool = False,
                 max_running: int = 32) -> None:
        """``watch_ort_log``: from preflight on, tee fd 2 and classify what ORT prints after boot (serving only);
        ``max_running``: the step scheduler's resident images, which size the runtime's buffer caches."""
        self.model_dir = model_dir
        self.max_running = max_running
        self.settings = settings
        self.matrix = matrix or Matrix()
        self.plan = plan
        self.faults = faults
        self._report: SelfTestReport | None = None
        self._boot_fingerprint: np.ndarray | None = None
        self._pipelines: dict[str, Pipeline] = {}
        """Per served size ("512x512") with prebuilt TensorRT engines (one engine per size); else one, under ANY."""
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()
        self._observations: Observations | None = None
        self._checks: list[Check] = []
        self._errors: list[str] = []
        self._verified = ArtifactChecks(model_dir, settings)
        self._info: ModelInfo | None = None
        self._thresholds = signature_thresholds or SignatureThresholds()
        self._tee = StderrTee() if watch_ort_log else None
        self._lora: LoraManager | None = None
        self._steps = StepVerbs(self._lock, faults, self._pipeline_for, self._check_loras, self._lora_weights,
                                self._result)

    def preflight(self) -> tuple[CheckResult, ...]:
        """Check versions, provider libraries and the device against the matrix. With a GPU policy, any failure
        raises: version mismatches (exit 21) before a missing GPU path (exit 20)."""
        if self._tee is not None and not self._tee.running:
            self._tee.start()
        if self.settings.device == "cuda":  # what preflight resolves is what sessions will load: preload first
            preload(tensorrt="TensorrtExecutionProvider" in self.settings.providers)
        plugin = self.settings.plugin
        self._observations = gather(plugin) if plugin is not None else gather()
        self._checks = evaluate(self._observations, self.matrix, self.settings)
        gpu, versions = failures(self._checks)
        for check in self._checks:
            if check.status == "fail":
                log.error("preflight %s: found %s, expected %s", check.name, check.observed, check.expected)
        if versions:
            raise VersionMismatchError("version matrix mismatch: " + _describe(versions))
        if gpu:
            what = f"accelerator {plugin.name}" if plugin is not None else "GPU"
            raise GpuUnavailableError(f"{what} path unavailable: " + _describe(gpu))
        return tuple(c.to_model() for c in self._checks)

    def load(self) -> None:
        """Verify artifacts, then build every session under the policy."""
        try:
            sources = self._verify_artifacts()
            self._integrity = IntegrityWatcher(self.model_dir)  # what was just verified, watched after boot
            boot_fit.require_fits(self.model_dir, self.settings, self._device_total(),
                                  f"CUDA device {self.settings.device_id}")  # never an out-of-memory halfway
            self._runtime = Runtime(self.settings, self.model_dir, self._device_total(), max_running=self.max_running,
                                    max_cached_bytes=self.settings.buffer_cache_mb << 20)
            self._load_pipelines(sources)
            # admission's estimate and the arena trim's rule; prebuilt engines hold memory sized when they were built
            memory = request_memory.for_folder(self.model_dir) if ANY in self._pipelines else None
            self._info, self._runtime.memory = dataclasses.replace(self.info, memory=memory), memory
            if self.plan is not None:  # the family's canary set (configs/canaries.toml [family.<name>])
                self.plan = dataclasses.replace(self.plan, family=self.info.family, suite=self.plan.suite.for_family(
                    self.info.family, edits=self.info.instruct_images > 0))
            if self.settings.controlnet.dir:  # before the LoRA variants: the residual UNet gets its own
                self._attach_controlnets(Path(self.settings.controlnet.dir))
            if self.settings.lora.dir:
                self._load_lora()
        except NotReadyError as exc:
            self._errors.append(str(exc))
            raise
        if self.settings.allow_cpu:
            log.warning("CPU execution allowed by the profile: this server is NOT accelerated")

    def _load_pipelines(self, sources: dict[str, dict[str, Path]]) -> None:
        """The folder's architecture's pipeline (engines/architectures.py), per served size on its prebuilt
        EP-context models (`sdserve engines build`: TensorRT plans, engines/build/trtplan.py and trtplan_dit.py; or
        a plugin EP's), else one for every size."""
        assert self._runtime is not None
        row = architectures.of(self.model_dir)
        kind = row.pipeline_class()
        self._pipelines = {size: kind(self.model_dir, self._runtime, label="" if size == ANY else f"@{size}",
                                      sources=parts) for size, parts in sources.items()}
        pipe = next(iter(self._pipelines.values()))
        self._info = pipe.model_info(self.model_dir.name, _digest(self.model_dir, row.denoiser))
        log.info("model %s: %s", self.model_dir.name, pipe.describe())

    def _attach_controlnets(self, folder: Path) -> None:
        """Every size's pipeline gets the folder's ControlNets: an SD UNet's (engines/pipelines/controlnet.py) or
        FLUX.1's (engines/pipelines/controlnet_dit.py). The files are untrusted input: one that does not fit the
        model is logged refused by name and left out; a model that serves no ControlNet (no residual denoiser,
        another DiT) serves none, logged. Never fatal to the boot."""
        from engines.pipelines import controlnet, controlnet_dit
        from engines.pipelines.flux import FluxPipeline
        from engines.pipelines.unet import StableDiffusionOnnx

        nets = {sub.name: sub for sub in sorted(folder.iterdir()) if sub.is_dir()
                and (sub / "model.onnx").is_file() and (sub / "config.json").is_file()} if folder.is_dir() else {}
        for size, pipe in self._pipelines.items():
            attach: Any = controlnet.attach if isinstance(pipe, StableDiffusionOnnx) else \
                controlnet_dit.attach if isinstance(pipe, FluxPipeline) else None
            if attach is None:
                log.warning("ControlNet not served: %s has no ControlNet path (SD UNet and FLUX.1 models have)",
                            self.info.family)
                return
            label = "" if size == ANY else f"@{size}"
            try:
                attach(pipe, self.model_dir, nets, label)
                continue
            except UNFIT as exc:
                failure = exc
            accepted = {}
            for name, path in nets.items():  # after a failure only: which files fit, each alone
                try:
                    attach(pipe, self.model_dir, {name: path}, label)
                    accepted[name] = path
                except UNFIT as exc:
                    log.warning("ControlNet %s refused: %s", name, exc)
            if accepted:
                attach(pipe, self.model_dir, accepted, label)
            else:
                cast(Any, pipe).controls = None  # an SD or FLUX.1 pipeline (attach above)
                log.warning("ControlNet not served by this model: %s", failure)

    def _load_lora(self) -> None:
        """The adapter library and one LoRA variant session per adaptable component, shared by every size's
        pipeline. The variants load the plain ONNX files (a prebuilt engine's weights are compiled in): under a
        TensorRT policy they run on CUDA (in-process graphs get CUDA only, engines/runtime/sessions.py
        session_providers), under a plugin EP on that EP; never on the CPU where the policy forbids it (the same
        Runtime.session checks as every session)."""
        from engines.lora.manager import LoraManager

        assert self._runtime is not None
        self._lora = LoraManager(self.settings.lora, self.model_dir, self.info.family, self._runtime, OrtModel)
        self._attach_variants()

    def _attach_variants(self) -> None:
        """Each adaptable session points at its component's variant (None while no file adapts it)."""
        assert self._lora is not None
        for pipe in self._pipelines.values():
            for model in pipe.adaptable():
                found = self._lora.components.get(model.component)
                # built by make_model=OrtModel (the manager types it by the Model protocol it needs)
                model.variant = cast("OrtModel | None", found.variant) if found is not None else None
            controls = getattr(pipe, "controls", None)
            if controls is not None and hasattr(controls, "attach_lora"):  # the residual UNet or FLUX.1 transformer
                controls.attach_lora(self._lora)

    def nvml_index(self) -> int:
        """The NVML index of the served CUDA ordinal, matched by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA
        ordinals, never NVML's). GpuUnavailableError when nothing matches: the ordinal is never used instead, it
        would bind artifacts and telemetry to another card."""
        obs = self._observations
        found = obs.nvml_index(self.settings.device_id) if obs is not None else None
        if found is None:
            raise GpuUnavailableError(f"CUDA ordinal {self.settings.device_id} matches no NVML device by PCI bus id "
                                      "(check CUDA_VISIBLE_DEVICES and --device-id); refusing to guess by number")
        return found

    def _device_total(self) -> int | None:
        """The served device's total memory from preflight's NVML reading (matched by PCI bus id)."""
        if self._observations is None or self.settings.device != "cuda":
            return None
        return self._observations.memory_total(self.settings.device_id)

    def _verify_artifacts(self) -> dict[str, dict[str, Path]]:
        """Per served size, the EP-context models to load (engines/artifact_checks.py)."""
        return self._verified.verify(self._observations, self.nvml_index, self.plan)

    @property
    def pipeline(self) -> Pipeline:
        """The first loaded pipeline (all share the model's configs and tokenizer)."""
        if not self._pipelines:
            raise NotReadyError("model not loaded")
        return next(iter(self._pipelines.values()))

    def _pipeline_for(self, batch: Batch) -> Pipeline:
        if not self._pipelines:
            raise NotReadyError("model not loaded")
        size = f"{batch.width}x{batch.height}"
        found = self._pipelines.get(size) or self._pipelines.get(ANY)
        if found is None:
            plugin = self.settings.plugin
            provider: str = plugin.name if plugin is not None else next(iter(self.settings.providers), "its provider")
            raise InvalidRequestError(f"size {size} has no prebuilt engine artifact (EP-context model) for "
                                      f"{provider} on this server; served sizes: {', '.join(self._pipelines)}",
                                      param="size")
        return found

    @property
    def info(self) -> ModelInfo:
        if self._info is None:
            raise NotReadyError("model not loaded")
        return self._info

    def resolved_plan(self) -> SelfTestPlan:
        """The configured plan (or one built-in canary), with no shapes meaning the model's native size."""
        size = self.pipeline.default_size
        plan = self.plan or SelfTestPlan(
            CanarySuite(canary=(Canary(name="default", prompt="a canary in a coal mine", seed=1234),)), (), ())
        if plan.shapes:
            return plan
        return dataclasses.replace(plan, shapes=tuple(Shape(size, size, b) for b in plan.batch_sizes))

    def self_test(self) -> SelfTestReport:
        """Canaries at every served shape: sanity, fingerprints, SLO windows (engines/selftest.py)."""
        plan = self.resolved_plan()
        try:
            self._report = selftest.run(plan, self.generate, self.model_dir, self.telemetry(),
                                        self.settings.device_id)
            # with ControlNets: each one's canary (refused by name when it fails; a wrong residual UNet fails here)
            self._report = selftest.with_controlnets(self._report, controlnet_canary.check(
                plan, self._pipelines.values(), self.generate))
        except SelfTestError as exc:
            if isinstance(exc.report, SelfTestReport):
                self._report = exc.report
            self._errors.append(str(exc))
            raise
        self._warm_edits(plan)
        self._warm_lora(plan)
        self.check_engine_builds("self-test warm-up at every served shape")
        first = plan.shapes[0]
        self._boot_fingerprint = fingerprint(np.asarray(self.generate(plan.suite.batch(
            Shape(first.width, first.height, 1))).images[0].image))
        return self._report

    def _warm_edits(self, plan: SelfTestPlan) -> None:
        """The VAE encoder and the edit graphs run once at every served shape (an inpainting canary, batch 1, the
        canary's guidance), so no edit session meets its first input on a request; the output must be sane."""
        if self.pipeline.editor is None:
            return
        for shape in plan.shapes:
            base = plan.suite.batch(Shape(shape.width, shape.height, 1))
            y, x = np.mgrid[0:shape.height, 0:shape.width]
            image = np.stack([x * 255 // max(1, shape.width - 1), y * 255 // max(1, shape.height - 1),
                              np.full_like(x, 128)], axis=-1).astype(np.uint8)
            mask: np.ndarray | None = np.zeros((shape.height, shape.width), np.uint8)
            if "inpaint" in self.info.modes:
                mask[:, shape.width // 2:] = 255  # type: ignore[index]
            else:  # the DiT families serve img2img only
                mask = None
            scheduler = base.scheduler if base.scheduler in self.info.edit_schedulers else "euler"
            batch = dataclasses.replace(base, images=tuple(dataclasses.replace(s, edit=EditImage(image, mask))
                                                           for s in base.images), strength=0.5, scheduler=scheduler)
            problem = selftest.sanity(np.asarray(self.generate(batch).images[0].image))
            if problem is not None:
                error = SelfTestError(f"edit warm-up (inpainting canary) at {shape.key}: {problem}")
                self._errors.append(str(error))
                raise error

    def _warm_lora(self, plan: SelfTestPlan) -> None:
        """With a LoRA library: one canary through the LoRA variant sessions at every served shape (their stored
        weights, nothing merged), so no variant meets its first input shape on a request; the output must be
        sane."""
        if self._lora is None:
            return
        for shape in plan.shapes:
            with self._lock:
                out = self._pipeline_for(plan.suite.batch(shape))(plan.suite.batch(shape),
                                                                  adapters=Adapters(self._lora.warm_weights()))
            problem = selftest.sanity(out.images[0])
            if problem is not None:
                error = SelfTestError(f"LoRA variant warm-up at {shape.key}: {problem}")
                self._errors.append(str(error))
                raise error

    def check_engine_builds(self, stage: str) -> None:
        """After the first run at each served shape: TensorRT's engine cache must be unchanged since load (an
        on-node build otherwise; ArtifactError when the profile forbids them). Self-test calls it."""
        if self._runtime is None:
            return
        try:
            self._runtime.check_engine_cache(stage)
        except ArtifactError as exc:
            self._errors.append(str(exc))
            raise

    def record_fingerprints(self) -> Path:
        return selftest.record(self.resolved_plan(), self.generate, self.model_dir)

    def canary(self) -> CanaryCheck:
        """One batch-1 canary at the first served shape, against the boot baseline latency and output."""
        plan = self.resolved_plan()
        first = plan.shapes[0]
        shape = Shape(first.width, first.height, 1)
        start = time.perf_counter()
        batch = plan.suite.batch(shape)
        if self.faults is not None and self.faults.nan_canary:
            raise InferenceError("the VAE produced NaN/inf values (fp16 overflow or corrupted weights) [injected]")
        result = self.generate(batch)
        seconds = time.perf_counter() - start
        image = np.asarray(result.images[0].image)
        if self.faults is not None and self.faults.output_shift:
            image = np.clip(image.astype(np.float32) + self.faults.output_shift, 0, 255).astype(np.uint8)
        baseline = next((r.p50_s / first.batch for r in (self._report.shapes if self._report else [])
                         if r.shape == first.key), seconds)
        distance = (float(np.abs(fingerprint(image) - self._boot_fingerprint).max())
                    if self._boot_fingerprint is not None else 0.0)
        problem = selftest.sanity(image)
        return CanaryCheck(shape.key, seconds, baseline, distance, plan.tolerance, problem, batch.steps,
                           result.provider)

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        """Run ``batch``; an all-black image (or NaN/inf from the VAE) is refused with InferenceError, never
        returned as a picture."""
        pipeline = self._pipeline_for(batch)
        self._check_loras(batch)
        with self._lock:
            weights = self._lora_weights(batch)
            adapters = Adapters(weights)  # handed down to every adaptable component, which records its run
            out = pipeline(batch, on_step=on_step, adapters=adapters)
            if self.faults is not None and self.faults.latency_s > 0:
                time.sleep(self.faults.latency_s)
        return self._result(batch, pipeline, out, weights, adapters.adapted)

    def _check_loras(self, batch: Batch) -> None:
        if batch.loras and self._lora is None:
            raise InvalidRequestError("this server has no LoRA library ([runtime.lora] dir, --lora-dir)",
                                      param="loras")

    def _lora_weights(self, batch: Batch) -> Weights:
        """The batch's merged LoRA set (merged now if not cached; under the lock, like a step)."""
        return self._lora.weights(batch.loras) if self._lora is not None else {}

    def _result(self, batch: Batch, pipeline: Pipeline, out: PipelineOutput, weights: Mapping[str, object],
                adapted: set[str], stopped: bool = False) -> BatchResult:
        missed = sorted(c for c, w in weights.items() if w and c not in adapted)
        if missed and out.steps_done:  # a stopped batch may not reach every component; it returns no claim
            raise InferenceError(f"LoRA weights were merged for {', '.join(missed)} but the batch ran "
                                 "their base weights: refused, not returned with a claim that the LoRA applied")
        for index, image in enumerate(out.images):
            if selftest.sanity(image) == "all-black image":
                raise InferenceError(f"image {index} of the batch is an all-black image (an fp16 overflow or broken "
                                     "weights): refused, not returned")
        kept = [out.latents[i] if out.latents is not None and spec.keep_latents else None
                for i, spec in enumerate(batch.images)]
        images = tuple(GeneratedImage(Image.fromarray(img), spec.seed, trunc, neg, latents)
                       for img, spec, trunc, neg, latents in zip(out.images, batch.images, out.truncated,
                                                                 out.negative_truncated, kept, strict=True))
        return BatchResult(images, self._ran_on(pipeline), out.timings, len(images), out.steps_done,
                           stopped or out.steps_done < (out.steps_total or batch.steps), tuple(sorted(adapted)),
                           cache=out.cache)

    def step_key(self, batch: Batch) -> Hashable | None:
        return self._steps.step_key(batch)

    def begin(self, batch: Batch) -> StepRun:
        return self._steps.begin(batch)

    def tick(self, runs: Sequence[StepRun]) -> None:
        self._steps.tick(runs)

    def decode(self, run: StepRun, images: int) -> None:
        self._steps.decode(run, images)

    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        return self._steps.finish(run, stopped)

    def discard(self, run: StepRun) -> None:
        self._steps.discard(run)

    @property
    def provider(self) -> str:
        return self._ran_on(self.pipeline)

    def _ran_on(self, p: Pipeline) -> str:
        if self.faults is not None and self.faults.provider:
            return self.faults.provider
        denoiser = p.denoiser
        return denoiser.ran_on  # the session the last batch's denoiser ran on (a LoRA variant's, if it did)

    def check_health(self) -> None:
        """NotReadyError when not loaded, or naming each model file that changed on disk since load (the
        watchdog calls this; only files whose size/mtime changed are hashed again)."""
        self.pipeline  # noqa: B018 - raises NotReadyError when not loaded
        self._integrity.check()

    def telemetry(self) -> TelemetrySource | None:
        """NVML on a GPU policy (preflight has already proven it starts); none on the CPU."""
        if self.settings.device != "cuda":
            return None
        try:
            from engines.health.telemetry import NvmlTelemetry

            obs = self._observations
            index = obs.nvml_index(self.settings.device_id) if obs is not None else None
            if index is None:  # never the CUDA ordinal as an NVML index: it can name another card
                log.error("NVML telemetry off: CUDA ordinal %d matches no NVML device by PCI bus id",
                          self.settings.device_id)
                return None
            return NvmlTelemetry({self.settings.device_id: index})
        except Exception as exc:  # pynvml's NVMLError family; preflight reports the cause with its exit code
            log.error("NVML unavailable for the watchdog: %s", exc)
            return None

    def signature(self, samples: list[GpuSample], requests_running: bool) -> Signature:
        return signature.classify(samples, requests_running, self._thresholds)

    def ort_events(self) -> list[OrtEvent]:
        return self._tee.drain() if self._tee is not None else []

    def capabilities(self) -> Capabilities:
        """The capability snapshot (engines/health/capabilities.py)."""
        return snapshot(Proven(
            self.settings, self.model_dir, self._runtime, bool(self._pipelines), self._checks, self._observations,
            self._errors, self._device_total(), self._verified.artifacts, self._report,
            self._info.family_summary() if self._info else {}, self._lora.summary() if self._lora is not None else {}))

    def loras(self) -> tuple[LoraInfo, ...]:
        return self._lora.listing() if self._lora is not None else ()

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        if self._lora is None:
            return ()
        self._lora.refresh()
        self._attach_variants()  # a file that adapts a component no file did before brought its variant
        return self._lora.listing()

    def lora_cost_s(self, uses: tuple[LoraUse, ...]) -> float:
        return self._lora.merge_estimate_s(uses) if self._lora is not None else 0.0

    def lora_stats(self) -> LoraStats:
        return self._lora.stats if self._lora is not None else LoraStats()

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        if self._tee is not None:
            self._tee.stop()
        self._pipelines = {}
        self._runtime = None


def _digest(model_dir: Path, denoiser: str) -> str:
    """sha256 of the denoiser (unet or transformer) from the model's manifest, read once at load ("" without a
    manifest)."""
    manifest = model_dir / "manifest.json"
    if not manifest.is_file():
        return ""
    entry = json.loads(manifest.read_text(encoding="utf-8")).get("files", {}).get(f"{denoiser}/model.onnx", "")
    return str(entry.get("sha256", "") if isinstance(entry, dict) else entry)
