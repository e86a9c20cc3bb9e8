"""The pure-logic core of `sdserve accept`: the acceptance report, its verdicts and its schema.

`sdserve accept` runs on a fresh GPU node and proves the fast path end to end; the GPU-bound parts (booting, profiling,
NVML sampling, the diffusers comparison) live with the command. Everything here is a pure function of numbers and
files those parts produce, so it is tested without a GPU:

- the field's acceptance protocol: N jobs back to back, all must succeed (:class:`JobStats`, :func:`protocol_verdict`),
  a fix is accepted only when one variable changed (:func:`one_variable_changed`);
- throughput parity against a reference inside a band (:func:`parity_percent`, :func:`parity_check`);
- host<->device copies per denoising step from an ONNX Runtime profile (:func:`load_profile`, :func:`count_copies`);
- the NVML signature over the jobs (:func:`signature_section`);
- the report (:class:`AcceptReport`), its JSON form checked against ``engines/schemas/accept_report.schema.json``
  (:func:`validate`) and a short Markdown summary.

Every section says ``ok``; the report passes only when every section does.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "accept_report.schema.json"
SCHEMA_VERSION = 1
EXIT_NO_GPU = 20
"""Exit status of `sdserve accept` on a machine without a usable NVIDIA GPU."""

PROTOCOL_JOBS = 10
"""The field's protocol: this many jobs back to back, every one must succeed."""

# Op names of the copy nodes ONNX Runtime inserts between a device provider and the CPU
# (onnxruntime/core/optimizer/transformer_memcpy.cc, TransformerMemcpyImpl::AddCopyNode: node name
# GenerateNodeName("Memcpy"), op type "MemcpyFromHost" for host->device, "MemcpyToHost" for device->host).
MEMCPY_FROM_HOST = "MemcpyFromHost"
MEMCPY_TO_HOST = "MemcpyToHost"
# Names of CUPTI memcpy activity records, which the CUDA profiler adds as "Kernel" events in builds with
# ENABLE_CUDA_PROFILING (onnxruntime/core/providers/cuda/cupti_manager.cc, GetMemcpyKindString). Only the kinds that
# cross the host/device boundary count.
CUPTI_HOST_TO_DEVICE = frozenset({"MemcpyHostToDevice", "MemcpyHostToDeviceArray"})
CUPTI_DEVICE_TO_HOST = frozenset({"MemcpyDeviceToHost", "MemcpyDeviceArrayToHost"})

HEALTHY_SIGNATURES = frozenset({"healthy_compute", "memory_bound"})
CUDA_MEMORY_TYPE_HOST = 1
"""``cudaPointerAttributes.type`` for page-locked host memory (cudaMemoryTypeHost); 0 is pageable (unregistered)."""


@dataclass(frozen=True)
class Outcome:
    """A verdict with the reasons that decided it (empty when ok)."""

    ok: bool
    reasons: tuple[str, ...] = ()


class GpuReading(Protocol):
    """What the signature section and its classifier read of an NVML sample (engines.protocol.GpuSample has it)."""

    @property
    def sm_percent(self) -> float: ...
    @property
    def memory_percent(self) -> float: ...
    @property
    def power_w(self) -> float: ...
    @property
    def power_limit_w(self) -> float: ...


class NvmlState(Protocol):
    """What :func:`gpu_absent_reason` needs of an NVML report (engines' NvmlReport or its NvmlInfo model)."""

    @property
    def available(self) -> bool: ...
    @property
    def error(self) -> str: ...
    @property
    def devices(self) -> Sequence[object]: ...


