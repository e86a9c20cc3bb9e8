"""`sdserve accept`: the report sections measured by the command and judged here, and the report itself (its JSON
form checked against engines/schemas/accept_report.schema.json, and a short Markdown summary)."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from engines.accept.copies import CopyCount
from engines.accept.proofs import (
    CUDA_MEMORY_TYPE_HOST,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    Parity,
    ProtocolSection,
    SignatureSection,
    plain,
    yes_no,
)

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


@dataclass(frozen=True)
class NotApplicable:
    """A check that says nothing on this node, and why: not this EP's (a TensorRT/CUDA-only measurement on another
    EP), or its input was not given (parity without --baseline/--compare). It never reads as ok: the report shows
    "not applicable" and the reason; it does not fail the verdict either."""

    step: str
    reason: str

    _derived: ClassVar[tuple[str, ...]] = ("state",)

    @property
    def state(self) -> str:
        return "not applicable"

    def summary(self) -> str:
        return f"not applicable: {self.reason}"


STEP_STATES = ("ok", "failed", "over budget", "not started", "not applicable")
STEP_BUDGETS_S: Mapping[str, float] = {
    "model": 900.0, "relocation": 1800.0, "boots": 600.0, "placement": 60.0, "staging": 120.0, "copies": 300.0,
    "protocol": 900.0, "signature": 10.0, "parity": 900.0, "latency": 900.0}
"""Each step's own time budget, seconds (estimates for SD 1.5 at 512x512 on one H200, not yet measured there):
exporting the model from torch (model), `engines build` of four TensorRT engines and a reload (relocation), the
10-job protocol and as many jobs on a replica (parity), the torch reference (latency). --step-budget overrides one;
--budget (default: their sum) caps the run: a step not started by then is recorded as failed."""


@dataclass(frozen=True)
class StepTiming:
    """One step of the run: how long it took against its own budget, and how it ended (STEP_STATES)."""

    step: str
    seconds: float
    budget_s: float
    state: str

    def row(self) -> str:
        return f"| {self.step} | {self.seconds:.1f} | {self.budget_s:g} | {self.state} |"


# ---------------------------------------------------------------------------------------------------------------------
# The report

SECTIONS = ("doctor", "boots", "placement", "staging", "copies", "relocation", "protocol", "parity", "signature",
            "latency")


@dataclass(frozen=True)
class AcceptReport:
    """Everything `sdserve accept` proved on one node. ``node`` describes it (GPU, driver, ORT version, ...)."""

    generated_at: str
    node: Mapping[str, str]
    doctor: DoctorSection | StepFailure | NotApplicable
    boots: tuple[ShapeBoot, ...] | StepFailure | NotApplicable
    placement: tuple[SessionPlacement, ...] | StepFailure | NotApplicable
    staging: tuple[StagingBuffer, ...] | StepFailure | NotApplicable
    copies: CopyCount | StepFailure | NotApplicable
    relocation: RelocationSection | StepFailure | NotApplicable
    protocol: ProtocolSection | StepFailure | NotApplicable
    parity: Parity | StepFailure | NotApplicable
    signature: SignatureSection | StepFailure | NotApplicable
    latency: LatencySection | StepFailure | NotApplicable
    notes: tuple[str, ...] = field(default=())
    steps: tuple[StepTiming, ...] = field(default=())

    def section_results(self) -> dict[str, bool | None]:
        """Section name -> ok, None when not applicable. Lists pass only when non-empty and every entry passes; a
        failed step never passes."""
        checks: dict[str, Callable[[Any], bool]] = {
            "boots": lambda b: _all_ok(b, lambda x: x.ok), "placement": lambda p: _all_ok(p, lambda x: x.ok),
            "staging": lambda b: _all_ok(b, lambda x: x.pinned)}
        results: dict[str, bool | None] = {}
        for name in SECTIONS:
            section = getattr(self, name)
            results[name] = None if isinstance(section, NotApplicable) else bool(
                checks[name](section) if name in checks else section.ok)
        return results

    @property
    def over_budget(self) -> tuple[str, ...]:
        return tuple(t.step for t in self.steps if t.state in ("over budget", "not started"))

    @property
    def failing(self) -> tuple[str, ...]:
        sections = tuple(name for name, ok in self.section_results().items() if ok is False)
        return sections + (("budget",) if self.over_budget else ())

    @property
    def ok(self) -> bool:
        return not self.failing

    def as_dict(self) -> dict[str, Any]:
        """The JSON report (validated by :func:`validate`)."""
        body: dict[str, Any] = plain(self)
        verdict = {"status": yes_no(self.ok).lower(), "failing": list(self.failing),
                   "sections": self.section_results()}
        return {"schema_version": SCHEMA_VERSION, **body, "verdict": verdict}

    def to_markdown(self) -> str:
        """A short summary: the verdict line, then one table row per section."""
        verdict = "PASS" if self.ok else "FAIL (" + ", ".join(self.failing) + ")"
        node = ", ".join(f"{k} {v}" for k, v in self.node.items())
        lines = [f"# sdserve accept: {verdict}", "", f"Node: {node}  ", f"Generated: {self.generated_at}", "",
                 f"**Verdict: {verdict}**", "", "| Check | Result | Detail |", "|---|---|---|"]
        results = self.section_results()
        lines += [f"| {name} | {_state(results[name])} | {_cell(detail)} |" for name, detail in self._details()]
        if self.steps:
            lines += ["", "| Step | Seconds | Budget (s) | State |", "|---|---|---|---|"]
            lines += [t.row() for t in self.steps]
        lines += [""] * bool(self.notes) + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"

    def _details(self) -> list[tuple[str, str]]:
        details = [(name, _summary(getattr(self, name))) for name in SECTIONS]
        lists = {"boots": self._boots_detail, "placement": self._placement_detail, "staging": self._staging_detail}
        return [(name, lists[name]() if name in lists and isinstance(getattr(self, name), tuple)
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


def _all_ok(items: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(items, tuple) and bool(items) and all(ok(item) for item in items)


def _state(ok: bool | None) -> str:
    return "n/a" if ok is None else yes_no(ok)


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
