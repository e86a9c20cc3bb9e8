"""`sdserve accept` on a GPU node: the steps that measure, in order, under one time budget.

The GPU gate comes first and costs a fraction of a second (NVML and the CUDA provider's library closure, from
preflight.gather): without a GPU it raises GpuUnavailableError (exit 20) before anything is built or written. Then
each step is a function that returns its report section (the checks on the booted engine in accept_checks.py, the
state they share in accept_state.py, the sections in acceptance.py, accept_copies.py and accept_report.py); a step
that raises, or finds the budget spent, is recorded as a StepFailure in its section's
place and the others still run. Each step also has its own time budget (rep.STEP_BUDGETS_S, --step-budget): its time
is reported next to it and a step over its budget fails the report's ``budget`` line. A check that says nothing on
this node (its input not given, or not this EP's) is a NotApplicable with the reason, never "ok". The report is
checked against engines/schemas/accept_report.schema.json and written as JSON and Markdown. Unverified on a GPU so
far (written on a machine without one): every step below the gate.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from engines import artifacts
from engines.accept import proofs as acc
from engines.accept import report as rep
from engines.accept.checks import (
    compiled_on_load,
    latency_section,
    no_reference,
    parity_against_reference,
    placement_report,
    profiled_copies,
    served_unet,
    signature_section,
    staging_buffers,
)
from engines.accept.state import AcceptOptions, Run, job, node, nvml_index, strict
from engines.config import Shape
from engines.engine import OrtEngine
from engines.errors import GpuUnavailableError, NotReadyError, SdserveError
from engines.health.preflight import Observations, gather
from engines.runtime import enginecheck
from engines.types.snapshot import SelfTestReport

__all__ = ["AcceptOptions", "Run", "compiled_on_load", "gpu_gate", "no_reference", "nvml_index",
           "parity_against_reference", "placement_report", "profiled_copies", "protocol_jobs", "relocation_check",
           "run_acceptance", "served_unet", "signature_section", "staging_buffers", "step"]
"""What the run's steps are, wherever they live (accept_checks.py, accept_state.py): tests and callers import them
from here."""

log = logging.getLogger(__name__)
T = TypeVar("T")
JSON_NAME, MARKDOWN_NAME = "accept_report.json", "accept_report.md"


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
    """Run one step: its section, or a StepFailure naming the exception or the spent run budget. Its time goes
    into ``run.timings`` against its own budget (a step cannot be stopped midway safely, so one over its budget
    is finished, reported "over budget", and fails the report's budget line)."""
    budget = run.options.step_budget(name)
    if time.monotonic() >= run.deadline:
        run.timings.append(rep.StepTiming(name, 0.0, budget, "not started"))
        return rep.StepFailure(name, f"time budget of {run.options.total_budget_s:g} s spent before this step")
    start = time.monotonic()
    try:
        result = body()
        budget = run.step_budget(name)  # the step may have learnt its own (the family's build budget)
    except Exception as exc:  # a step's failure is its section's content; the report must still be written
        log.exception("accept step %s failed", name)
        seconds, budget = time.monotonic() - start, run.step_budget(name)
        run.timings.append(rep.StepTiming(name, seconds, budget, "failed"))
        return rep.StepFailure(name, f"{type(exc).__name__}: {str(exc).strip()[:500]}", seconds)
    seconds = time.monotonic() - start
    state = ("not applicable" if isinstance(result, rep.NotApplicable) else
             "over budget" if seconds > budget else "ok")
    if state == "over budget":
        log.error("accept step %s took %.0f s, over its budget of %g s", name, seconds, budget)
    run.timings.append(rep.StepTiming(name, seconds, budget, state))
    return result


def run_acceptance(options: AcceptOptions) -> tuple[str, ...]:
    """Gate, measure, write ``accept_report.json`` and ``accept_report.md`` under ``options.out``; returns the
    failing sections (empty: the node is accepted)."""
    plugin = options.runtime.plugin
    observations = gather(plugin)
    if options.runtime.device == "cuda":  # a plugin EP on the CPU (the openvino profile) needs no NVIDIA GPU
        gpu_gate(observations)
    options.out.mkdir(parents=True, exist_ok=True)
    run = Run(options, observations, time.monotonic() + options.total_budget_s)
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
    signature = step(run, "signature", lambda: signature_section(run))
    parity = step(run, "parity", lambda: parity_against_reference(run, protocol))
    latency = step(run, "latency", lambda: latency_section(run))
    return rep.AcceptReport(datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), node(run), doctor,
                            boots, placement, staging, copies, relocation, protocol, parity, signature, latency,
                            tuple(run.notes), tuple(run.timings))


def _prepare_model(run: Run) -> Path:
    """The model to accept: ``--model``, or the SD 1.5-architecture model built here from explicit configs with
    random weights (engines/build/sd15.py), with its diffusers twin for the torch reference."""
    if run.options.model is not None:
        run.model = run.options.model
        return run.model
    missing = [m for m in BUILD_ONLY if importlib.util.find_spec(m) is None]
    if missing:
        raise NotReadyError(
            f"no --model given, and building the SD 1.5-architecture model here needs {', '.join(missing)}, which "
            "this installation does not have (build-time only: the serving image leaves them out). Pass --model DIR: "
            "an exported ONNX folder (`sdserve engines export` on a build machine, or any optimum-layout SD folder)")
    from engines.build.sd15 import build_sd15

    start = time.monotonic()
    run.diffusers = run.options.out / "work" / "sd15-diffusers"
    run.model = build_sd15(run.options.out / "work" / "sd15", run.diffusers)
    run.notes.append(f"built the SD 1.5-architecture model (random weights, seed 0) in {time.monotonic() - start:.0f}s")
    return run.model