def _plain(value: Any) -> Any:
    """Dataclasses -> dicts (plus their ``_derived`` properties), tuples -> lists: JSON- and jsonschema-ready."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name in getattr(value, "_derived", ()):
            out[name] = _plain(getattr(value, name))
        return out
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _yes(ok: bool) -> str:
    return "pass" if ok else "FAIL"


# ---------------------------------------------------------------------------------------------------------------------
# The acceptance protocol: N jobs back to back


@dataclass(frozen=True)
class JobStats:
    """Timing of the protocol's jobs. Times cover every job, failed ones too (the verdict fails on those anyway)."""

    count: int
    succeeded: int
    mean_s: float
    min_s: float
    max_s: float

    _derived: ClassVar[tuple[str, ...]] = ("all_ok", "range_s", "jobs_per_hour")

    @classmethod
    def from_jobs(cls, durations_s: Sequence[float], succeeded: Sequence[bool]) -> JobStats:
        """Stats of jobs given as wall-clock durations (seconds, > 0) and success flags, one per job."""
        if len(durations_s) != len(succeeded):
            raise ValueError(f"{len(durations_s)} durations but {len(succeeded)} success flags")
        if not durations_s:
            raise ValueError("no jobs ran")
        if any(not math.isfinite(d) or d <= 0 for d in durations_s):
            raise ValueError(f"job durations must be finite and positive: {list(durations_s)}")
        return cls(len(durations_s), sum(1 for s in succeeded if s),
                   math.fsum(durations_s) / len(durations_s), min(durations_s), max(durations_s))

    @property
    def all_ok(self) -> bool:
        return self.succeeded == self.count

    @property
    def range_s(self) -> float:
        return self.max_s - self.min_s

    @property
    def jobs_per_hour(self) -> float:
        """3600 / mean job time: jobs run back to back, one at a time."""
        return 3600.0 / self.mean_s


def protocol_verdict(stats: JobStats, required_jobs: int = PROTOCOL_JOBS) -> Outcome:
    """The protocol passes when exactly ``required_jobs`` jobs ran and every one succeeded."""
    reasons: list[str] = []
    if stats.count != required_jobs:
        reasons.append(f"ran {stats.count} jobs; the protocol needs exactly {required_jobs} back to back")
    if not stats.all_ok:
        reasons.append(f"{stats.count - stats.succeeded} of {stats.count} jobs failed; all must succeed")
    return Outcome(not reasons, tuple(reasons))


def one_variable_changed(before: Mapping[str, str], after: Mapping[str, str]) -> tuple[bool, tuple[str, ...]]:
    """"A fix is accepted only when one variable changed": compare two environment/version descriptions.

    Returns (exactly one key differs, the differing keys sorted). A key present on one side only counts as changed.
    Nothing changed is not ok either: that is a re-run, not a fix.
    """
    keys = set(before) | set(after)
    changed = tuple(sorted(k for k in keys if before.get(k) != after.get(k)))
    return len(changed) == 1, changed


@dataclass(frozen=True)
class ProtocolSection:
    """The protocol as operators run it after a fix. ``changed`` is None on a plain node acceptance (no fix)."""

    stats: JobStats
    required_jobs: int = PROTOCOL_JOBS
    changed: tuple[str, ...] | None = None

    _derived: ClassVar[tuple[str, ...]] = ("ok", "reasons")

    @property
    def reasons(self) -> tuple[str, ...]:
        reasons = list(protocol_verdict(self.stats, self.required_jobs).reasons)
        if self.changed is not None and len(self.changed) != 1:
            named = ", ".join(self.changed) or "nothing"
            reasons.append(f"a fix is accepted only when one variable changed; changed: {named}")
        return tuple(reasons)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def summary(self) -> str:
        s = self.stats
        return (f"{s.succeeded}/{s.count} jobs ok; mean {s.mean_s:.3f} s, range {s.range_s:.3f} s "
                f"({s.min_s:.3f}-{s.max_s:.3f}); {s.jobs_per_hour:.1f} jobs/h")


# ---------------------------------------------------------------------------------------------------------------------
# Throughput parity

ParityStatus = Literal["within_band", "below_band", "above_band"]
ReferenceSource = Literal["baseline", "replica"]


def parity_percent(candidate_jobs_per_hour: float, reference_jobs_per_hour: float) -> float:
    """Candidate throughput as a percentage of the reference: 100 is parity, 95 is 5% slower, 110 is 10% faster."""
    if not (math.isfinite(reference_jobs_per_hour) and reference_jobs_per_hour > 0):
        raise ValueError(f"reference throughput must be positive, got {reference_jobs_per_hour}")
    if not (math.isfinite(candidate_jobs_per_hour) and candidate_jobs_per_hour >= 0):
        raise ValueError(f"candidate throughput must be non-negative, got {candidate_jobs_per_hour}")
    return 100.0 * candidate_jobs_per_hour / reference_jobs_per_hour


