"""Config types: typed, bounded, frozen models of configs/*.toml, shared by server/ and engines/.

The ``[runtime]`` table of a profile (RuntimeSettings), the version matrix (Matrix), the GPU signature thresholds,
the canary suite, the SLO windows and the self-test plan built from them, and the one ``WIDTHxHEIGHT`` parser.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engines.canary_config import Canary as Canary  # the canary models, re-exported: loaded here
from engines.canary_config import CanarySuite as CanarySuite
from engines.canary_config import ControlNetCanary as ControlNetCanary
from engines.canary_config import EditCanary as EditCanary
from engines.canary_config import FamilyCanaries as FamilyCanaries
from engines.errors import ConfigError

ProviderName = Literal["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
BUILT_IN_PROVIDERS: tuple[str, ...] = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
PLUGIN_PROVIDERS: dict[str, str] = {
    "OpenVINOExecutionProvider": "onnxruntime-ep-openvino",
    "NvTensorRTRTXExecutionProvider": "onnxruntime-ep-nv-tensorrt-rtx",
}
"""Execution providers that ship as plugin libraries (ORT's EP ABI), with the pip package that ships each."""


def plugin_in_providers(name: str) -> str:
    """Why a plugin EP may not be named in runtime.providers (the old way of choosing a provider)."""
    package = PLUGIN_PROVIDERS.get(name, "its pip package")
    return (f"runtime.providers lists {name}, a plugin execution provider: named there, ONNX Runtime only warns "
            f"'Specified provider ... is not in available provider names' and runs every node on "
            "CPUExecutionProvider (the silent fallback this server exists to stop). Declare it as "
            f"[runtime.plugin] with name = \"{name}\" and package = \"{package}\"; the server registers its "
            "library and builds sessions with SessionOptions.add_provider_for_devices")


class CudaOptions(BaseModel):
    """CUDA execution provider options; every one is reported in the capability snapshot."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kSameAsRequested"
    """How the arena grows; kSameAsRequested avoids hoarding power-of-two blocks under varied shapes."""
    gpu_mem_limit_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """CUDA-provider arena cap as a fraction of the served device's total memory (read by preflight through NVML);
    the capability snapshot reports the byte limit and what it does not cover (arena gpu_mem_limit_scope): it is
    not a device-memory budget for the process (TensorRT engines and IO-binding buffers are outside it)."""
    shared_arena: bool = True
    """One capped CUDA arena for the whole process, registered with ORT's environment before the first device
    tensor (create_and_register_allocator_v2, ``max_mem`` = the gpu_mem_limit above, this extend strategy) and
    used by every session (``session.use_env_allocators``): IO-binding buffers, merged LoRA weights and the
    sessions' own allocations then share one bound. Off: each session's arena and the binding's uncapped one."""
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "HEURISTIC"
    """Conv algorithm search; EXHAUSTIVE benchmarks every shape on first use (slow first requests)."""
    do_copy_in_default_stream: bool = True
    """Copies on the compute stream: simpler ordering, no cross-stream races."""
    enable_cuda_graph: bool = False
    """Must stay false: refused at validation (see CUDA_GRAPH_REFUSAL)."""
    prefer_nhwc: bool = False
    """NHWC convolution kernels where available."""
    use_tf32: bool = True
    """TF32 math for fp32 matmul/conv on Ampere and newer."""
    shared_compute_stream: bool = False
    """Every CUDA (and TensorRT) session of the engine runs on one CUDA stream the engine creates (provider option
    ``user_compute_stream``, onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc), so the runs of a
    step-batching tick (joins, the denoiser, the split, the step graphs) skip ORT's per-run stream synchronize
    (run option ``disable_synchronize_execution_providers``) and the tick synchronizes once at its end
    (engines/runtime/buffers.py ``one_tick``). Off: each session keeps its own stream and every run ends in a
    synchronize, as ORT does by default. When the stream cannot be created (no libcudart, no driver) the engine
    falls back to per-session streams, logs why and keeps it in ``Runtime.stream_state``. Off by default until a GPU
    run has measured it."""

    @model_validator(mode="after")
    def _no_cuda_graph(self) -> CudaOptions:
        if self.enable_cuda_graph:
            raise ValueError(CUDA_GRAPH_REFUSAL)
        return self


CUDA_GRAPH_REFUSAL = (
    "runtime.cuda.enable_cuda_graph = true is refused: ONNX Runtime replays a captured CUDA graph only with every "
    "node on the CUDA provider, every input and output bound at the same device address as at capture, and one "
    "gpu_graph_id run option per captured shape (onnxruntime/core/providers/cuda/cuda_execution_provider.cc, "
    "the gpu_graph_id key in onnxruntime_run_options_config_keys.h, and the refusal 'cannot use the graph capture "
    "feature' in core/session/inference_session.cc). This pipeline rebinds per-step inputs from the host (timestep, "
    "scheduler coefficients), keeps shape arithmetic on the CPU, and serves shapes that vary per request (size, "
    "batch): a graph would replay stale addresses or the wrong shape. Set enable_cuda_graph = false.")
"""Why CUDA graphs are refused at config validation; the message a profile with them on fails with."""


class TensorrtOptions(BaseModel):
    """TensorRT execution provider options."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fp16: bool = True
    """Build/load fp16 engines."""
    engine_cache_path: str = "trt/engines"
    """Folder of prebuilt engines, relative to the model folder unless absolute."""
    timing_cache: bool = True
    """Reuse the builder timing cache."""
    forbid_engine_build: bool = True
    """Refuse a session when ORT says it will build (or could not deserialize) an engine: engines are artifacts,
    built offline with `sdserve engines build`. The dev profile may allow on-node builds, with a warning."""
    require_engines: bool = True
    """With TensorRT in the policy, refuse to start without verified prebuilt engines in <model>/trt."""


class PluginEp(BaseModel):
    """A plugin execution provider, registered from the pip package that ships its library (ORT's EP ABI:
    ``onnxruntime.register_execution_provider_library`` + ``SessionOptions.add_provider_for_devices``). Sessions run
    on the devices ``ort.get_ep_devices()`` lists for ``name`` and ``device_type``; never by name in providers=."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z][A-Za-z0-9]*ExecutionProvider$")
    """EP name as ort.get_ep_devices() reports it (e.g. OpenVINOExecutionProvider)."""
    package: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """pip distribution that ships the library (e.g. onnxruntime-ep-openvino); preflight reports its version."""
    module: str = Field("", pattern=r"^([A-Za-z_][A-Za-z0-9_.]*)?$")
    """Import name whose get_library_path() returns the library; default: the package name with '_' for '-'."""
    library: str = ""
    """Library path instead of the module's get_library_path() (absolute); empty: ask the module."""
    device_type: Literal["CPU", "GPU", "NPU"] = "CPU"
    """Hardware device type of the EP devices to use (OrtHardwareDevice.type)."""
    options: dict[str, str] = {}
    """EP options passed to add_provider_for_devices (reported in the capability snapshot)."""
    require_artifacts: bool = True
    """Refuse to start without verified EP-context artifacts (``sdserve engines build``) in <model>/ep/<name>."""

    @property
    def import_name(self) -> str:
        return self.module or self.package.replace("-", "_")

    @property
    def registration(self) -> str:
        """The name the library is registered under (register_execution_provider_library)."""
        return f"sdserve_{self.name}"


