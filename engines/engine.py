"""OrtEngine: the engine protocol on ONNX Runtime, with preflight against the version matrix and a capability
snapshot that says whether the fast path is really running."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
from PIL import Image

from engines import artifacts
from engines.config import (
    Canary,
    CanarySuite,
    Matrix,
    PluginEp,
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
    SelfTestError,
    VersionMismatchError,
)
from engines.health import request_memory, selftest, signature
from engines.health.integrity import IntegrityWatcher
from engines.health.preflight import Check, Observations, evaluate, failures, gather
from engines.lora.active import Adapters
from engines.numerics.schedulers import EDIT_SCHEDULERS, SCHEDULERS
from engines.pipelines.contract import Pipeline, Stepwise
from engines.pipelines.flow import DitOnnx
from engines.pipelines.flow_family import detect_dit, is_dit_folder
from engines.pipelines.qwen import QwenOnnx
from engines.pipelines.unet import Begun, OrtModel, PipelineOutput, StableDiffusionOnnx
from engines.protocol import StepRun
from engines.runtime.libdeps import preload
from engines.runtime.ortlog import StderrTee
from engines.runtime.sessions import Runtime, SessionReport, gpu_mem_limit, provider_options
from engines.types.health import CanaryCheck, Faults, GpuSample, Signature, TelemetrySource, fingerprint
from engines.types.model import LoraInfo, LoraStats, ModelInfo
from engines.types.request import Batch, BatchResult, EditImage, GeneratedImage, LoraUse, Mode, StepHook
from engines.types.snapshot import (
    Artifacts,
    Attention,
    Capabilities,
    CheckResult,
    EngineArtifacts,
    IoInfo,
    OrtEvent,
    PlacementSummary,
    Policy,
    SelfTestReport,
    Verdict,
)

if TYPE_CHECKING:
    from engines.lora.manager import LoraManager

log = logging.getLogger(__name__)
GPU_MEM_LIMIT_SCOPE = (
    "with the shared arena registered (shared_device_arena.registered), every session's device allocations, the "
    "IO-binding buffers and merged LoRA weights come from one CUDA arena capped at gpu_mem_limit_bytes; without it "
    "the cap covers only sessions whose first provider is CUDA, and the binding's own CUDA arena has none. "
    "TensorRT engine memory sits outside every ORT arena in both cases.")
"""What gpu_mem_limit does and does not cover, stated in the capability snapshot instead of a budget claim."""
ANY = "*"
"""The key of the one pipeline that serves every size (no per-size TensorRT engines)."""


def _describe(checks: list[Check]) -> str:
    return "; ".join(f"{c.name}: found {c.observed}, expected {c.expected} ({c.remediation})" for c in checks)


class OrtEngine:
    """One model on one device. ``generate`` runs one batch at a time (a lock), never concurrently."""

    def __init__(self, model_dir: Path, settings: RuntimeSettings, matrix: Matrix | None = None,
                 plan: SelfTestPlan | None = None, faults: Faults | None = None,
                 signature_thresholds: SignatureThresholds | None = None, watch_ort_log: bool = False) -> None:
        """``watch_ort_log``: from preflight on, tee fd 2 and classify what ORT prints after boot (serving only)."""
        self.model_dir = model_dir
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
        self._artifacts = Artifacts()
        self._info: ModelInfo | None = None
        self._thresholds = signature_thresholds or SignatureThresholds()
        self._tee = StderrTee() if watch_ort_log else None
        self._lora: LoraManager | None = None
        self._scopes = Scopes()
        """Buffer scopes of the batches denoised side by side (step-level batching)."""

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
            self._runtime = Runtime(self.settings, self.model_dir, self._device_total())
            if is_dit_folder(self.model_dir):
                self._load_dit(sources)
            else:
                self._load_unet(sources)
            # admission's estimate and the arena trim's rule; prebuilt engines hold memory sized when they were built
            memory = request_memory.for_folder(self.model_dir) if ANY in self._pipelines else None
            self._info, self._runtime.memory = dataclasses.replace(self.info, memory=memory), memory
            if self.plan is not None:  # the family's canary set (configs/canaries.toml [family.<name>])
                self.plan = dataclasses.replace(self.plan, suite=self.plan.suite.for_family(self.info.family),
                                                family=self.info.family)
            if self.settings.lora.dir:
                self._load_lora()
        except NotReadyError as exc:
            self._errors.append(str(exc))
            raise
        if self.settings.allow_cpu:
            log.warning("CPU execution allowed by the profile: this server is NOT accelerated")

    def _load_unet(self, sources: dict[str, dict[str, Path]]) -> None:
        assert self._runtime is not None
        pipelines = {size: StableDiffusionOnnx(self.model_dir, self._runtime, parts, "" if size == ANY else f"@{size}")
                     for size, parts in sources.items()}
        self._pipelines = dict(pipelines)
        p = next(iter(pipelines.values()))
        f = p.family
        self._info = ModelInfo(self.model_dir.name, p.size_multiple, p.default_size, tuple(SCHEDULERS),
                               p.tokenizer.max_length, _digest(self.model_dir, "unet"), f.name,
                               f.prediction_type, f.text_encoders, f.vae_scaling_factor, f.cfg_default,
                               f.default_steps, f.default_guidance, *_edit_info(p))
        log.info("model %s: %s", self.model_dir.name, f.describe())

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

    def _load_dit(self, sources: dict[str, dict[str, Path]]) -> None:
        """A Flux or SD 3 folder: the flow-matching pipeline, per served size on its prebuilt EP-context models
        (`sdserve engines build`: TensorRT plans in bf16 for T5, the transformer and the VAE, fp16 for CLIP,
        engines/build/trtplan_dit.py; or a plugin EP's), else one for every size."""
        assert self._runtime is not None
        kind = QwenOnnx if detect_dit(self.model_dir).base == "qwen-image" else DitOnnx
        pipelines = {size: kind(self.model_dir, self._runtime, "" if size == ANY else f"@{size}", parts)
                     for size, parts in sources.items()}
        self._pipelines = dict(pipelines)
        pipe = next(iter(pipelines.values()))
        config = json.loads((self.model_dir / "transformer" / "config.json").read_text())
        text = pipe.max_sequence_length + (pipe.clips[0][0].max_length if pipe.family.base == "sd3" else 0)
        self._info = dataclasses.replace(
            pipe.model_info(self.model_dir.name, _digest(self.model_dir, "transformer")),
            token_patch=pipe.size_multiple, text_tokens=text,
            hidden_size=int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128)))
        log.info("model %s: %s (flow matching, %s)", self.model_dir.name, pipe.family.name,
                 "guidance embedded" if pipe.family.guidance_embeds else
                 "classifier-free guidance" if pipe.family.cfg else "no guidance")

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
        """The model folder against its manifest; with TensorRT in the policy, the prebuilt engines against this
        node. Returns, per served size, the EP-context models to load instead of the plain ONNX files (one engine
        per size: engines/artifacts.py context_models); {ANY: {}} for the plain model at every size."""
        artifacts.verify_model(self.model_dir, self.settings.verify, self.settings.manifest_sha256)
        self._artifacts = Artifacts(model_manifest=f"verified ({self.settings.verify})")
        if self.settings.plugin is not None:
            return self._verify_plugin_artifacts(self.settings.plugin)
        trt = self.model_dir / artifacts.TRT_DIR
        if "TensorrtExecutionProvider" not in self.settings.providers:
            return {ANY: {}}
        if not (trt / "manifest.json").is_file():
            if self.settings.tensorrt.require_engines:
                raise ArtifactError(
                    f"no prebuilt TensorRT engines in {trt}: build them with `sdserve engines build` on a node with "
                    "the deployed versions (the server never builds engines in production)")
            log.warning("no prebuilt TensorRT engines in %s: TensorRT may build them on this node (slow boot)", trt)
            return {ANY: {}}
        live = artifacts.node_identity(self._observations.to_model().model_dump() if self._observations else {},
                                       self.nvml_index())
        found = artifacts.verify_engines(self.model_dir, live, self.settings.verify)
        self._artifacts = self._artifacts.model_copy(update={"engines": EngineArtifacts.model_validate(found)})
        per_size = artifacts.context_models(self.model_dir)
        if not per_size:
            raise ArtifactError(f"the engine manifest in {trt} lists no served sizes: rebuild with `sdserve engines "
                                "build`")
        return per_size

    def _verify_plugin_artifacts(self, plugin: PluginEp) -> dict[str, dict[str, Path]]:
        """A plugin EP's EP-context artifacts (<model>/ep/<name>, `sdserve engines build`) against this node's ORT
        and plugin versions; per served size, the context models to load. Without a manifest: refused when the
        plugin requires artifacts, else the plain model (the EP compiles it at load)."""
        sub = artifacts.ep_dir(plugin.name)
        if not (self.model_dir / sub / artifacts.MANIFEST).is_file():
            if plugin.require_artifacts:
                raise ArtifactError(f"no EP-context artifacts for {plugin.name} in {self.model_dir / sub}: build "
                                    "them with `sdserve engines build --profile <this profile>` (the profile sets "
                                    "runtime.plugin.require_artifacts)")
            log.warning("no EP-context artifacts in %s: %s compiles the model at load", sub, plugin.name)
            return {ANY: {}}
        observed = self._observations.to_model().model_dump() if self._observations else {}
        live = artifacts.plugin_identity(observed, plugin.device_type)
        found = artifacts.verify_engines(self.model_dir, live, self.settings.verify, sub, artifacts.PLUGIN_NODE_KEYS)
        self._artifacts = self._artifacts.model_copy(update={"engines": EngineArtifacts.model_validate(found)})
        per_size = artifacts.context_models(self.model_dir, sub)
        if not per_size:
            raise ArtifactError(f"the artifact manifest in {sub} lists no served sizes: rebuild with `sdserve "
                                "engines build`")
        return per_size

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
            raise InvalidRequestError(f"size {size} has no prebuilt TensorRT engine on this server; served sizes: "
                                      f"{', '.join(self._pipelines)}", param="size")
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
            weights = self._lora.weights(batch.loras) if self._lora is not None else {}
            adapters = Adapters(weights)  # handed down to every adaptable component, which records its run
            out = pipeline(batch, on_step=on_step, adapters=adapters)
            if self.faults is not None and self.faults.latency_s > 0:
                time.sleep(self.faults.latency_s)
        return self._result(batch, pipeline, out, weights, adapters.adapted)

    def _check_loras(self, batch: Batch) -> None:
        if batch.loras and self._lora is None:
            raise InvalidRequestError("this server has no LoRA library ([runtime.lora] dir, --lora-dir)",
                                      param="loras")

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
        """(size's pipeline, width, height, LoRA set) for a pipeline staged for step-level batching; None for one
        that runs batches whole."""
        pipeline = self._pipeline_for(batch)
        if pipeline.stepwise() is None:
            return None
        return (id(pipeline), batch.width, batch.height, batch.lora_key)

    def begin(self, batch: Batch) -> StepRun:
        pipeline = self._pipeline_for(batch)
        stages = pipeline.stepwise()
        if stages is None:
            raise InvalidRequestError("this model runs batches whole (no step-level batching)", param="model")
        self._check_loras(batch)
        with self._lock:
            weights = self._lora.weights(batch.loras) if self._lora is not None else {}
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
        with self._lock:
            start = time.perf_counter()
            first.stages.run_denoiser([s.begun.state for s in steps])
            for s in steps:
                with first.pipeline.runtime.scoped(s.scope):
                    first.stages.advance(s.begun.state)
            if self.faults is not None and self.faults.step_latency_s > 0:
                time.sleep(self.faults.step_latency_s)
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
                if self.faults is not None and self.faults.latency_s > 0:
                    time.sleep(self.faults.latency_s)
        finally:
            self.discard(run)
        return self._result(s.begun.batch, s.pipeline, out, s.weights, s.adapters.adapted, s.begun.stopped)

    def discard(self, run: StepRun) -> None:
        s = _stepping(run)
        if not s.released:
            s.released = True
            self._scopes.free(s.scope)

    def _arena_summary(self) -> dict[str, str | bool | float | int]:
        s = self.settings
        shared = self._runtime.arena if self._runtime else {}
        limit = gpu_mem_limit(s, self._device_total()) or 0
        return {**s.cuda.model_dump(), "gpu_mem_limit_bytes": limit,
                "shared_device_arena": bool(shared.get("registered")),
                "shared_device_arena_error": str(shared.get("error", "")),
                "device_memory_budget_enforced": bool(shared.get("registered")) and limit > 0,
                "gpu_mem_limit_scope": GPU_MEM_LIMIT_SCOPE}

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

    def _accelerated(self) -> bool:
        if not self.settings.accelerators or not self._pipelines or self._runtime is None:
            return False
        reports = self._runtime.reports.values()
        return (all(c.status != "fail" for c in self._checks) and bool(self._checks)
                and all(r.providers_used[:1] and r.providers_used[0] != "CPUExecutionProvider"
                        and set(r.providers_requested) <= set(r.providers_used) for r in reports)
                and all(r.placement is None or r.placement.ok for r in reports))

    def capabilities(self) -> Capabilities:
        """The capability snapshot (schema: engines/schemas/capabilities.schema.json)."""
        accelerated = self._accelerated()
        reports = self._runtime.reports if self._runtime else {}
        failed = [c for c in self._checks if c.status == "fail"]
        reasons = [f"{c.name}: found {c.observed}, expected {c.expected}" for c in failed] + self._errors
        if self.settings.allow_cpu:
            reasons.insert(0, "CPU allowed by the profile (dev): not accelerated")
        status = "pass" if accelerated else ("cpu-dev" if self.settings.allow_cpu and not failed and
                                            not self._errors else "fail")
        s = self.settings
        return Capabilities(
            generated_at=datetime.datetime.now(datetime.UTC).isoformat(), accelerated=accelerated,
            verdict=Verdict(status=status, reasons=tuple(reasons)), device=s.device, device_id=s.device_id,
            model=str(self.model_dir),
            policy=Policy(providers=s.providers, plugin=s.plugin.model_dump() if s.plugin else None,
                          allow_cpu=s.allow_cpu, enable_fallback=s.allow_cpu,
                          disable_cpu_ep_fallback=s.disable_cpu_ep_fallback, placement_audit=s.placement_audit,
                          cpu_allowlist=s.cpu_allowlist),
            provider_options=({s.plugin.name: dict(s.plugin.options)} if s.plugin else
                              dict(provider_options(s, self.model_dir, self._device_total()))),
            checks=tuple(c.to_model() for c in self._checks),
            observations=self._observations.to_model() if self._observations else None,
            sessions={name: r.to_model() for name, r in reports.items()},
            placement_summary={name: PlacementSummary(nodes_by_provider=r.placement.nodes_by_provider,
                                                      compute_on_cpu=r.placement.compute_on_cpu, ok=r.placement.ok)
                               for name, r in reports.items() if r.placement is not None},
            io=IoInfo(binding="iobinding", device=s.device,
                      host_staging=self._runtime.host.kind if self._runtime else "none",
                      buffers_reused_per_shape=True),
            arena=self._arena_summary(),
            artifacts=self._artifacts, attention=_attention(reports),
            self_test=self._report, family=self._info.family_summary() if self._info else {},
            lora=self._lora_summary(), image=image_labels())

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

    def _lora_summary(self) -> dict[str, object]:
        """/capabilities' ``lora``: the library (no server paths), the variant sessions, the cache, recent sets."""
        if self._lora is None:
            return {}
        m = self._lora
        return {"files": len(m.files), "usable": sum(1 for f in m.files.values() if not f.problem),
                "refused": {f.file: f.problem for f in m.files.values() if f.problem},
                "targets": m.settings.targets,
                "adaptable_weights": {name: len(c.targets) for name, c in m.components.items()},
                "sessions": {name: c.variant.name for name, c in m.components.items() if c.variant is not None},
                "library": [{"name": f.name, "file": f.file, "sha256": f.sha256, "components": f.components,
                             "problem": f.problem} for f in m.files.values()],
                "cache": dataclasses.asdict(m.stats) | {"budget_bytes": m.settings.cache_mb * 1024 * 1024},
                "recent_sets": dict(m.history),
                "serving": "merged weights bound to LoRA variant sessions of the plain ONNX components (IO "
                           "binding); requests without LoRA run the base sessions unchanged"}

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.close()
        if self._tee is not None:
            self._tee.stop()
        self._pipelines = {}
        self._runtime = None


