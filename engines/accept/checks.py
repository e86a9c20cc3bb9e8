"""`sdserve accept`: the checks run on the booted engine, each judging what the request really did (the sessions
that served, the copies it made, the readings NVML gave) or saying why it is not applicable here. Parity and
latency too. engines/accept/run.py runs them in order."""

from __future__ import annotations

import os
import statistics
import tomllib
from pathlib import Path

import httpx
import onnxruntime as ort

from engines import artifacts
from engines.accept import copies as cop
from engines.accept import proofs as acc
from engines.accept import report as rep
from engines.accept.state import COMPONENTS, PROMPT, Run, job, reference_key, strict
from engines.config import RuntimeSettings
from engines.errors import ArtifactError, ModelLoadError, NotReadyError
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime import enginecheck
from engines.runtime.dataflow import classify_cpu_nodes, partitioned_graph
from engines.runtime.pinned import load_cudart, memory_type
from engines.runtime.sessions import artifact_dirs, loading_prebuilt, provider_options


def placement_report(run: Run) -> tuple[rep.SessionPlacement, ...]:
    """Per component session of the pipeline that serves the protocol's size: nodes on the accelerator, and each
    CPU node classified by data flow (shape path: allowed; activation path: refused), judged against the graph
    that session loaded (``OrtModel.source``: the EP-context model when served from artifacts, not the plain
    model.onnx). Names come from get_provider_graph_assignment_info() and are matched against the level-1 graph
    ORT partitioned (engines/runtime/dataflow.py). An EP-context model is one EPContext node: any node of it on the
    CPU is refused outright (there is no shape path to allow)."""
    pipeline = run.booted()._pipeline_for(job(run, 0))
    sections = []
    for name in COMPONENTS:
        model = getattr(pipeline, name)
        subgraphs = model.session.get_provider_graph_assignment_info()
        cpu = [n.name for g in subgraphs if g.ep_name == "CPUExecutionProvider" for n in g.get_nodes()]
        gpu = sum(len(g.get_nodes()) for g in subgraphs if g.ep_name != "CPUExecutionProvider")
        providers = tuple(model.session.get_providers())
        if isinstance(model.source, Path) and enginecheck.ep_context_nodes(model.source):
            sections.append(rep.SessionPlacement(name, providers, gpu, (),
                                                 tuple(f"{n} (of the EP-context model)" for n in cpu)))
            continue
        verdict = classify_cpu_nodes(partitioned_graph(model.source), cpu)
        sections.append(rep.SessionPlacement(
            name, providers, gpu, tuple(f"{op} x{n}" for op, n in verdict.shape_path.items()),
            tuple(verdict.activation_on_cpu) + tuple(f"unmatched {u}" for u in verdict.unmatched)))
    return tuple(sections)


def staging_buffers(run: Run) -> tuple[rep.StagingBuffer, ...] | rep.NotApplicable:
    """Every host->device copy one request made, by what it was for, with the memory it read checked with
    cudaPointerGetAttributes (engines/runtime/pinned.py, CUDA 13's struct). The copies are the runtime's record
    (Runtime.host_reads: uploads, per-request step tables, any host feed), so an upload that bypasses the pinned
    staging buffers, or a pageable host feed, fails the check: it is not "we allocated it pinned, so it is"."""
    engine = run.booted()
    runtime = engine._pipeline_for(job(run, 0)).runtime
    if runtime.device != "cuda":
        return rep.NotApplicable("staging", f"the EP reads host memory in place (device {runtime.device}): there "
                                            "is no host->device copy to stage")
    cudart = load_cudart()
    runtime.host_reads.clear()
    engine.generate(job(run, 0, steps=2))
    reads = {r.tag: r for r in runtime.host_reads}  # the latest read per purpose
    if not reads:
        raise NotReadyError("the request made no host->device copy the runtime recorded: nothing to check")
    return tuple(rep.StagingBuffer(tag, r.nbytes, memory_type(cudart, r.address)) for tag, r in sorted(reads.items()))


def host_copies_per_step(run: Run) -> float:
    """The pipeline's host->device copies per denoising step: two requests of different step counts, the
    difference in recorded copies over the difference in steps (per-request copies cancel out)."""
    engine = run.booted()
    runtime = engine._pipeline_for(job(run, 0)).runtime
    counts = []
    for steps in (2, 4):
        runtime.host_reads.clear()
        engine.generate(job(run, 0, steps=steps))
        counts.append(len(runtime.host_reads))
    return (counts[1] - counts[0]) / 2


