"""`sdserve accept` on a GPU node: the steps that measure, in order, under one time budget.

The GPU gate comes first and costs a fraction of a second (NVML and the CUDA provider's library closure, from
preflight.gather): without a GPU it raises GpuUnavailableError (exit 20) before anything is built or written. Then
each step is a function that returns its report section (engines/health/acceptance.py, accept_copies.py,
accept_report.py); a step that raises, or finds the budget spent, is recorded as a StepFailure in its section's
place and the others still run. The report is checked against engines/schemas/accept_report.schema.json and
written as JSON and Markdown. Unverified on a GPU so far (written on a machine without one): every step below the gate.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import shutil
import statistics
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import onnxruntime as ort

from engines import artifacts
from engines.config import Matrix, RuntimeSettings, SelfTestPlan, Shape, SignatureThresholds
from engines.engine import OrtEngine
from engines.errors import ArtifactError, GpuUnavailableError, NotReadyError, SdserveError
from engines.health import accept_copies as cop
from engines.health import accept_report as rep
from engines.health import acceptance as acc
from engines.health.preflight import Observations, gather
from engines.protocol import Batch, BatchResult, GpuSample, ImageSpec, SelfTestReport
from engines.runtime import enginecheck
from engines.runtime.dataflow import classify_cpu_nodes, partitioned_graph
from engines.runtime.libdeps import resolve
from engines.runtime.sessions import artifact_dirs, loading_prebuilt, numpy_dtype, provider_options

log = logging.getLogger(__name__)
T = TypeVar("T")
COMPONENTS = ("text_encoder", "unet", "vae_decoder")
PROMPT = "an astronaut riding a horse"
JSON_NAME, MARKDOWN_NAME = "accept_report.json", "accept_report.md"


@dataclass(frozen=True)
class AcceptOptions:
    """What `sdserve accept` was asked to do (server/cli/accept.py documents each option)."""

    out: Path
    runtime: RuntimeSettings
    matrix: Matrix
    plan: SelfTestPlan
    thresholds: SignatureThresholds
    model: Path | None = None
    """An ONNX model folder to accept; None builds the SD 1.5-architecture model on the node."""
    jobs: int = acc.PROTOCOL_JOBS
    band_percent: float = 10.0
    baseline: Path | None = None
    compare: str | None = None
    changed: tuple[Path, Path] | None = None
    skip_torch_reference: bool = False
    budget_s: float = 600.0
    size: int = 512
    steps: int = 50


@dataclass
class Run:
    """State shared by the steps of one acceptance run."""

    options: AcceptOptions
    observations: Observations
    deadline: float
    model: Path | None = None
    diffusers: Path | None = None
    engine: OrtEngine | None = None
    engine_error: str = "the engine did not boot"
    jobs: list[BatchResult] = field(default_factory=list)
    samples: list[GpuSample] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def booted(self) -> OrtEngine:
        if self.engine is None:
            raise NotReadyError(f"no booted engine: {self.engine_error}")
        return self.engine

    def served(self) -> Path:
        if self.model is None:
            raise NotReadyError("no model to accept (the build step failed)")
        return self.model


def gpu_gate(observations: Observations) -> None:
    """Raise GpuUnavailableError, naming why, when NVML sees no GPU or the CUDA provider's libraries are missing."""
    reasons = [acc.gpu_absent_reason(observations.nvml) or ""]
    closure = observations.closures.get("CUDAExecutionProvider")
    if closure is None:
        reasons.append("onnxruntime has no CUDA provider (install onnxruntime-gpu)")
    elif closure.missing:
        reasons.append(f"the CUDA provider cannot load: {', '.join(closure.missing)} not found")
    if any(reasons):
        raise GpuUnavailableError("sdserve accept needs an NVIDIA GPU node: " + "; ".join(r for r in reasons if r))


