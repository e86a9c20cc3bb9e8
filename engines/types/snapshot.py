"""The frozen reports: classified ORT log events, the self-test report and the capability snapshot. Their JSON shape
is their ``model_dump(mode="json")`` (engines/schemas/capabilities.schema.json is tested against it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


EventKind = Literal["provider_library_missing", "provider_creation_failed", "driver_too_old", "cpu_fallback",
                    "nodes_not_on_preferred_provider", "memcpy_nodes_added", "engine_rebuild", "arena_growth",
                    "artifact_mismatch"]


Severity = Literal["error", "warning", "info"]


class OrtEvent(_Frozen):
    """A classified ONNX Runtime log line."""

    kind: EventKind
    severity: Severity
    """error: the fast path is broken; warning: it is degraded; info: worth knowing."""
    line: str
    detail: str = ""


# The self-test report


class ShapeResult(_Frozen):
    shape: str
    latencies_s: tuple[float, ...]
    p50_s: float
    p95_s: float
    budget_s: float | None
    gpu_util_percent: float | None
    gpu_util_floor: float | None
    distances: dict[str, float] = {}
    """canary name -> max |fingerprint difference| in pixel units."""
    failures: tuple[str, ...] = ()


class SelfTestReport(_Frozen):
    passed: bool
    shapes: tuple[ShapeResult, ...]
    fingerprints: str
    """'checked against ...', 'not recorded', or 'recorded now'."""
    seconds: float
    edits: tuple[ShapeResult, ...] = ()
    """The instruction edit canary per served size (batch 1), where the family has one and the model edits."""
    controlnets: tuple[ShapeResult, ...] = ()
    """The ControlNet canary per loaded ControlNet (engines/health/controlnet_canary.py), at the first served size,
    batch 1: distances at weights 0 and 1; a net refused by it carries the reason in ``failures`` (not a boot
    failure: the net is left out)."""


# The capability snapshot


class Verdict(_Frozen):
    status: Literal["pass", "fail", "cpu-dev"]
    reasons: tuple[str, ...]


class Policy(_Frozen):
    providers: tuple[str, ...]
    plugin: dict[str, str | bool | dict[str, str]] | None = None
    """The plugin EP the sessions run on (runtime.plugin), when the policy names one."""
    allow_cpu: bool
    enable_fallback: bool
    disable_cpu_ep_fallback: bool
    placement_audit: bool
    cpu_allowlist: tuple[str, ...]


class CheckResult(_Frozen):
    name: str
    category: Literal["gpu", "version"]
    status: Literal["pass", "fail", "skip"]
    observed: str
    expected: str
    remediation: str = ""


class LibraryClosure(_Frozen):
    library: str
    missing: dict[str, str]
    """soname -> the package that ships it."""
    resolved: dict[str, str]


class GpuDevice(_Frozen):
    index: int
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int


class NvmlInfo(_Frozen):
    available: bool
    error: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    devices: tuple[GpuDevice, ...] = ()


class FoundVersion(_Frozen):
    version: str | None
    source: str = ""


class PluginInfo(_Frozen):
    """A plugin execution provider as preflight found it (engines/runtime/plugins.py)."""

    name: str
    package: str
    package_version: str | None
    """pip metadata of the package."""
    library: str
    library_version: str | None
    """What the loaded library reports (its EP devices' metadata)."""
    devices: tuple[dict[str, str], ...]
    error: str = ""


class Observations(_Frozen):
    """What preflight found on this node."""

    onnxruntime: str
    onnxruntime_cuda_build: str
    available_providers: tuple[str, ...]
    provider_libraries: dict[str, LibraryClosure]
    nvml: NvmlInfo
    cudnn: FoundVersion
    tensorrt: FoundVersion
    plugin: PluginInfo | None = None
    tensorrt_install: str = ""
    """"installed", "placeholder" (a pip TensorRT metapackage without the real libraries) or "not installed"."""


class Placement(_Frozen):
    """Which provider runs each node of one session; what landed on the CPU and whether the policy allows it."""

    session: str
    nodes_by_provider: dict[str, int]
    cpu_ops: dict[str, int]
    """op_type -> count of nodes on the CPU provider."""
    disallowed_on_cpu: dict[str, int]
    compute_on_cpu: dict[str, int]
    examples: tuple[str, ...]
    attention: dict[str, int]
    """provider -> count of fused attention nodes."""
    ok: bool
    shape_path: dict[str, int] = {}
    """op_type -> CPU nodes computing only on shape values (allowed by the data-flow audit)."""
    activation_on_cpu: tuple[str, ...] = ()
    """'OpType name' of CPU nodes on an activation's path (refused in production)."""
    unmatched: tuple[str, ...] = ()
    """CPU node names the partitioned graph does not hold (refused: fail closed)."""


class SessionInfo(_Frozen):
    providers_requested: tuple[str, ...]
    providers_used: tuple[str, ...]
    ort_events: tuple[OrtEvent, ...]
    ort_log: tuple[str, ...]
    placement: Placement | None


class PlacementSummary(_Frozen):
    nodes_by_provider: dict[str, int]
    compute_on_cpu: dict[str, int]
    ok: bool


class IoInfo(_Frozen):
    binding: str
    device: str
    host_staging: str
    buffers_reused_per_shape: bool


class EngineArtifacts(_Frozen):
    path: str
    profiles: tuple[dict[str, str | int | list[int] | dict[str, str]], ...]
    cache_read_only: bool
    build_placement: dict[str, dict[str, int]] = {}
    """Per component, the source graph's nodes by provider when the build compiled it (the EP-context model
    that serves it is one EPContext node)."""


class Artifacts(_Frozen):
    model_manifest: str = "not checked"
    engines: EngineArtifacts | None = None


class Attention(_Frozen):
    fused: bool
    on_gpu: bool
    by_session: dict[str, dict[str, int]]


class Capabilities(_Frozen):
    """The capability snapshot (GET /capabilities, `sdserve doctor --json`): what was proven about the fast path."""

    schema_version: Literal[1] = 1
    generated_at: str
    accelerated: bool
    """True only when every check passed, every session runs on a GPU provider and no compute op is on the CPU."""
    verdict: Verdict
    device: Literal["cuda", "cpu"]
    device_id: int
    model: str
    policy: Policy
    provider_options: dict[str, dict[str, str]]
    checks: tuple[CheckResult, ...]
    observations: Observations | None
    sessions: dict[str, SessionInfo]
    placement_summary: dict[str, PlacementSummary]
    io: IoInfo
    arena: dict[str, str | bool | float | int]
    artifacts: Artifacts
    attention: Attention
    self_test: SelfTestReport | None
    family: dict[str, str | int | float | bool] = {}
    """The served model's family (ModelInfo.family_summary); empty before the model loads."""
    lora: dict[str, object] = {}
    """The adapter library and the merged-set cache (engines/lora/manager.py): folder, files, recent sets; empty
    when no [runtime.lora] dir is configured."""
    image: dict[str, str] = {}
    """The container image this server runs in, from the ``SDSERVE_IMAGE_*`` environment the image sets (``variant``:
    ``trt``, or ``notrt`` for an image built without the TensorRT libraries); empty outside an image."""
