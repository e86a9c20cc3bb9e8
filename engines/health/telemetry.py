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
    pci_bus_id: str = ""
    """nvmlDeviceGetPciInfo().busId, e.g. 00000000:3B:00.0: what ties this NVML index to a CUDA ordinal."""


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
                        devices=tuple(GpuDevice(index=d.index, name=d.name, compute_capability=d.compute_capability,
                                                memory_total_bytes=d.memory_total_bytes,
                                                memory_used_bytes=d.memory_used_bytes) for d in self.devices))


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
            report.devices.append(_device(pynvml, i))
        return report
    except pynvml.NVMLError as exc:
        return NvmlReport(False, f"NVML query failed: {exc}")
    finally:
        pynvml.nvmlShutdown()


def _device(pynvml: Any, index: int) -> DeviceInfo:
    """One device's facts. A device that fails its queries (e.g. GPU_IS_LOST after an Xid on another card) is
    recorded as such, with no PCI bus id, so it never matches the served CUDA ordinal and cannot take a healthy
    served GPU's process down with it."""
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return DeviceInfo(index, _text(pynvml.nvmlDeviceGetName(h)), f"{major}.{minor}", int(mem.total),
                          int(mem.used), _text(pynvml.nvmlDeviceGetPciInfo(h).busId))
    except pynvml.NVMLError as exc:
        return DeviceInfo(index, f"unavailable: {exc}", "", 0, 0, "")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def pci_key(bus_id: str) -> tuple[int, int, int, int]:
    """(domain, bus, device, function) of a PCI bus id in either spelling: NVML's busId has an 8-digit domain
    (00000000:3B:00.0), cudaDeviceGetPCIBusId a 4-digit one (0000:3b:00.0)."""
    text = bus_id.strip().lower()
    try:
        domain, bus, rest = text.split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        raise ValueError(f"not a PCI bus id: {bus_id!r}") from None


def match_cuda_to_nvml(cuda_bus_ids: list[str], nvml_devices: list[DeviceInfo]) -> dict[int, int]:
    """CUDA ordinal -> NVML index, matched by PCI bus id. NVML numbers every device on the node; CUDA numbers only
    the visible ones, in CUDA_VISIBLE_DEVICES order (and by speed unless CUDA_DEVICE_ORDER=PCI_BUS_ID), so
    ordinal 0 can be NVML index 2. An ordinal whose bus id NVML does not list is left out."""
    by_bus = {pci_key(d.pci_bus_id): d.index for d in nvml_devices if d.pci_bus_id}
    return {ordinal: by_bus[key] for ordinal, key in enumerate(map(pci_key, cuda_bus_ids)) if key in by_bus}


class NvmlTelemetry:
    """Live samples from NVML (SM and memory-controller utilization over the driver's last sample period, power)."""

    def __init__(self, nvml_index: dict[int, int] | None = None) -> None:
        """``nvml_index``: CUDA ordinal -> NVML index (``match_cuda_to_nvml``); callers pass CUDA ordinals."""
        import pynvml

        self._nvml = pynvml
        self._index = dict(nvml_index or {})
        pynvml.nvmlInit()

    def sample(self, device_index: int) -> GpuSample:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(self._index.get(device_index, device_index))
        util = nv.nvmlDeviceGetUtilizationRates(h)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        return GpuSample(float(util.gpu), float(util.memory), nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                         nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, int(mem.used))

    def other_processes(self, device_index: int) -> int:
        """Compute processes on the device besides this one (time-sliced or MPS neighbours). Counted as all
        listed minus one, not by our pid: inside a container NVML reports host pids, which never equal ours."""
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(self._index.get(device_index, device_index))
        return max(0, len(nv.nvmlDeviceGetComputeRunningProcesses(h)) - 1)

    def close(self) -> None:
        self._nvml.nvmlShutdown()