def _edit_info(p: StableDiffusionOnnx) -> tuple[tuple[Mode, ...], str, bool, tuple[str, ...]]:
    """ModelInfo's edit fields: the modes served, why edits are not, the 9-channel UNet, the edit samplers."""
    modes: tuple[Mode, ...] = ("txt2img", "img2img", "inpaint") if p.editor is not None else ("txt2img",)
    return modes, p.edits_unavailable, p.family.inpainting, EDIT_SCHEDULERS if p.editor is not None else ()


def image_labels() -> dict[str, str]:
    """``SDSERVE_IMAGE_VARIANT=notrt`` -> ``{"variant": "notrt"}``: what the image says about itself (Dockerfile)."""
    prefix = "SDSERVE_IMAGE_"
    return {k.removeprefix(prefix).lower(): v for k, v in sorted(os.environ.items()) if k.startswith(prefix)}


def _attention(reports: dict[str, SessionReport]) -> Attention:
    """Whether attention is fused (fused attention ops present) and where those ops run."""
    fused = {name: r.placement.attention for name, r in reports.items()
             if r.placement is not None and r.placement.attention}
    on_gpu = bool(fused) and all(p != "CPUExecutionProvider" for f in fused.values() for p in f)
    return Attention(fused=bool(fused), on_gpu=on_gpu, by_session=fused)


def _digest(model_dir: Path, denoiser: str) -> str:
    """sha256 of the denoiser (unet or transformer) from the model's manifest, read once at load ("" without a
    manifest)."""
    manifest = model_dir / "manifest.json"
    if not manifest.is_file():
        return ""
    entry = json.loads(manifest.read_text(encoding="utf-8")).get("files", {}).get(f"{denoiser}/model.onnx", "")
    return str(entry.get("sha256", "") if isinstance(entry, dict) else entry)


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


def _stepping(run: StepRun) -> Stepping:
    if not isinstance(run, Stepping):
        raise TypeError(f"not a run this engine began: {type(run).__name__}")
    return run
