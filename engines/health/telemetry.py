"""GPU telemetry through NVML, behind a small interface so tests and the watchdog can substitute a source."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from engines.types.health import GpuSample
from engines.types.snapshot import GpuDevice, NvmlInfo


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    compute_capability: str
    memory_total_bytes: int
    memory_used_bytes: int
    pci_bus_id: str = ""
    """nvmlDeviceGetPciInfo().busId, e.g. 00000000:3B:00.0: what ties this NVML index to a CUDA ordinal."""
    mig: bool = False
    """MIG mode is on: this process computes on a slice. ``memory_total_bytes`` is then the slice's (the MIG
    device named in CUDA_VISIBLE_DEVICES), 0 when that slice is unknown, never the parent GPU's."""


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
        mig = _mig_enabled(pynvml, h)
        total = _mig_memory_total(pynvml, h, os.environ.get("CUDA_VISIBLE_DEVICES", "")) if mig else int(mem.total)
        return DeviceInfo(index, _text(pynvml.nvmlDeviceGetName(h)), f"{major}.{minor}", total,
                          int(mem.used), _text(pynvml.nvmlDeviceGetPciInfo(h).busId), mig)
    except pynvml.NVMLError as exc:
        return DeviceInfo(index, f"unavailable: {exc}", "", 0, 0, "")


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    """nvmlDeviceGetMigMode's current mode is NVML_DEVICE_MIG_ENABLE (1); a GPU without MIG answers NOT_SUPPORTED."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError:
        return False
    return bool(current == 1)


def _mig_memory_total(pynvml: Any, handle: Any, visible: str) -> int:
    """Total memory of the MIG device CUDA_VISIBLE_DEVICES names (``MIG-<uuid>``), 0 when none of the GPU's MIG
    devices is named: the parent GPU's total would overstate the slice (141 GB on an H200 cut into 18 GB ones)."""
    wanted = {v.strip() for v in visible.split(",") if v.strip().startswith("MIG-")}
    for slot in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            if _text(pynvml.nvmlDeviceGetUUID(mig)) in wanted:
                return int(pynvml.nvmlDeviceGetMemoryInfo(mig).total)
        except pynvml.NVMLError:  # an empty slot answers NOT_FOUND
            continue
    return 0


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


class TelemetryUnavailable(Exception):
    """NVML cannot give this reading for the served device (e.g. utilization under MIG: NOT_SUPPORTED), or the
    CUDA ordinal has no NVML index. Raised per sample; a sampler records it and goes on."""


class NvmlTelemetry:
    """Live samples from NVML (SM and memory-controller utilization over the driver's last sample period, power)."""

    def __init__(self, nvml_index: dict[int, int] | None = None) -> None:
        """``nvml_index``: CUDA ordinal -> NVML index (``match_cuda_to_nvml``); callers pass CUDA ordinals, and an
        ordinal without an entry is refused, never read as an NVML index (CUDA_VISIBLE_DEVICES renumbers CUDA
        ordinals, not NVML's: the same number can be another card)."""
        import pynvml

        self._nvml = pynvml
        self._index = dict(nvml_index or {})
        pynvml.nvmlInit()

    def _handle(self, device_index: int) -> Any:
        if device_index not in self._index:
            raise TelemetryUnavailable(f"CUDA ordinal {device_index} has no NVML index (matched by PCI bus id)")
        return self._nvml.nvmlDeviceGetHandleByIndex(self._index[device_index])

    def sample(self, device_index: int) -> GpuSample:
        nv = self._nvml
        h = self._handle(device_index)
        try:
            util = nv.nvmlDeviceGetUtilizationRates(h)
        except nv.NVMLError as exc:  # NOT_SUPPORTED on a MIG device: there is no per-slice utilization
            raise TelemetryUnavailable(f"NVML utilization is not available on this device: {exc}") from exc
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        return GpuSample(float(util.gpu), float(util.memory), nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                         nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, int(mem.used), int(mem.total))

    def other_processes(self, device_index: int) -> int:
        """Compute processes on the device besides this one (time-sliced or MPS neighbours). Counted as all
        listed minus one, not by our pid: inside a container NVML reports host pids, which never equal ours."""
        nv = self._nvml
        h = self._handle(device_index)
        return max(0, len(nv.nvmlDeviceGetComputeRunningProcesses(h)) - 1)

    def close(self) -> None:
        self._nvml.nvmlShutdown()