def parity_status(percent: float, band_percent: float) -> ParityStatus:
    """Where ``percent`` falls against the band ``100 ± band_percent`` (edges inclusive)."""
    if band_percent < 0:
        raise ValueError(f"band must be non-negative, got {band_percent}")
    eps = 1e-9 * max(1.0, band_percent)
    if percent < 100.0 - band_percent - eps:
        return "below_band"
    if percent > 100.0 + band_percent + eps:
        return "above_band"
    return "within_band"


@dataclass(frozen=True)
class Parity:
    """Throughput against a reference: the recorded baseline for this GPU model, or a sibling replica (--compare).

    Only ``within_band`` passes. ``above_band`` fails too, on purpose: a node far faster than a healthy reference of
    the same GPU model is not comparable (different model, steps or shape, a stale or degraded reference, a cache
    answering) and a fix is never accepted on a number nobody can explain; refresh the baseline or check the replica.
    """

    candidate_jobs_per_hour: float
    reference_jobs_per_hour: float
    reference_source: ReferenceSource
    reference: str
    """What the reference was: the baseline's key (GPU model) or the replica's URL."""
    band_percent: float

    _derived: ClassVar[tuple[str, ...]] = ("parity_percent", "status", "ok")

    @property
    def parity_percent(self) -> float:
        return parity_percent(self.candidate_jobs_per_hour, self.reference_jobs_per_hour)

    @property
    def status(self) -> ParityStatus:
        return parity_status(self.parity_percent, self.band_percent)

    @property
    def ok(self) -> bool:
        return self.status == "within_band"

    def summary(self) -> str:
        note = {"within_band": "", "below_band": ": slower than the reference",
                "above_band": ": faster than the reference, not comparable"}[self.status]
        return (f"{self.parity_percent:.1f}% of {self.reference_source} {self.reference} "
                f"(band ±{self.band_percent:g}%){note}")


def parity_check(candidate_jobs_per_hour: float, reference_jobs_per_hour: float, band_percent: float = 10.0,
                 reference_source: ReferenceSource = "baseline", reference: str = "") -> Parity:
    """Parity of the candidate against the reference inside ``100 ± band_percent`` % (see :class:`Parity`)."""
    parity_status(parity_percent(candidate_jobs_per_hour, reference_jobs_per_hour), band_percent)  # validates now
    return Parity(candidate_jobs_per_hour, reference_jobs_per_hour, reference_source, reference, band_percent)


# ---------------------------------------------------------------------------------------------------------------------
# Host<->device copies from an ONNX Runtime profile
#
# The profile is the Chrome-trace JSON written by SessionOptions.enable_profiling (read from ONNX Runtime's source:
# onnxruntime/core/common/profiler.cc, Profiler::EndProfiling, writes a JSON array of {"cat", "pid", "tid", "dur",
# "ts", "ph": "X", "name", "args"}; cat is "Session", "Node", "Kernel" or "Api").
# onnxruntime/core/framework/sequential_executor.cc (KernelScope) records one "Node" event per kernel run named
# "<node name>_kernel_time" with args {"op_name": KernelDef().OpName(), "provider": ..., "node_index", ...}; some
# versions add "<node>_fence_before"/"_fence_after" Node events carrying op_name too (not counted: same kernel run).
# A session run is a "Session" event named "model_run".


def load_profile(path: Path | str) -> list[dict[str, Any]]:
    """The events of an ONNX Runtime profile file (a JSON array; a Chrome ``{"traceEvents": [...]}`` object too)."""
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path}: not an ONNX Runtime profile (expected a JSON array of trace events)")
    return events


@dataclass(frozen=True)
class CopyCount:
    """Host<->device copies in one request's profile, per denoising step (one UNet run per step, CFG batched).

    Node copies are the MemcpyFromHost/MemcpyToHost kernels ONNX Runtime inserted into the graph; CUPTI copies are
    every cudaMemcpy the CUDA profiler saw (present only in builds with CUDA profiling; they include the node copies,
    so the two are reported side by side, never added).
    """

    memcpy_from_host: int
    memcpy_to_host: int
    cupti_host_to_device: int
    cupti_device_to_host: int
    cupti_present: bool
    node_events: int
    """Kernel-run Node events seen at all: zero means the profile recorded no kernels, so zero copies proves nothing."""
    model_runs: int
    unet_runs: int
    max_per_step: float = 0.0

    _derived: ClassVar[tuple[str, ...]] = ("node_copies", "per_step", "cupti_per_step", "ok")

    @property
    def node_copies(self) -> int:
        return self.memcpy_from_host + self.memcpy_to_host

    @property
    def per_step(self) -> float:
        return self.node_copies / self.unet_runs

    @property
    def cupti_per_step(self) -> float:
        return (self.cupti_host_to_device + self.cupti_device_to_host) / self.unet_runs

    @property
    def ok(self) -> bool:
        cupti_ok = not self.cupti_present or self.cupti_per_step <= self.max_per_step
        return self.node_events > 0 and self.per_step <= self.max_per_step and cupti_ok

    def summary(self) -> str:
        text = (f"{self.per_step:.2f} per step ({self.memcpy_from_host} {MEMCPY_FROM_HOST}, {self.memcpy_to_host} "
                f"{MEMCPY_TO_HOST} over {self.unet_runs} UNet runs; allowed {self.max_per_step:g})")
        if self.cupti_present:
            text += f"; CUPTI {self.cupti_per_step:.2f} per step"
        if not self.node_events:
            text += "; the profile recorded no kernel runs"
        return text