def profiled_copies(run: Run) -> cop.CopyCount | rep.NotApplicable:
    """One request with the UNet on a profiled twin of its session (same providers, provider options and source;
    SessionOptions.enable_profiling, written by InferenceSession.end_profiling: onnxruntime/python/
    onnxruntime_inference_collection.py), counting MemcpyFromHost/MemcpyToHost kernels per denoising step."""
    settings = strict(run)
    if settings.device != "cuda":
        return rep.NotApplicable("copies", f"this EP computes in host memory (device {settings.device}): there is "
                                           "no host<->device copy to count")
    size = f"{run.options.size}x{run.options.size}"
    source, options = served_unet(run.served(), size, settings)
    pipeline = run.booted()._pipeline_for(job(run, 0))  # the pipeline of that size, as serving picks it
    if not isinstance(pipeline, StableDiffusionOnnx):
        raise ModelLoadError("accept's profiled run swaps the UNet: it rehearses the UNet families only so far")
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
        run.booted().generate(job(run, 0))
    finally:
        pipeline.unet.session = original
    built = enginecheck.cache_events(before, enginecheck.snapshot(watched), "accept: profiled UNet")
    if built:
        raise ArtifactError(f"{built[0].line}: the profile would measure an engine that is never served")
    path = Path(profiled.end_profiling())
    run.notes.append(f"UNet profile of one request: {path.name}")
    return cop.count_copies(cop.load_profile(path), unet_runs=run.options.steps,
                            host_copies_per_step=host_copies_per_step(run))


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


def compiled_on_load(pipeline: object, folder: Path) -> list[str]:
    """The components whose session did not load a prebuilt EP-context model under ``folder``: the EP compiled
    them on load (a plain ONNX file), or they came from elsewhere."""
    found = []
    for name in (*COMPONENTS, "vae_encoder"):
        model = getattr(pipeline, name, None)
        if model is None:
            continue
        source = model.source
        if not isinstance(source, Path) or not source.resolve().is_relative_to(folder.resolve()):
            found.append(f"{name}: loaded from {source if isinstance(source, Path) else 'memory'}, not {folder}")
        elif not enginecheck.ep_context_nodes(source):
            found.append(f"{name}: {source.name} is not an EP-context model: its engine was compiled on load")
    return found


def signature_section(run: Run) -> acc.SignatureSection | rep.NotApplicable:
    """The NVML signature over the protocol's samples; not applicable when NVML gave none (no telemetry for the
    device, or utilization unsupported: a MIG slice), with the reason, rather than a verdict on zero samples."""
    if run.options.runtime.device != "cuda":
        return rep.NotApplicable("signature", f"this EP runs on the {run.options.runtime.device} device: NVML "
                                              "measures NVIDIA GPUs only")
    if run.sample_errors:
        run.notes.append("NVML readings that failed during the protocol: " + "; ".join(
            f"{why} (x{n})" for why, n in run.sample_errors.items()))
    if not run.samples and run.sample_errors:
        return rep.NotApplicable("signature", "NVML gave no readings for the served device: "
                                 + next(iter(run.sample_errors)))
    return acc.signature_section(run.samples, run.options.thresholds)


def no_reference(run: Run, protocol: acc.ProtocolSection) -> rep.NotApplicable:
    """What parity would need, with this run's own figure to seed a baseline."""
    gpu = reference_key(run)
    return rep.NotApplicable("parity", (
        f"no reference given. Parity compares this node's throughput ({protocol.stats.jobs_per_hour:.1f} jobs/h "
        f"over {protocol.stats.count} jobs) with a reference inside +/-{run.options.band_percent:g}%: pass "
        f"--baseline FILE, a TOML table per GPU model as NVML names it ([\"{gpu}\"] jobs_per_hour = N, recorded by "
        "this protocol on a healthy node of that model; this run's figure can seed it once the node is trusted), "
        "or --compare URL, a sibling replica running `sdserve serve` with the same model"))


def parity_against_reference(run: Run, protocol: object) -> acc.Parity | rep.NotApplicable:
    """Throughput against a sibling replica (--compare: the same jobs, compute time from its Server-Timing header
    against ours) or the recorded baseline for this GPU model (--baseline: the protocol's jobs/hour); without
    either, not applicable, saying what it would need."""
    if not isinstance(protocol, acc.ProtocolSection):
        raise NotReadyError("the protocol did not run: no throughput to compare")
    if not run.options.compare and run.options.baseline is None:
        return no_reference(run, protocol)
    if run.options.compare:
        ours = 3600.0 / statistics.fmean(r.timings.total for r in run.jobs)
        theirs = 3600.0 / statistics.fmean(_replica_compute_s(run, seed) for seed in range(run.options.jobs))
        return acc.parity_check(ours, theirs, run.options.band_percent, "replica", run.options.compare)
    gpu = reference_key(run)
    table = tomllib.loads(Path(str(run.options.baseline)).read_text(encoding="utf-8"))
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