def step(run: Run, name: str, body: Callable[[], T]) -> T | rep.StepFailure:
    """Run one step: its section, or a StepFailure naming the exception or the spent budget."""
    if time.monotonic() >= run.deadline:
        return rep.StepFailure(name, f"time budget of {run.options.budget_s:g} s spent before this step")
    start = time.monotonic()
    try:
        return body()
    except Exception as exc:  # a step's failure is its section's content; the report must still be written
        log.exception("accept step %s failed", name)
        return rep.StepFailure(name, f"{type(exc).__name__}: {str(exc).strip()[:500]}", time.monotonic() - start)


def run_acceptance(options: AcceptOptions) -> tuple[str, ...]:
    """Gate, measure, write ``accept_report.json`` and ``accept_report.md`` under ``options.out``; returns the
    failing sections (empty: the node is accepted)."""
    observations = gather()
    gpu_gate(observations)
    options.out.mkdir(parents=True, exist_ok=True)
    run = Run(options, observations, time.monotonic() + options.budget_s)
    try:
        report = _measure(run)
    finally:
        if run.engine is not None:
            run.engine.close()
    data = report.as_dict()
    try:
        errors = rep.validate(data)
    except ImportError as exc:
        errors, data["notes"] = [], [*data["notes"], f"report not checked against its schema: {exc}"]
    if errors:
        raise SdserveError(f"accept report does not match its schema (a bug in sdserve): {errors[:3]}")
    (options.out / JSON_NAME).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    (options.out / MARKDOWN_NAME).write_text(report.to_markdown(), encoding="utf-8")
    return report.failing


def _measure(run: Run) -> rep.AcceptReport:
    built = step(run, "model", lambda: _prepare_model(run))
    if isinstance(built, rep.StepFailure):
        run.engine_error = f"the model was not built: {built.error}"
    relocation = step(run, "relocation", lambda: relocation_check(run))
    doctor, boots = _boot(run)
    placement = step(run, "placement", lambda: placement_report(run))
    staging = step(run, "staging", lambda: staging_buffers(run))
    copies = step(run, "copies", lambda: profiled_copies(run))
    protocol = step(run, "protocol", lambda: protocol_jobs(run))
    signature = step(run, "signature", lambda: acc.signature_section(run.samples, run.options.thresholds))
    parity = step(run, "parity", lambda: parity_against_reference(run, protocol))
    latency = step(run, "latency", lambda: latency_section(run))
    return rep.AcceptReport(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), _node(run), doctor,
                            boots, placement, staging, copies, relocation, protocol, parity, signature, latency,
                            tuple(run.notes))


def nvml_index(observations: Observations, device_id: int) -> int:
    """The served card's NVML index, matched by PCI bus id as serving does; GpuUnavailableError when nothing
    matches (never the CUDA ordinal as a guess: with CUDA_VISIBLE_DEVICES it names another card)."""
    found = observations.nvml_index(device_id)
    if found is None:
        raise GpuUnavailableError(f"CUDA ordinal {device_id} matches no NVML device by PCI bus id")
    return found


def _node(run: Run) -> dict[str, str]:
    nv, device_id = run.observations.nvml, run.options.runtime.device_id
    device = run.observations.device(device_id)
    gpu = device.name if device is not None else "no NVML device matches this ordinal's PCI bus id"
    return {"gpu": gpu, "device_id": str(device_id), "driver": nv.driver_version, "cuda_driver": nv.cuda_driver_version,
            "onnxruntime": run.observations.ort_version, "model": str(run.model or run.options.model or "not built")}


def _prepare_model(run: Run) -> Path:
    """The model to accept: ``--model``, or the SD 1.5-architecture model built here from explicit configs with
    random weights (engines/build/sd15.py), with its diffusers twin for the torch reference."""
    if run.options.model is not None:
        run.model = run.options.model
        return run.model
    from engines.build.sd15 import build_sd15

    start = time.monotonic()
    run.diffusers = run.options.out / "work" / "sd15-diffusers"
    run.model = build_sd15(run.options.out / "work" / "sd15", run.diffusers)
    run.notes.append(f"built the SD 1.5-architecture model (random weights, seed 0) in {time.monotonic() - start:.0f}s")
    return run.model


