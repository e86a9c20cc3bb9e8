"""The pure-logic core of `sdserve accept`: the acceptance report, its verdicts and its schema.

`sdserve accept` runs on a fresh GPU node and proves the fast path end to end; the GPU-bound parts (booting, profiling,
NVML sampling, the diffusers comparison) live with the command. Everything here is a pure function of numbers and
files those parts produce, so it is tested without a GPU:

- the field's acceptance protocol: N jobs back to back, all must succeed (:class:`JobStats`, :func:`protocol_verdict`),
  a fix is accepted only when one variable changed (:func:`one_variable_changed`);
- throughput parity against a reference inside a band (:func:`parity_percent`, :func:`parity_check`);
- the NVML signature over the jobs (:func:`signature_section`);
- the inputs the command reads (key=value files, the recorded baseline, a replica's Server-Timing).

Host<->device copies per step from an ONNX Runtime profile are in accept_copies.py; the other sections and the
report (its JSON Schema check and Markdown summary) in accept_report.py.

Every section says ``ok``; the report passes only when every section does.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "accept_report.schema.json"
SCHEMA_VERSION = 1
EXIT_NO_GPU = 20
"""Exit status of `sdserve accept` on a machine without a usable NVIDIA GPU."""

PROTOCOL_JOBS = 10
"""The field's protocol: this many jobs back to back, every one must succeed."""


HEALTHY_SIGNATURES = frozenset({"healthy_compute", "memory_bound"})
CUDA_MEMORY_TYPE_HOST = 1
"""``cudaPointerAttributes.type`` for page-locked host memory (cudaMemoryTypeHost); 0 is pageable (unregistered)."""


@dataclass(frozen=True)
class Outcome:
    """A verdict with the reasons that decided it (empty when ok)."""

    ok: bool
    reasons: tuple[str, ...] = ()


class GpuReading(Protocol):
    """What the signature section and its classifier read of an NVML sample (engines.types.health.GpuSample has it)."""

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


def plain(value: Any) -> Any:
    """Dataclasses -> dicts (plus their ``_derived`` properties), tuples -> lists: JSON- and jsonschema-ready."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        for name in getattr(value, "_derived", ()):
            out[name] = plain(getattr(value, name))
        return out
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def yes_no(ok: bool) -> str:
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