BUILD_ONLY = ("torch", "diffusers", "transformers")
"""What building the model on the node needs (engines/build/sd15.py); the production image has none of them."""


def relocation_check(run: Run) -> rep.RelocationSection:
    """`engines build` in one folder, move the folder, load it again: every component must load from the new place
    from its prebuilt EP-context model, with nothing compiled on load. Real evidence, not a cache listing (a
    prebuilt load carries no engine-cache options, so it could never write there): each served session's source is
    an EP-context model under the moved folder, and each context model's engine path resolves beside it
    (enginecheck.context_engine_problems); the old folder no longer exists, so no absolute path can hide."""
    from engines.build import trt_build, trtplan

    built_at, moved_to = run.options.out / "work" / "built", run.options.out / "work" / "accepted"
    for folder in (built_at, moved_to):
        shutil.rmtree(folder, ignore_errors=True)
    linked = artifacts.link_tree(run.served(), built_at)  # hard links: a 67 GB folder costs no copy
    run.notes.append(f"relocation: {linked.linked} files hard-linked ({linked.linked_bytes / 1e9:.2f} GB), "
                     f"{linked.copied} copied ({linked.copied_bytes / 1e9:.2f} GB)")
    shapes = run.options.plan.shapes
    sizes = sorted({(s.width, s.height) for s in shapes}) or [(run.options.size, run.options.size)]
    batch = max((s.batch for s in shapes), default=1)  # the served batches; the server's queue may merge more
    observed = run.observations.to_model().model_dump()
    if run.options.runtime.plugin is not None:  # the plugin EP's EP-context artifacts (engines/build/epctx.py)
        from engines.build import epctx

        epctx.build(built_at, run.options.runtime, [f"{w}x{h}" for w, h in sizes], observed)
    elif "TensorrtExecutionProvider" not in run.options.runtime.providers:  # the cuda profile: plain graphs
        run.notes.append("relocation: a CUDA-only policy builds nothing (graphs from `engines optimize --target "
                         "cuda`); the moved folder must load as it is")
    else:
        plan = trtplan.plan(built_at, trtplan.profiles_from(sizes, batch, batch), trtplan.BuildFlags(
            fp16=run.options.runtime.tensorrt.fp16), run.options.runtime.device_id)
        run.budgets.setdefault("relocation", float(plan["budget_s"]) + 300.0)  # the builds, then one reload
        trt_build.build(built_at, plan, observed, nvml_index(run.observations, run.options.runtime.device_id))
    built_at.rename(moved_to)
    run.model = moved_to  # every later step serves the relocated folder
    engine = OrtEngine(moved_to, strict(run), run.options.matrix, run.options.plan, None, run.options.thresholds)
    reasons: list[str] = []
    compiled: list[str] = []
    try:
        engine.preflight()
        engine.load()
        compiled = compiled_on_load(engine.pipeline, moved_to)
    except SdserveError as exc:
        reasons.append(str(exc))
    finally:
        engine.close()
    sub = artifacts.ep_dir(run.options.runtime.plugin.name) if run.options.runtime.plugin else artifacts.TRT_DIR
    for models in artifacts.context_models(moved_to, sub).values():
        for ctx in models.values():
            reasons += enginecheck.context_engine_problems(ctx)
    return rep.RelocationSection(str(built_at), str(moved_to), not reasons, bool(compiled),
                                 tuple(reasons) + tuple(compiled))


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
    engine = OrtEngine(run.served(), strict(run), run.options.matrix, run.options.plan, None, run.options.thresholds)
    run.engine = engine
    start = time.monotonic()
    try:
        engine.preflight()
        engine.load()
        fingerprints = run.served() / run.options.plan.fingerprints_file
        if run.options.model is None or not fingerprints.is_file():
            # A model built minutes ago, or a user's model never self-tested, has no recorded canary outputs: the
            # production self-test would refuse it. They are recorded here (in the accept work folder after the
            # relocation step, never the user's folder), and the report says so.
            engine.record_fingerprints()
            why = "fresh model" if run.options.model is None else f"{run.options.model} has no {fingerprints.name}"
            run.notes.append(f"canary fingerprints recorded on this node ({why}): the self-test checks sanity and "
                             "latency here, not drift against another node")
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


def protocol_jobs(run: Run) -> acc.ProtocolSection:
    """The field's protocol: ``jobs`` jobs back to back (512x512, 50 steps, batch 1), NVML sampled every 0.2 s
    meanwhile for the signature section. A failed job is timed and counted, never retried."""
    engine = run.booted()
    telemetry = engine.telemetry()
    stop = threading.Event()

    def sample() -> None:
        while telemetry is not None and not stop.wait(0.2):
            try:
                run.samples.append(telemetry.sample(run.options.runtime.device_id))
            except Exception as exc:  # one failed reading (MIG: utilization NOT_SUPPORTED) must not end sampling
                run.sample_errors[str(exc)] = run.sample_errors.get(str(exc), 0) + 1

    if telemetry is None and run.options.runtime.device == "cuda":
        run.sample_errors["no NVML telemetry for the served device (see the log)"] = 1

    sampler = threading.Thread(target=sample, name="accept-nvml", daemon=True)
    sampler.start()
    durations, succeeded = [], []
    try:
        for seed in range(run.options.jobs):
            start = time.perf_counter()
            try:
                run.jobs.append(engine.generate(job(run, seed)))
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