def _node_op(event: Mapping[str, Any]) -> str | None:
    """The op name of a kernel-run Node event, None for anything else (fence events included)."""
    name = str(event.get("name", ""))
    if event.get("cat") != "Node" or name.endswith(("_fence_before", "_fence_after")):
        return None
    args = event.get("args")
    op = args.get("op_name") if isinstance(args, Mapping) else None
    return op if isinstance(op, str) else None


def count_copies(events: Iterable[Mapping[str, Any]], unet_runs: int, max_per_step: float = 0.0) -> CopyCount:
    """Count host<->device copies in profile ``events`` (one or more sessions' files concatenated)."""
    if unet_runs <= 0:
        raise ValueError(f"unet_runs must be positive, got {unet_runs}")
    ops: dict[str, int] = {}
    kernels: dict[str, int] = {}
    runs = 0
    cupti = False
    for event in events:
        op = _node_op(event)
        if op is not None:
            ops[op] = ops.get(op, 0) + 1
        elif event.get("cat") == "Kernel":
            name = str(event.get("name", ""))
            kernels[name] = kernels.get(name, 0) + 1
            cupti = cupti or name.startswith("Memcpy")
        elif event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
    return CopyCount(ops.get(MEMCPY_FROM_HOST, 0), ops.get(MEMCPY_TO_HOST, 0),
                     sum(kernels.get(n, 0) for n in CUPTI_HOST_TO_DEVICE),
                     sum(kernels.get(n, 0) for n in CUPTI_DEVICE_TO_HOST), cupti or bool(kernels),
                     sum(ops.values()), runs, unet_runs, max_per_step)


# ---------------------------------------------------------------------------------------------------------------------
# The NVML signature sampled during the jobs


@dataclass(frozen=True)
class SignatureSection:
    """Means of the NVML samples taken during the jobs, and the signature classifier's verdict (on medians)."""

    samples: int
    sm_percent_mean: float
    memory_percent_mean: float
    watts_mean: float
    verdict: str
    reason: str

    _derived: ClassVar[tuple[str, ...]] = ("ok",)

    @property
    def ok(self) -> bool:
        """Healthy compute (or memory-bound work) passes; livelock, idle, fallback or no samples fail."""
        return self.verdict in HEALTHY_SIGNATURES

    def summary(self) -> str:
        return (f"{self.verdict}: SM {self.sm_percent_mean:.0f}%, memory controller {self.memory_percent_mean:.0f}%, "
                f"{self.watts_mean:.0f} W (mean of {self.samples} samples)")


