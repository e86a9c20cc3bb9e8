"""configs/matrix.toml as a typed model, and version comparison by prefix."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from engines.config import load_toml


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


class Matrix(_Frozen):
    onnxruntime: OrtMatrix = OrtMatrix()
    cudnn: CudnnMatrix = CudnnMatrix()
    tensorrt: TensorrtMatrix = TensorrtMatrix()
    driver: DriverMatrix = DriverMatrix()
    device: DeviceMatrix = DeviceMatrix()


def load_matrix(path: Path) -> Matrix:
    return load_toml(path, Matrix, "version matrix")


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.strip().split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def matches(observed: str, prefix: str) -> bool:
    """'13.0.2' matches '13.0' and '13'; '11.0' does not match '10'."""
    want, got = version_tuple(prefix), version_tuple(observed)
    return bool(want) and got[: len(want)] == want


def at_least(observed: str, minimum: str) -> bool:
    return version_tuple(observed) >= version_tuple(minimum)
