"""GPU telemetry through NVML, behind a small interface so tests and the watchdog can substitute a source."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from engines.protocol import GpuDevice, GpuSample, NvmlInfo


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int


@dataclass
class NvmlReport:
    available: bool
    error: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    devices: list[DeviceInfo] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "devices": [asdict(d) for d in self.devices]}

    def to_model(self) -> NvmlInfo:
        return NvmlInfo(available=self.available, error=self.error, driver_version=self.driver_version,
                        cuda_driver_version=self.cuda_driver_version,
                        devices=tuple(GpuDevice(**asdict(d)) for d in self.devices))


def read_nvml() -> NvmlReport:
    """Driver, CUDA driver version and devices; ``available`` false with the reason when NVML cannot start."""
    try:
        import pynvml
    except ImportError as exc:  # the dependency is declared; this only guards broken installs
        return NvmlReport(False, f"nvidia-ml-py not importable: {exc}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return NvmlReport(False, f"NVML did not start: {exc} (no NVIDIA driver visible to this process)")
    try:
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        report = NvmlReport(True, "", _text(pynvml.nvmlSystemGetDriverVersion()), f"{cuda // 1000}.{cuda % 1000 // 10}")
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            report.devices.append(DeviceInfo(i, _text(pynvml.nvmlDeviceGetName(h)), f"{major}.{minor}",
                                             int(mem.total), int(mem.used)))
        return report
    except pynvml.NVMLError as exc:
        return NvmlReport(False, f"NVML query failed: {exc}")
    finally:
        pynvml.nvmlShutdown()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlTelemetry:
    """Live samples from NVML (SM and memory-controller utilization over the driver's last sample period, power)."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()

    def sample(self, device_index: int) -> GpuSample:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(device_index)
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        return GpuSample(float(util.gpu), float(util.memory), nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                         nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, int(mem.used))

    def close(self) -> None:
        self._nvml.nvmlShutdown()