def _classifier() -> Callable[..., Any]:
    """The signature classifier, wherever the repository keeps it (engines/health/ now, engines/ before)."""
    for name in ("engines.health.signature", "engines.signature"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        classify: Callable[..., Any] = module.classify
        return classify
    raise ImportError("no signature classifier (engines.health.signature or engines.signature)")


def signature_section(samples: Sequence[GpuReading], thresholds: object | None = None) -> SignatureSection:
    """Wrap the classifier's verdict over ``samples`` (GpuSample, taken while the jobs ran) into the report section.

    ``thresholds`` is the profile's SignatureThresholds (None: the classifier's defaults). The classifier decides on
    medians; the section reports means next to its verdict and reason.
    """
    result = _classifier()(samples, True, thresholds)
    n = len(samples)

    def mean(values: Iterable[float]) -> float:
        return math.fsum(values) / n if n else 0.0

    return SignatureSection(n, mean(s.sm_percent for s in samples), mean(s.memory_percent for s in samples),
                            mean(s.power_w for s in samples), str(result.verdict), str(result.reason))


def gpu_absent_reason(report: NvmlState) -> str | None:
    """Why `sdserve accept` must exit EXIT_NO_GPU at once on this machine, or None when NVML sees a GPU."""
    if not report.available:
        return f"no NVIDIA GPU: {report.error or 'NVML unavailable'}"
    if not report.devices:
        return "no NVIDIA GPU: NVML started but reports 0 devices"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# The other sections: facts measured by the command, judged here


@dataclass(frozen=True)
class DoctorSection:
    """The `sdserve doctor` snapshot's verdict (status pass/fail/cpu-dev) and its reasons."""

    status: str
    reasons: tuple[str, ...] = ()

    _derived: ClassVar[tuple[str, ...]] = ("ok",)

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        return self.status + (": " + "; ".join(self.reasons) if self.reasons else "")


@dataclass(frozen=True)
class ShapeBoot:
    """A strict production boot (warm-up and self-test included) at one served shape."""

    width: int
    height: int
    batch: int
    ok: bool
    seconds: float
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class SessionPlacement:
    """Where one session's nodes run: CPU nodes on the shape path are allowed, on the activation path refused."""

    session: str
    providers: tuple[str, ...]
    gpu_nodes: int
    shape_path_cpu_nodes: tuple[str, ...] = ()
    activation_path_cpu_nodes: tuple[str, ...] = ()

    _derived: ClassVar[tuple[str, ...]] = ("ok",)

    @property
    def ok(self) -> bool:
        gpu_first = bool(self.providers) and self.providers[0] != "CPUExecutionProvider"
        return gpu_first and self.gpu_nodes > 0 and not self.activation_path_cpu_nodes


@dataclass(frozen=True)
class StagingBuffer:
    """A host staging buffer and the ``type`` cudaPointerGetAttributes reported for it."""

    name: str
    nbytes: int
    memory_type: int

    _derived: ClassVar[tuple[str, ...]] = ("pinned",)

    @property
    def pinned(self) -> bool:
        return self.memory_type == CUDA_MEMORY_TYPE_HOST


@dataclass(frozen=True)
class RelocationSection:
    """`engines build` -> move the folder -> load again: it must load from the new place without building."""

    built_at: str
    moved_to: str
    loaded: bool
    engine_built_on_load: bool
    reasons: tuple[str, ...] = ()

    _derived: ClassVar[tuple[str, ...]] = ("ok",)

    @property
    def ok(self) -> bool:
        return self.loaded and not self.engine_built_on_load

    def summary(self) -> str:
        if self.ok:
            return f"loaded from {self.moved_to} without a build"
        what = "an engine was built on load" if self.loaded else "did not load"
        return f"{what} after moving to {self.moved_to}" + ("; " + "; ".join(self.reasons) if self.reasons else "")


@dataclass(frozen=True)
class LatencyRun:
    """One runner's timing at the benchmark setting: per UNet step (ms) and per image (s)."""

    runner: str
    per_step_ms: float
    s_per_image: float

    def __post_init__(self) -> None:
        if not (self.per_step_ms > 0 and self.s_per_image > 0 and math.isfinite(self.s_per_image)):
            raise ValueError(f"{self.runner}: timings must be positive, got {self.per_step_ms} ms/step, "
                             f"{self.s_per_image} s/image")


@dataclass(frozen=True)
class LatencySection:
    """Ours next to diffusers' torch fp16 pipeline on the same random-weight SD 1.5-architecture model, same run."""

    ours: LatencyRun
    diffusers: LatencyRun | None
    """None when the torch reference was skipped (--skip-torch-reference): no comparison, and the summary says so."""
    width: int = 512
    height: int = 512
    steps: int = 50
    batch: int = 1
    min_speedup: float = 1.0
    """Ours must be at least this many times faster per image than the torch pipeline."""

    _derived: ClassVar[tuple[str, ...]] = ("speedup", "ok")

    @property
    def speedup(self) -> float | None:
        return None if self.diffusers is None else self.diffusers.s_per_image / self.ours.s_per_image

    @property
    def ok(self) -> bool:
        """At least ``min_speedup`` over the torch pipeline; a skipped reference judges nothing (the summary says)."""
        return self.speedup is None or self.speedup >= self.min_speedup

    def summary(self) -> str:
        ours = (f"{self.width}x{self.height}, {self.steps} steps, batch {self.batch}: ours "
                f"{self.ours.s_per_image:.3f} s/image ({self.ours.per_step_ms:.1f} ms/step)")
        if self.diffusers is None:
            return ours + "; diffusers torch reference skipped: no comparison"
        return (f"{ours} vs {self.diffusers.runner} {self.diffusers.s_per_image:.3f} s/image "
                f"({self.diffusers.per_step_ms:.1f} ms/step), x{self.speedup:.2f}")


@dataclass(frozen=True)
class StepFailure:
    """A step that could not produce its section (an exception, a missing input, the time budget spent): recorded
    in that section's place, so one broken step fails the report without hiding what the other steps proved."""

    step: str
    error: str
    seconds: float = 0.0

    _derived: ClassVar[tuple[str, ...]] = ("ok",)

    @property
    def ok(self) -> bool:
        return False

    def summary(self) -> str:
        return f"step failed after {self.seconds:.1f} s: {self.error}"


# ---------------------------------------------------------------------------------------------------------------------
# Inputs the command reads: the one-variable rule's before/after files, the recorded baseline, a replica's timing


def parse_key_values(text: str, source: str = "<text>") -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments and blank lines skipped; split at the first ``=``, both sides stripped).

    ``env`` output and ``pip freeze`` output both read this way (``torch==2.13`` -> key ``torch``, value ``=2.13``),
    so operators can describe a node before and after a fix with the tools they already run.
    """
    found: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{source}:{number}: expected KEY=VALUE, got {line[:80]!r}")
        if key.strip() in found:
            raise ValueError(f"{source}:{number}: {key.strip()} given twice")
        found[key.strip()] = value.strip()
    return found


def baseline_jobs_per_hour(baseline: Mapping[str, Any], gpu: str, source: str = "baseline") -> float:
    """The recorded protocol throughput for GPU model ``gpu`` (NVML's name) from a parsed baseline TOML::

        ["NVIDIA H200"]
        jobs_per_hour = 1180.0   # the protocol's jobs/hour on a healthy node of this model
    """
    entry = baseline.get(gpu)
    if not isinstance(entry, Mapping) or "jobs_per_hour" not in entry:
        known = ", ".join(sorted(str(k) for k in baseline)) or "none"
        raise ValueError(f"{source} has no jobs_per_hour for {gpu!r} (recorded: {known})")
    value = entry["jobs_per_hour"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{source} [{gpu!r}] jobs_per_hour must be a positive number, got {value!r}")
    return float(value)


def server_timing_seconds(header: str, metric: str = "compute") -> float:
    """The ``dur`` (milliseconds) of ``metric`` in a ``Server-Timing`` header, in seconds.

    A replica's ``compute`` is its pipeline time for the request, the same quantity the candidate's protocol jobs
    time, so parity compares engines and not the network between the two nodes.
    """
    for entry in header.split(","):
        name, *params = (part.strip() for part in entry.split(";"))
        if name != metric:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur":
                seconds = float(value) / 1000.0
                if not (math.isfinite(seconds) and seconds > 0):
                    raise ValueError(f"Server-Timing {metric} duration must be positive, got {value!r}")
                return seconds
    raise ValueError(f"no {metric};dur=... in Server-Timing {header[:120]!r}")


# ---------------------------------------------------------------------------------------------------------------------
# The report

SECTIONS = ("doctor", "boots", "placement", "staging", "copies", "relocation", "protocol", "parity", "signature",
            "latency")


@dataclass(frozen=True)
class AcceptReport:
    """Everything `sdserve accept` proved on one node. ``node`` describes it (GPU, driver, ORT version, ...)."""

    generated_at: str
    node: Mapping[str, str]
    doctor: DoctorSection | StepFailure
    boots: tuple[ShapeBoot, ...] | StepFailure
    placement: tuple[SessionPlacement, ...] | StepFailure
    staging: tuple[StagingBuffer, ...] | StepFailure
    copies: CopyCount | StepFailure
    relocation: RelocationSection | StepFailure
    protocol: ProtocolSection | StepFailure
    parity: Parity | StepFailure
    signature: SignatureSection | StepFailure
    latency: LatencySection | StepFailure
    notes: tuple[str, ...] = field(default=())

    def section_results(self) -> dict[str, bool]:
        """Section name -> ok. Lists pass only when non-empty and every entry passes; a failed step never passes."""
        return {
            "doctor": self.doctor.ok,
            "boots": _all_ok(self.boots, lambda b: b.ok),
            "placement": _all_ok(self.placement, lambda p: p.ok),
            "staging": _all_ok(self.staging, lambda b: b.pinned),
            "copies": self.copies.ok,
            "relocation": self.relocation.ok,
            "protocol": self.protocol.ok,
            "parity": self.parity.ok,
            "signature": self.signature.ok,
            "latency": self.latency.ok,
        }

    @property
    def failing(self) -> tuple[str, ...]:
        return tuple(name for name, ok in self.section_results().items() if not ok)

    @property
    def ok(self) -> bool:
        return not self.failing

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (validated by :func:`validate`)."""
        body: dict[str, Any] = _plain(self)
        verdict = {"status": _yes(self.ok).lower(), "failing": list(self.failing),
                   "sections": self.section_results()}
        return {"schema_version": SCHEMA_VERSION, **body, "verdict": verdict}

    def to_markdown(self) -> str:
        """A short summary: the verdict line, then one table row per section."""
        verdict = "PASS" if self.ok else "FAIL (" + ", ".join(self.failing) + ")"
        node = ", ".join(f"{k} {v}" for k, v in self.node.items())
        lines = [f"# sdserve accept: {verdict}", "", f"Node: {node}  ", f"Generated: {self.generated_at}", "",
                 f"**Verdict: {verdict}**", "", "| Check | Result | Detail |", "|---|---|---|"]
        results = self.section_results()
        lines += [f"| {name} | {_yes(results[name])} | {_cell(detail)} |" for name, detail in self._details()]
        lines += [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def _details(self) -> list[tuple[str, str]]:
        details = [(name, _summary(getattr(self, name))) for name in SECTIONS]
        lists = {"boots": self._boots_detail, "placement": self._placement_detail, "staging": self._staging_detail}
        return [(name, lists[name]() if name in lists and not isinstance(getattr(self, name), StepFailure)
                 else text) for name, text in details]

    def _boots_detail(self) -> str:
        boots = self.boots if isinstance(self.boots, tuple) else ()
        shapes = ", ".join(f"{b.width}x{b.height}x{b.batch}" for b in boots)
        return f"{sum(1 for b in boots if b.ok)}/{len(boots)} shapes booted strict ({shapes})"

    def _placement_detail(self) -> str:
        sessions = self.placement if isinstance(self.placement, tuple) else ()
        refused = sum(len(p.activation_path_cpu_nodes) for p in sessions)
        return f"{len(sessions)} sessions, {refused} activation-path nodes on CPU"

    def _staging_detail(self) -> str:
        buffers = self.staging if isinstance(self.staging, tuple) else ()
        return f"{sum(1 for b in buffers if b.pinned)}/{len(buffers)} staging buffers pinned"


def _all_ok(items: tuple[Any, ...] | StepFailure, ok: Callable[[Any], bool]) -> bool:
    return not isinstance(items, StepFailure) and bool(items) and all(ok(item) for item in items)


def _summary(section: object) -> str:
    summary = getattr(section, "summary", None)
    return str(summary()) if callable(summary) else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def load_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return schema


def validate(report: Mapping[str, Any]) -> list[str]:
    """Schema errors of a report dict against accept_report.schema.json (empty when valid).

    Needs jsonschema (a test dependency, imported here only): raises ImportError without it rather than pass a
    report it did not check.
    """
    try:
        jsonschema = importlib.import_module("jsonschema")  # a test dependency: not needed to serve
    except ImportError as exc:
        raise ImportError(f"validating an accept report needs jsonschema: {exc}") from exc
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted((_leaf(e) for e in validator.iter_errors(dict(report))), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def _leaf(error: Any) -> Any:
    """The error that says what is wrong inside an anyOf/oneOf: branch 0 is the alternative (a step failure, or
    null) and says nothing useful about a section that tried to be the real thing, so the other branches' deepest
    error is reported."""
    while error.context:
        branches = [e for e in error.context if e.schema_path and e.schema_path[0] != 0] or list(error.context)
        error = max(branches, key=lambda e: len(e.absolute_path))
    return error