def _strict(run: Run) -> RuntimeSettings:
    """The profile's runtime, strict: no CPU, placement audit on (the placement section reads it)."""
    return run.options.runtime.model_copy(update={"allow_cpu": False, "placement_audit": True})


def relocation_check(run: Run) -> rep.RelocationSection:
    """`engines build` in one folder, move the folder, load it again: the engines must load from the new place and
    nothing may be built on load. "Built" is read from the engine cache folder's files (a build is logged only at
    VERBOSE; the TensorRT provider writes new engine files when it builds: tensorrt_execution_provider.cc)."""
    from engines.build import trt_build, trtplan

    built_at, moved_to = run.options.out / "work" / "built", run.options.out / "work" / "accepted"
    for folder in (built_at, moved_to):
        shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(run.served(), built_at)
    shapes = run.options.plan.shapes
    sizes = sorted({(s.width, s.height) for s in shapes}) or [(run.options.size, run.options.size)]
    batch = max((s.batch for s in shapes), default=1)  # the served batches; the server's queue may merge more
    plan = trtplan.plan(built_at, trtplan.profiles_from(sizes, batch, batch), trtplan.BuildFlags(
        fp16=run.options.runtime.tensorrt.fp16), run.options.runtime.device_id)
    trt_build.build(built_at, plan, run.observations.to_model().model_dump(),
                    nvml_index(run.observations, run.options.runtime.device_id))
    built_at.rename(moved_to)
    run.model = moved_to  # every later step serves the relocated folder
    before = _cache_files(moved_to)
    engine = OrtEngine(moved_to, _strict(run), run.options.matrix, run.options.plan, None, run.options.thresholds)
    reasons: tuple[str, ...] = ()
    try:
        engine.preflight()
        engine.load()
    except SdserveError as exc:
        reasons = (str(exc),)
    finally:
        engine.close()
    changed = sorted(set(_cache_files(moved_to).items()) - set(before.items()))
    return rep.RelocationSection(str(built_at), str(moved_to), not reasons, bool(changed),
                                 reasons + tuple(f"written on load: {name}" for name, _ in changed[:5]))


def _cache_files(model: Path) -> dict[str, float]:
    trt = model / "trt"
    return {str(p.relative_to(trt)): p.stat().st_mtime for p in trt.rglob("*") if p.is_file()} if trt.is_dir() else {}


def _boot(run: Run) -> tuple[rep.DoctorSection | rep.StepFailure, tuple[rep.ShapeBoot, ...] | rep.StepFailure]:
    """A strict production boot (preflight, load, self-test at every served shape); the doctor snapshot after it."""
    boots = step(run, "boots", lambda: boot_engine(run))
    doctor: rep.DoctorSection | rep.StepFailure
    if run.engine is None:
        doctor = rep.StepFailure("doctor", run.engine_error)
    else:
        verdict = run.engine.capabilities().verdict
        doctor = rep.DoctorSection(verdict.status, verdict.reasons)
    return doctor, boots


def boot_engine(run: Run) -> tuple[rep.ShapeBoot, ...]:
    """Preflight, load and self-test at every served shape, as `sdserve serve` boots in production. The engine
    stays up for the steps that follow; a failed boot fails every shape it did not report on."""
    engine = OrtEngine(run.served(), _strict(run), run.options.matrix, run.options.plan, None, run.options.thresholds)
    run.engine = engine
    start = time.monotonic()
    try:
        engine.preflight()
        engine.load()
        if run.options.model is None:  # a model built minutes ago has no recorded canary outputs yet
            engine.record_fingerprints()
            run.notes.append("canary fingerprints recorded on this node (fresh model): the self-test checks "
                             "sanity and latency here, not drift")
        return _shape_boots(engine.self_test())
    except SdserveError as exc:
        run.engine, run.engine_error = None, str(exc)
        report = getattr(exc, "report", None)
        engine.close()
        if isinstance(report, SelfTestReport):
            return _shape_boots(report)
        shapes = run.options.plan.shapes or (Shape(run.options.size, run.options.size, 1),)
        return tuple(rep.ShapeBoot(s.width, s.height, s.batch, False, time.monotonic() - start, (str(exc),))
                     for s in shapes)


