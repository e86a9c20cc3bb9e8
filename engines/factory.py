"""The constructors server/ may call: an engine for a model folder under a runtime policy, the upscaler library
of A1111's extras routes (engines/pipelines/upscale.py, re-exported here: its ONNX sessions load lazily) and the
ControlNet annotator networks (engines/pipelines/annotator.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.config import Matrix, RuntimeSettings, SelfTestPlan, SignatureThresholds
from engines.pipelines.annotator import OnnxAnnotator
from engines.pipelines.upscale import OnnxUpscaler, TilesStopped, UpscalerLibrary
from engines.protocol import Engine
from engines.types.health import Faults

__all__ = ["OnnxAnnotator", "OnnxUpscaler", "TilesStopped", "UpscalerLibrary", "accept", "accept_step_budgets",
           "create_engine", "dit_build_estimate", "manifest_name", "memory_plan", "require_build_fits"]


def create_engine(model: Path, runtime: RuntimeSettings, matrix: Matrix | None = None,
                  plan: SelfTestPlan | None = None, faults: Faults | None = None,
                  signature: SignatureThresholds | None = None, watch_ort_log: bool = False,
                  max_running: int = 32) -> Engine:
    """The ONNX Runtime engine (nothing loads until ``preflight`` and ``load`` are called); ``max_running``: the
    step scheduler's resident images (``queue.max_running``), which sizes the runtime's buffer caches."""
    from engines.engine import OrtEngine

    return OrtEngine(model, runtime, matrix, plan, faults, signature, watch_ort_log, max_running)


def accept(model: Path | None, runtime: RuntimeSettings, matrix: Matrix, plan: SelfTestPlan,
           signature: SignatureThresholds, out: Path, *, jobs: int = 10, band_percent: float = 10.0,
           baseline: Path | None = None, compare: str | None = None, changed: tuple[Path, Path] | None = None,
           skip_torch_reference: bool = False, budget_s: float | None = None,
           step_budgets_s: tuple[tuple[str, float], ...] = (), size: int = 512, steps: int = 50) -> tuple[str, ...]:
    """`sdserve accept`: the GPU gate (GpuUnavailableError at once without a GPU), every acceptance step, then
    ``accept_report.json`` and ``accept_report.md`` under ``out``. Returns the failing sections (empty: accepted)."""
    from engines.accept.run import AcceptOptions, run_acceptance

    return run_acceptance(AcceptOptions(
        out=out, runtime=runtime, matrix=matrix, plan=plan, thresholds=signature, model=model, jobs=jobs,
        band_percent=band_percent, baseline=baseline, compare=compare, changed=changed,
        skip_torch_reference=skip_torch_reference, budget_s=budget_s, step_budgets_s=step_budgets_s,
        size=size, steps=steps))


def accept_step_budgets() -> dict[str, float]:
    """`sdserve accept`'s default budget per step, in seconds (engines/accept/report.py)."""
    from engines.accept.report import STEP_BUDGETS_S

    return dict(STEP_BUDGETS_S)


def manifest_name() -> str:
    """The file name of a model folder's and an artifact folder's manifest (engines/artifacts.py)."""
    from engines.artifacts import MANIFEST

    return MANIFEST


def memory_plan(model: Path, runtime: RuntimeSettings, width: int, height: int, images: int, sizes: int = 1,
                dtype: str | None = None, device_bytes: int | None = None, device_source: str = "",
                pod_limit: int | None = None, pod_source: str = "") -> dict[str, Any]:
    """`sdserve doctor`'s memory plan of a model folder, from its files or its configs alone (nothing loads):
    device and host bytes with and without LoRA, compared with the device's memory and the pod's limit when
    given (engines/health/memory_plan.py). ModelLoadError when the folder is no family sdserve serves."""
    from engines.health.memory_plan import Budgets, for_runtime

    return for_runtime(model, runtime, width, height, images, sizes, dtype,
                       Budgets(device_bytes, device_source, pod_limit, pod_source))


def dit_build_estimate(model: Path, sizes: int) -> Any:
    """A DiT folder's TensorRT build estimate for ``sizes`` served sizes (engines/health/build_memory.py
    ``BuildEstimate``: host RAM peak, device, disk), or None for a UNet folder."""
    from engines.health.build_memory import estimate
    from engines.pipelines.flow_family import is_dit_folder

    return estimate(model, sizes) if is_dit_folder(model) else None


def require_build_fits(found: Any, model: Path) -> dict[str, Any]:
    """ArtifactError (exit 23) naming the numbers when this node's host RAM or free disk under ``model`` cannot
    hold the build ``found`` estimates; else the node's readings (engines/health/build_memory.py)."""
    from engines.health.build_memory import require_fits

    return require_fits(found, model)
