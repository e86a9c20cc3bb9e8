"""`sdserve accept`: what a run was asked (AcceptOptions) and what its steps share (Run), with the small helpers
every step uses: the protocol's job, the strict policy, the node's description and the NVML index."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engines.accept import proofs as acc
from engines.accept import report as rep
from engines.config import Matrix, RuntimeSettings, SelfTestPlan, SignatureThresholds
from engines.engine import OrtEngine
from engines.errors import GpuUnavailableError, NotReadyError
from engines.health.preflight import Observations
from engines.types.health import GpuSample
from engines.types.request import Batch, BatchResult, ImageSpec

COMPONENTS = ("text_encoder", "unet", "vae_decoder")


PROMPT = "an astronaut riding a horse"


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
    budget_s: float | None = None
    """The whole run's cap; None: the sum of the step budgets."""
    step_budgets_s: tuple[tuple[str, float], ...] = ()
    """Overrides of rep.STEP_BUDGETS_S, (step, seconds)."""
    size: int = 512
    steps: int = 50

    def step_budget(self, name: str) -> float:
        return dict(self.step_budgets_s).get(name, rep.STEP_BUDGETS_S.get(name, 60.0))

    @property
    def total_budget_s(self) -> float:
        return self.budget_s if self.budget_s is not None else sum(self.step_budget(n) for n in rep.STEP_BUDGETS_S)


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
    sample_errors: dict[str, int] = field(default_factory=dict)
    """Why NVML readings failed during the protocol (reason -> count): the sampler records and goes on."""
    notes: list[str] = field(default_factory=list)
    timings: list[rep.StepTiming] = field(default_factory=list)
    budgets: dict[str, float] = field(default_factory=dict)
    """Budgets a step learns while it runs (relocation: the model family's build budget, trtplan.BUILD_BUDGET_S);
    a --step-budget given by the operator wins."""

    def step_budget(self, name: str) -> float:
        if name in dict(self.options.step_budgets_s) or name not in self.budgets:
            return self.options.step_budget(name)
        return self.budgets[name]

    def booted(self) -> OrtEngine:
        if self.engine is None:
            raise NotReadyError(f"no booted engine: {self.engine_error}")
        return self.engine

    def served(self) -> Path:
        if self.model is None:
            raise NotReadyError("no model to accept (the build step failed)")
        return self.model


def nvml_index(observations: Observations, device_id: int) -> int:
    """The served card's NVML index, matched by PCI bus id as serving does; GpuUnavailableError when nothing
    matches (never the CUDA ordinal as a guess: with CUDA_VISIBLE_DEVICES it names another card)."""
    found = observations.nvml_index(device_id)
    if found is None:
        raise GpuUnavailableError(f"CUDA ordinal {device_id} matches no NVML device by PCI bus id")
    return found


def reference_key(run: Run) -> str:
    """What a baseline is recorded under: the GPU model as NVML names it, or for a plugin EP on the CPU, the EP and
    its device type (e.g. "OpenVINOExecutionProvider CPU")."""
    plugin = run.options.runtime.plugin
    if plugin is not None and run.options.runtime.device != "cuda":
        return f"{plugin.name} {plugin.device_type}"
    return node(run)["gpu"]


def node(run: Run) -> dict[str, str]:
    """The report's description of the node: the GPU (by PCI bus id, never the ordinal) or the plugin EP's device."""
    nv, device_id = run.observations.nvml, run.options.runtime.device_id
    plugin = run.options.runtime.plugin
    if plugin is not None and run.options.runtime.device != "cuda":
        found = run.observations.plugin
        name = found.devices[0].get("device_name", "?") if found is not None and found.devices else "no device"
        return {"accelerator": f"{plugin.name} on {plugin.device_type} ({name})", "onnxruntime":
                run.observations.ort_version, "model": str(run.model or run.options.model or "not built")}
    device = run.observations.device(device_id)
    gpu = device.name if device is not None else "no NVML device matches this ordinal's PCI bus id"
    return {"gpu": gpu, "device_id": str(device_id), "driver": nv.driver_version, "cuda_driver": nv.cuda_driver_version,
            "onnxruntime": run.observations.ort_version, "model": str(run.model or run.options.model or "not built")}


def strict(run: Run) -> RuntimeSettings:
    """The profile's runtime, strict: no CPU, placement audit on (the placement section reads it)."""
    return run.options.runtime.model_copy(update={"allow_cpu": False, "placement_audit": True})


def job(run: Run, seed: int, steps: int | None = None) -> Batch:
    """One protocol job: the protocol's size, batch 1, ``steps`` (default: the protocol's) Euler steps."""
    return Batch((ImageSpec(PROMPT, seed=seed),), run.options.size, run.options.size,
                 steps or run.options.steps, "euler")