def _shape_boots(report: SelfTestReport) -> tuple[rep.ShapeBoot, ...]:
    """One entry per self-tested shape (key WxHxB), its time the sum of its timed runs."""
    boots = []
    for r in report.shapes:
        width, height, batch = (int(v) for v in r.shape.split("x"))
        boots.append(rep.ShapeBoot(width, height, batch, not r.failures, sum(r.latencies_s), r.failures))
    return tuple(boots)


def placement_report(run: Run) -> tuple[rep.SessionPlacement, ...]:
    """Per component session: nodes on the GPU providers, and each CPU node classified by data flow (shape path:
    allowed; activation path: refused). Node names come from get_provider_graph_assignment_info() and are matched
    against the level-1 graph ORT partitioned (engines/runtime/dataflow.py says why and which ORT sources)."""
    pipeline = run.booted().pipeline
    sections = []
    for name in COMPONENTS:
        session = getattr(pipeline, name).session
        subgraphs = session.get_provider_graph_assignment_info()
        cpu = [n.name for g in subgraphs if g.ep_name == "CPUExecutionProvider" for n in g.get_nodes()]
        gpu = sum(len(g.get_nodes()) for g in subgraphs if g.ep_name != "CPUExecutionProvider")
        verdict = classify_cpu_nodes(partitioned_graph(run.served() / name / "model.onnx"), cpu)
        sections.append(rep.SessionPlacement(
            name, tuple(session.get_providers()), gpu, tuple(f"{op} x{n}" for op, n in verdict.shape_path.items()),
            tuple(verdict.activation_on_cpu) + tuple(f"unmatched {u}" for u in verdict.unmatched)))
    return tuple(sections)


class _PointerAttributes(ctypes.Structure):
    # struct cudaPointerAttributes (CUDA >= 10, driver_types.h): the memory type comes first; 1 is
    # cudaMemoryTypeHost (page-locked), 0 cudaMemoryTypeUnregistered (pageable). Page-locked is what ORT's own
    # pinned allocator hands out (onnxruntime/core/providers/cuda/cuda_allocator.cc, CUDAPinnedAllocator::Alloc:
    # cudaMallocHost/cudaHostAlloc) and what engines/runtime/pinned.py allocates with cudaHostAlloc.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p)]


def staging_buffers(run: Run) -> tuple[rep.StagingBuffer, ...]:
    """The host staging buffers the pipeline uses at the protocol's shape (the image coming down, the UNet input
    going up), each checked with cudaPointerGetAttributes on libcudart."""
    engine = run.booted()
    pipeline = engine.pipeline
    cudart = ctypes.CDLL(resolve("libcudart.so.13") or "libcudart.so.13")
    cudart.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_PointerAttributes), ctypes.c_void_p]
    cudart.cudaPointerGetAttributes.restype = ctypes.c_int
    engine.generate(_job(run, 0, steps=2))  # the staging buffers of this shape exist after one request
    latent = run.options.size // pipeline.vae_scale_factor
    wanted = {"image": ((1, 3, run.options.size, run.options.size),
                        numpy_dtype(pipeline.vae_decoder.session.get_outputs()[0].type)),
              "unet_in": ((2, pipeline.latent_channels, latent, latent), pipeline.latent_dtype)}
    found = []
    for tag, (shape, dtype) in wanted.items():
        array = pipeline.runtime.staged(tag, shape, dtype)  # the buffer the request used; never a new one
        if array is None:
            run.notes.append(f"staging buffer {tag} {shape} was never used by the request: not pinned memory")
            found.append(rep.StagingBuffer(tag, 0, 0))  # 0 = cudaMemoryTypeUnregistered: the check fails
            continue
        attributes = _PointerAttributes()
        status = cudart.cudaPointerGetAttributes(ctypes.byref(attributes), array.ctypes.data)
        if status != 0:
            raise GpuUnavailableError(f"cudaPointerGetAttributes({tag}) failed with CUDA error {status}")
        found.append(rep.StagingBuffer(tag, int(array.nbytes), int(attributes.type)))
    return tuple(found)


