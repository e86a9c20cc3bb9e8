"""Typed, bounded, frozen runtime settings (the ``[runtime]`` table of a profile)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engines.errors import ConfigError

ProviderName = Literal["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


class CudaOptions(BaseModel):
    """CUDA execution provider options; every one is reported in the capability snapshot."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    arena_extend_strategy: Literal["kNextPowerOfTwo", "kSameAsRequested"] = "kSameAsRequested"
    """How the arena grows; kSameAsRequested avoids hoarding power-of-two blocks under varied shapes."""
    gpu_mem_limit_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Arena cap as a fraction of the device's total memory."""
    cudnn_conv_algo_search: Literal["EXHAUSTIVE", "HEURISTIC", "DEFAULT"] = "HEURISTIC"
    """Conv algorithm search; EXHAUSTIVE benchmarks every shape on first use (slow first requests)."""
    do_copy_in_default_stream: bool = True
    """Copies on the compute stream: simpler ordering, no cross-stream races."""
    enable_cuda_graph: bool = False
    """CUDA graphs for static shapes only (one graph per session); off unless shapes are fixed."""
    prefer_nhwc: bool = False
    """NHWC convolution kernels where available."""
    use_tf32: bool = True
    """TF32 math for fp32 matmul/conv on Ampere and newer."""


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


class RuntimeSettings(BaseModel):
    """How sessions are built and which providers may run them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    providers: tuple[ProviderName, ...] = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    """Execution providers in priority order. CPUExecutionProvider may appear only when allow_cpu is true."""
    allow_cpu: bool = False
    """Whether running on the CPU is acceptable (dev only). Never implied by anything else."""
    device_id: int = Field(0, ge=0, le=63)
    """CUDA device ordinal this process serves (one process per GPU)."""
    intra_op_threads: int = Field(0, ge=0, le=256)
    """ORT intra-op threads; 0 lets ONNX Runtime choose."""
    placement_audit: bool = True
    """Record per-node provider assignment and refuse sessions with non-allowlisted ops on the CPU (GPU policies)."""
    cpu_allowlist: tuple[str, ...] = ("Shape", "Reshape", "Unsqueeze", "Squeeze", "Gather", "Concat", "Slice",
                                      "Cast", "ConstantOfShape", "Constant", "Range", "Equal", "Where", "Expand",
                                      "Identity", "Size", "NonZero")
    """Shape ops allowed to stay on the CPU in a GPU session (CUDA leaves shape arithmetic on the host)."""
    disable_cpu_ep_fallback: bool = False
    """Also set session.disable_cpu_ep_fallback=1: ORT refuses any CPU node outright. Off by default because
    dynamic-shape models keep shape ops on the CPU; the placement audit is the finer check."""
    verify: Literal["full", "size", "off"] = "full"
    """Check model (and engine) files against their manifests at load: sha256 (full), sizes only, or not at all."""
    ort_log_severity: int = Field(2, ge=0, le=4)
    """ORT log level during session creation (0 verbose .. 4 fatal); captured lines are classified."""
    cuda: CudaOptions = CudaOptions()
    tensorrt: TensorrtOptions = TensorrtOptions()

    @model_validator(mode="after")
    def _check(self) -> RuntimeSettings:
        if not self.providers:
            raise ValueError("runtime.providers is empty: list at least one execution provider")
        if len(set(self.providers)) != len(self.providers):
            raise ValueError(f"runtime.providers lists a provider twice: {list(self.providers)}")
        if "CPUExecutionProvider" in self.providers and not self.allow_cpu:
            raise ValueError("runtime.providers lists CPUExecutionProvider but runtime.allow_cpu is false: "
                             "remove it, or set allow_cpu = true (dev profile only)")
        if self.providers[-1] != "CPUExecutionProvider" and "CPUExecutionProvider" in self.providers:
            raise ValueError("runtime.providers: CPUExecutionProvider must come last")
        return self

    @property
    def device(self) -> str:
        """Where IO binding places tensors: 'cuda' when a GPU provider is first, else 'cpu'."""
        return "cpu" if self.providers[0] == "CPUExecutionProvider" else "cuda"


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