class LoraSettings(BaseModel):
    """LoRA per request (engines/lora/): the adapter library and the merged-set cache. Off while ``dir`` is empty."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: str = ""
    """Folder of ``.safetensors`` LoRA files (A1111's ``--lora-dir``; ``sdserve serve --lora-dir``,
    ``SDSERVE_LORA_DIR``). Empty: no LoRA; requests naming one get a 400."""
    cache_mb: int = Field(2048, ge=1, le=1_048_576)
    """Device memory for merged adapter sets (each holds one copy of every weight it changes), LRU-evicted."""
    max_file_mb: int = Field(2048, ge=1, le=65_536)
    """Larger files are refused (listed with the reason), never read."""
    max_header_kb: int = Field(1024, ge=1, le=102_400)
    """A safetensors header (JSON) larger than this is refused before it is parsed."""
    max_per_request: int = Field(8, ge=1, le=64)
    """LoRAs one request may name (prompt tags and the ``loras`` field together)."""
    max_multiplier: float = Field(10.0, gt=0, le=100)
    """Bound on each multiplier's absolute value."""
    targets: Literal["all", "blocks"] = "all"
    """Weights a LoRA may change: every Linear and Conv of the text encoders and the denoiser (``all``), or those
    inside attention/transformer blocks only (``blocks``: fewer overridable weights in the LoRA sessions)."""