def profiled_copies(run: Run) -> cop.CopyCount:
    """One request with the UNet on a profiled twin of its session (same providers, provider options and source;
    SessionOptions.enable_profiling, written by InferenceSession.end_profiling: onnxruntime/python/
    onnxruntime_inference_collection.py), counting MemcpyFromHost/MemcpyToHost kernels per denoising step."""
    settings = _strict(run)
    size = f"{run.options.size}x{run.options.size}"
    source, options = served_unet(run.served(), size, settings)
    pipeline = run.booted()._pipeline_for(_job(run, 0))  # the pipeline of that size, as serving picks it
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(run.options.out / "profile_unet")
    watched = artifact_dirs(settings, run.served())
    before = enginecheck.snapshot(watched)
    profiled = ort.InferenceSession(str(source), sess_options=so, providers=[p for p, _ in options],
                                    provider_options=[o for _, o in options], enable_fallback=0)
    original = pipeline.unet.session
    pipeline.unet.session = profiled  # swap the component for one request, then restore it
    try:
        run.booted().generate(_job(run, 0))
    finally:
        pipeline.unet.session = original
    built = enginecheck.cache_events(before, enginecheck.snapshot(watched), "accept: profiled UNet")
    if built:
        raise ArtifactError(f"{built[0].line}: the profile would measure an engine that is never served")
    path = Path(profiled.end_profiling())
    run.notes.append(f"UNet profile of one request: {path.name}")
    return cop.count_copies(cop.load_profile(path), unet_runs=run.options.steps)


def served_unet(model: Path, size: str, settings: RuntimeSettings) -> tuple[Path, list[tuple[str, dict[str, str]]]]:
    """The UNet file and providers a server of ``settings`` runs at ``size``: with TensorRT, that size's EP-context
    model (``trt/<WxH>/unet_ctx.onnx``, engines/artifacts.py context_models) with the prebuilt-loading options (no
    engine or timing cache: sessions.loading_prebuilt); ArtifactError when the size has none, since profiling the
    plain graph under TensorRT would build an engine on the node that is never served."""
    options = provider_options(settings, model)
    if "TensorrtExecutionProvider" not in settings.providers:
        return model / "unet" / "model.onnx", options
    ctx = artifacts.context_models(model).get(size, {}).get("unet")
    if ctx is None or not ctx.is_file():
        raise ArtifactError(f"no prebuilt TensorRT UNet for {size} in {model / artifacts.TRT_DIR}: accept profiles "
                            "only the served context model (build it with `sdserve engines build`)")
    return ctx, [(p, loading_prebuilt(o) if p == "TensorrtExecutionProvider" else o) for p, o in options]


def _job(run: Run, seed: int, steps: int | None = None) -> Batch:
    return Batch((ImageSpec(PROMPT, seed=seed),), run.options.size, run.options.size,
                 steps or run.options.steps, "euler")


def protocol_jobs(run: Run) -> acc.ProtocolSection:
    """The field's protocol: ``jobs`` jobs back to back (512x512, 50 steps, batch 1), NVML sampled every 0.2 s
    meanwhile for the signature section. A failed job is timed and counted, never retried."""
    engine = run.booted()
    telemetry = engine.telemetry()
    stop = threading.Event()

    def sample() -> None:
        while telemetry is not None and not stop.wait(0.2):
            run.samples.append(telemetry.sample(run.options.runtime.device_id))

    sampler = threading.Thread(target=sample, name="accept-nvml", daemon=True)
    sampler.start()
    durations, succeeded = [], []
    try:
        for seed in range(run.options.jobs):
            start = time.perf_counter()
            try:
                run.jobs.append(engine.generate(_job(run, seed)))
                succeeded.append(True)
            except SdserveError as exc:
                log.error("protocol job %d failed: %s", seed, exc)
                succeeded.append(False)
            durations.append(time.perf_counter() - start)
    finally:
        stop.set()
        sampler.join(timeout=5)
    changed = None
    if run.options.changed is not None:  # the one-variable rule: before/after KEY=VALUE files
        before, after = (acc.parse_key_values(p.read_text(encoding="utf-8"), str(p)) for p in run.options.changed)
        changed = acc.one_variable_changed(before, after)[1]
    return acc.ProtocolSection(acc.JobStats.from_jobs(durations, succeeded), acc.PROTOCOL_JOBS, changed)


def parity_against_reference(run: Run, protocol: object) -> acc.Parity:
    """Throughput against a sibling replica (--compare: the same jobs, compute time from its Server-Timing header
    against ours) or the recorded baseline for this GPU model (--baseline: the protocol's jobs/hour)."""
    if not isinstance(protocol, acc.ProtocolSection):
        raise NotReadyError("the protocol did not run: no throughput to compare")
    if run.options.compare:
        ours = 3600.0 / statistics.fmean(r.timings.total for r in run.jobs)
        theirs = 3600.0 / statistics.fmean(_replica_compute_s(run, seed) for seed in range(run.options.jobs))
        return acc.parity_check(ours, theirs, run.options.band_percent, "replica", run.options.compare)
    gpu = _node(run)["gpu"]
    if run.options.baseline is None:
        raise NotReadyError(f"no reference: pass --baseline FILE with jobs/hour for {gpu!r}, or --compare URL")
    table = tomllib.loads(run.options.baseline.read_text(encoding="utf-8"))
    reference = acc.baseline_jobs_per_hour(table, gpu, str(run.options.baseline))
    return acc.parity_check(protocol.stats.jobs_per_hour, reference, run.options.band_percent, "baseline", gpu)


def _replica_compute_s(run: Run, seed: int) -> float:
    key = os.environ.get("SDSERVE_COMPARE_API_KEY", "")
    body = {"prompt": PROMPT, "size": f"{run.options.size}x{run.options.size}", "n": 1, "steps": run.options.steps,
            "seed": seed, "scheduler": "euler"}
    response = httpx.post(f"{str(run.options.compare).rstrip('/')}/v1/images/generations", json=body, timeout=300.0,
                          headers={"Authorization": f"Bearer {key}"} if key else {})
    response.raise_for_status()
    return acc.server_timing_seconds(response.headers.get("server-timing", ""))


def latency_section(run: Run) -> rep.LatencySection:
    """Ours from the protocol's jobs (median denoise time / steps, median total per image); the torch fp16
    pipeline on the same weights in this process (engines/build/sd15.py), unless skipped or the model was given."""
    if not run.jobs:
        raise NotReadyError("no protocol job succeeded: nothing to time")
    steps = run.options.steps
    ours = rep.LatencyRun("sdserve", statistics.median(r.timings.denoise for r in run.jobs) / steps * 1000.0,
                          statistics.median(r.timings.total for r in run.jobs))
    reference = None
    if run.options.skip_torch_reference:
        run.notes.append("diffusers torch reference skipped (--skip-torch-reference)")
    elif run.diffusers is None:
        run.notes.append("diffusers torch reference needs the model built here (omit --model): skipped")
    else:
        from engines.build.sd15 import torch_reference

        per_step_ms, per_image = torch_reference(run.diffusers, run.served() / "scheduler" / "scheduler_config.json",
                                                 steps, run.options.size, run.options.runtime.device_id)
        reference = rep.LatencyRun("diffusers torch fp16", per_step_ms, per_image)
    return rep.LatencySection(ours, reference, run.options.size, run.options.size, steps, 1)