class ControlNetSettings(BaseModel):
    """ControlNet units per request (engines/pipelines/controlnet.py, server/controlnet.py). Off while ``dir`` is
    empty."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dir: str = ""
    """Folder of exported ControlNets, one subfolder each (model.onnx, config.json; ``sdserve engines export
    --controlnet``), listed as ``name [hash8]`` (A1111's ``--controlnet-dir``; ``sdserve serve --controlnet-dir``).
    A folder that does not fit the model is refused by name, never fatal to the boot.
    Empty: no ControlNet; a request with units gets a 422."""


class RuntimeSettings(BaseModel):
    """How sessions are built and which providers may run them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    providers: tuple[ProviderName, ...] = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    """Built-in execution providers in priority order. CPUExecutionProvider may appear only when allow_cpu is true.
    Empty when ``plugin`` is set: a session takes either providers= or add_provider_for_devices, and ORT keeps
    only providers= when given both (onnxruntime/capi/onnxruntime_inference_collection.py)."""
    plugin: PluginEp | None = None
    """A plugin execution provider as the accelerator (e.g. OpenVINO on the CPU in CI, TensorRT-RTX on RTX cards)."""
    allow_cpu: bool = False
    """Whether running on the CPU is acceptable (dev only). Never implied by anything else."""
    device_id: int = Field(0, ge=0, le=63)
    """CUDA device ordinal this process serves (one process per GPU)."""
    buffer_cache_mb: int = Field(256, ge=1, le=1_048_576)
    """MiB the per-shape device buffers, host staging (pinned on a GPU) and per-step tables keep between requests,
    least recently used shape evicted first (engines/runtime/buffers.py): distinct sizes cannot grow it past this."""
    intra_op_threads: int = Field(0, ge=0, le=256)
    """ORT intra-op threads; 0 lets ONNX Runtime choose (one per physical core)."""
    intra_op_spinning: bool = False
    """session.intra_op.allow_spinning: idle ORT threads busy-wait for the next op. Off by default: on a machine
    shared with other processes spinning steals the cores they (and our own next op) need; measured no slower on
    the CPU path (docs/benchmarks.md). Turn on for a dedicated CPU host."""
    placement_audit: bool = True
    """Record per-node provider assignment and refuse sessions with a CPU node on an activation's path (GPU
    policies); CPU nodes that compute only on shape values are allowed and counted (engines/runtime/dataflow.py)."""
    cpu_allowlist: tuple[str, ...] = ("Shape", "Reshape", "Unsqueeze", "Squeeze", "Gather", "Concat", "Slice",
                                      "Cast", "ConstantOfShape", "Constant", "Range", "Equal", "Where", "Expand",
                                      "Identity", "Size", "NonZero")
    """Deprecated and ignored: the placement audit decides by data flow, not op name (an op-name list cannot tell
    shape arithmetic from compute). Still accepted so existing profiles load; reported in the snapshot's policy."""
    disable_cpu_ep_fallback: bool = False
    """Also set session.disable_cpu_ep_fallback=1: ORT refuses any CPU node outright. Off by default because
    dynamic-shape models keep shape ops on the CPU; the placement audit is the finer check."""
    verify: Literal["full", "size", "off"] = "full"
    """Check model (and engine) files against their manifests at load: sha256 (full), sizes only, or not at all."""
    manifest_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """sha256 (lowercase hex) of the model's manifest.json, pinned in the profile or deployment. The manifest covers
    every file of the model folder; this digest covers the manifest, so an edited manifest is refused (exit 23)."""
    ort_log_severity: int = Field(2, ge=0, le=4)
    """ORT log level during session creation (0 verbose .. 4 fatal); captured lines are classified."""
    cuda: CudaOptions = CudaOptions()
    tensorrt: TensorrtOptions = TensorrtOptions()
    lora: LoraSettings = LoraSettings()
    controlnet: ControlNetSettings = ControlNetSettings()
    upscaler_dir: str = ""
    """Folder of ESRGAN-family upscalers as ONNX files (``<name>.onnx``: RRDBNet such as Real-ESRGAN or
    4x-UltraSharp, NCHW float RGB in [0, 1] in and out), served by A1111's extras routes and listed on
    /sdapi/v1/upscalers under their file names (engines/pipelines/upscale.py). Empty: the resizers only."""
    upscaler_tile: int = Field(192, ge=16, le=2048)
    """Side of the square tiles an upscaler runs on (A1111's ESRGAN_tile): bounds its memory whatever the image."""
    upscaler_tile_overlap: int = Field(8, ge=0, le=256)
    """Context pixels each tile reads past each side and crops from its output (A1111's ESRGAN_tile_overlap):
    seams vanish once it covers the network's receptive field."""

    @field_validator("providers", mode="before")
    @classmethod
    def _known_providers(cls, value: object) -> object:
        for name in value if isinstance(value, list | tuple) else ():
            if name in PLUGIN_PROVIDERS:
                raise ValueError(plugin_in_providers(str(name)))
            if isinstance(name, str) and name not in BUILT_IN_PROVIDERS:
                raise ValueError(f"runtime.providers: unknown provider {name!r}; built in: "
                                 f"{', '.join(BUILT_IN_PROVIDERS)}; a plugin EP goes in [runtime.plugin]")
        return value

    @model_validator(mode="after")
    def _check(self) -> RuntimeSettings:
        if self.plugin is not None:
            self._check_plugin(self.plugin)
        elif not self.providers:
            raise ValueError("runtime.providers is empty: list at least one execution provider")
        if len(set(self.providers)) != len(self.providers):
            raise ValueError(f"runtime.providers lists a provider twice: {list(self.providers)}")
        if "CPUExecutionProvider" in self.providers and not self.allow_cpu:
            raise ValueError("runtime.providers lists CPUExecutionProvider but runtime.allow_cpu is false: "
                             "remove it, or set allow_cpu = true (dev profile only)")
        if "CPUExecutionProvider" in self.providers and self.providers[-1] != "CPUExecutionProvider":
            raise ValueError("runtime.providers: CPUExecutionProvider must come last")
        if self.cuda.prefer_nhwc and self.placement_audit and not self.allow_cpu:
            raise ValueError("runtime.cuda.prefer_nhwc = true with the placement audit on is refused: the CUDA "
                             "provider's NHWC layout transformation rewrites the graph inside the partitioner "
                             "(onnxruntime/core/framework/graph_partitioner.cc), so the recorded node names no "
                             "longer match the graph the audit classifies and every session would be refused; set "
                             "prefer_nhwc = false")
        if self.manifest_sha256 and self.verify == "off":
            raise ValueError("runtime.manifest_sha256 is pinned but runtime.verify is off: set verify = \"full\" "
                             "(or \"size\"), or remove the pin")
        return self

    def _check_plugin(self, plugin: PluginEp) -> None:
        if self.providers:
            raise ValueError(f"runtime.plugin ({plugin.name}) with runtime.providers {list(self.providers)}: a "
                             "session takes either, and ONNX Runtime silently keeps only providers= when given "
                             "both; set providers = []")
        if plugin.name in BUILT_IN_PROVIDERS:
            raise ValueError(f"runtime.plugin.name {plugin.name} is built into onnxruntime: list it in providers")

    @property
    def device(self) -> str:
        """Where IO binding places tensors: 'cuda' when a GPU provider is first (or a GPU plugin EP), else 'cpu'
        (the CPU provider, or a plugin EP on the CPU device, which reads host memory)."""
        if self.plugin is not None:
            return "cuda" if self.plugin.device_type == "GPU" else "cpu"
        return "cpu" if self.providers[0] == "CPUExecutionProvider" else "cuda"

    @property
    def accelerators(self) -> tuple[str, ...]:
        """The providers every session must run on: the plugin EP, or the listed ones but the CPU."""
        if self.plugin is not None:
            return (self.plugin.name,)
        return tuple(p for p in self.providers if p != "CPUExecutionProvider")

    @property
    def uses_cuda(self) -> bool:
        """Whether the policy needs the CUDA stack (built-in CUDA/TensorRT providers): NVML, cuDNN, the driver."""
        return any(p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") for p in self.providers)


M = TypeVar("M", bound=BaseModel)


def read_toml(path: Path, what: str, hint: str = "") -> dict[str, Any]:
    """The parsed file; ConfigError when it is missing or not TOML."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} not found{hint}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None


def load_toml(path: Path, model: type[M], what: str) -> M:
    """``path`` validated as ``model``; ConfigError names the file and the problem."""
    data = read_toml(path, what)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None


SCHEDULER_NAMES: tuple[str, ...] = (
    "euler", "euler_a", "ddim", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_heun",
    *(f"{sampler}_{schedule}" for sampler in ("euler", "euler_a", "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_heun")
      for schedule in ("karras", "exponential", "uniform", "sgm_uniform")),
    "plms", "lms", "unipc", "heun",
    *(f"{sampler}_{schedule}" for sampler in ("lms", "unipc", "heun")
      for schedule in ("karras", "exponential", "uniform", "sgm_uniform")))
"""Scheduler names as the API accepts them: a sampler, then optionally a sigma schedule (DDIM and PLMS take none).
engines/numerics/schedulers.py implements each, in this order (tests/unit/test_samplers_a1111.py checks)."""


def parse_size(text: str) -> tuple[int, int]:
    """``WIDTHxHEIGHT`` with ASCII digits only -> (width, height); ValueError otherwise. The one size parser."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and 0 < len(p) <= 5 and int(p) > 0 for p in parts):
        raise ValueError(f"size {text!r} must look like 512x512")
    return int(parts[0]), int(parts[1])


# Version matrix (configs/matrix.toml)

class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OrtMatrix(_Frozen):
    version: str = "1.31.1"
    """onnxruntime-gpu version (prefix)."""
    cuda: str = "13.0"
    """CUDA major.minor the ORT build targets."""


class CudnnMatrix(_Frozen):
    major: str = "9"


class TensorrtMatrix(_Frozen):
    version: str = "10"
    """TensorRT version prefix the ORT TensorRT provider links against."""


class DriverMatrix(_Frozen):
    min_version: str = "580.65"
    """Minimum NVIDIA driver version (dotted, compared numerically)."""


class DeviceMatrix(_Frozen):
    compute_capabilities: tuple[str, ...] = ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
    count: int = Field(1, ge=1, le=64)
    """Devices this process expects to see."""


class PluginMatrix(_Frozen):
    package: str
    """pip distribution that ships the plugin EP library."""
    version: str
    """Version prefix of that package (pip metadata), which the loaded library must also report."""


class Matrix(_Frozen):
    onnxruntime: OrtMatrix = OrtMatrix()
    plugins: dict[str, PluginMatrix] = {}
    """Per plugin EP name (e.g. OpenVINOExecutionProvider): the package and version it is pinned to."""
    cudnn: CudnnMatrix = CudnnMatrix()
    tensorrt: TensorrtMatrix = TensorrtMatrix()
    driver: DriverMatrix = DriverMatrix()
    device: DeviceMatrix = DeviceMatrix()


def load_matrix(path: Path) -> Matrix:
    return load_toml(path, Matrix, "version matrix")


def version_tuple(text: str) -> tuple[int, ...]:
    """Leading digits of each dotted piece: '1.8.1+95d534b.ci.79' -> (1, 8, 1); stops at the first piece without."""
    parts = []
    for piece in text.strip().split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.group() != piece:  # a local or pre-release label ('1+95d534b', '0rc1') ends the version
            break
    return tuple(parts)


# GPU signature thresholds (the [signature] table of a profile)

class SignatureThresholds(BaseModel):
    """Thresholds of the classifier (``[signature]`` in a profile)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    busy_sm_percent: float = Field(95.0, ge=0, le=100)
    """SM utilization at or above which the card counts as fully busy."""
    livelock_max_memory_percent: float = Field(2.0, ge=0, le=100)
    """Busy SMs with the memory controller at or below this are not doing real work."""
    livelock_max_power_fraction: float = Field(0.5, gt=0, le=1)
    """...and drawing at most this fraction of the healthy working power."""
    working_power_w: float | None = Field(None, gt=0)
    """Healthy working draw of this card under this model; default: 40% of the enforced power limit."""
    idle_sm_percent: float = Field(10.0, ge=0, le=100)
    """At or below: the GPU is doing (almost) nothing."""
    memory_bound_percent: float = Field(60.0, ge=0, le=100)
    """Memory controller at or above this while SMs are below busy: memory-bound work."""


# Self-test: canaries (configs/canaries.toml: engines/canary_config.py), SLO windows (configs/slo.toml), the plan

class SloWindow(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    size: str
    batch: int = Field(..., ge=1)
    steps: int = Field(..., ge=1)
    budget_s: float = Field(..., gt=0)
    """Bound on the p95 of the timed canary batches, seconds."""
    min_gpu_util_percent: float | None = Field(None, ge=0, le=100)
    family: str | None = None
    """The model family this window judges (engines/pipelines/unet_family.py, dit_family.py); a window without one
    judges the families that have no window of their own in the profile."""


@dataclass(frozen=True)
class Shape:
    width: int
    height: int
    batch: int

    @property
    def key(self) -> str:
        return f"{self.width}x{self.height}x{self.batch}"

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


def load_canaries(path: Path) -> CanarySuite:
    return load_toml(path, CanarySuite, "canary file")


class _Windows(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    windows: tuple[SloWindow, ...] = ()


def load_slo(path: Path, profile: str) -> tuple[SloWindow, ...]:
    """The profile's array of tables in the SLO file."""
    data = read_toml(path, "SLO file")
    try:
        return _Windows.model_validate({"windows": data.get(profile, [])}).windows
    except ValidationError as exc:
        raise ConfigError(f"{path} [{profile}]: {exc}") from None


@dataclass(frozen=True)
class SelfTestPlan:
    """What the self-test runs and against what it judges."""

    suite: CanarySuite
    shapes: tuple[Shape, ...]
    slo: tuple[SloWindow, ...]
    timed_runs: int = 3
    tolerance: float = 4.0
    """Max |fingerprint difference| (pixel units) on the recording platform."""
    cross_platform_tolerance: float = 24.0
    """...and when the recording came from another platform (CPU vs GPU, fp32 vs fp16)."""
    require_fingerprints: bool = False
    fingerprints_file: str = "selftest.json"
    batch_sizes: tuple[int, ...] = (1,)
    """Used with the model's native size when ``shapes`` is empty."""
    family: str = ""
    """The loaded model's family (set by the engine after load): which SLO windows judge it."""
    max_images: int = 0
    """The most images one denoiser call can hold (``max(queue.max_batch, limits.max_n)``): the self-test runs
    one untimed canary at that batch per served size where it is larger than the size's batch sizes (row_shapes),
    and boot checks the TensorRT profiles against it (engines/health/trt_coverage.py). 0: the batch sizes only."""
    profile: str = ""
    """The settings profile's name (the rebuild command a refusal names)."""

    def row_shapes(self) -> tuple[Shape, ...]:
        """Per served size, the largest call the server forms when no batch size reaches it: a row count the
        engines cannot take fails the self-test at boot, not the first busy minute."""
        top: dict[tuple[int, int], int] = {}
        for s in self.shapes:
            top[(s.width, s.height)] = max(top.get((s.width, s.height), 0), s.batch)
        return tuple(Shape(w, h, self.max_images) for (w, h), most in top.items() if self.max_images > most)

    def windows(self) -> tuple[SloWindow, ...]:
        """The family's own windows when the profile has any, else the windows without a family."""
        own = tuple(w for w in self.slo if w.family is not None and w.family == self.family)
        return own or tuple(w for w in self.slo if w.family is None)

    def window(self, shape: Shape) -> SloWindow | None:
        return next((w for w in self.windows() if (w.size, w.batch, w.steps) == (shape.size, shape.batch,
                                                                                  self.suite.steps)), None)
