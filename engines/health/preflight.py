"""Preflight: what the fast path needs, checked before any model loads, compared with configs/matrix.toml.

``gather()`` reads the machine (ORT build, provider library closures, NVML, cuDNN and TensorRT versions);
``evaluate()`` is a pure function from those observations, the matrix and the policy to a list of checks.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import onnxruntime as ort

from engines.config import Matrix, RuntimeSettings
from engines.health.matrix import at_least, matches
from engines.health.telemetry import DeviceInfo, NvmlReport, match_cuda_to_nvml, read_nvml
from engines.protocol import CheckResult, FoundVersion, LibraryClosure
from engines.protocol import Observations as ProtocolObservations
from engines.runtime.libdeps import PROVIDER_LIBRARIES, Closure, provider_closure, resolve
from engines.runtime.pinned import cuda_pci_bus_ids

Status = Literal["pass", "fail", "skip"]
Category = Literal["gpu", "version"]


@dataclass(frozen=True)
class Check:
    name: str
    category: Category
    status: Status
    observed: str
    expected: str
    remediation: str = ""

    def to_model(self) -> CheckResult:
        return CheckResult(**asdict(self))


@dataclass
class Observations:
    ort_version: str
    ort_cuda_version: str
    available_providers: list[str]
    closures: dict[str, Closure]
    nvml: NvmlReport
    cudnn_version: str | None
    cudnn_source: str = ""
    tensorrt_version: str | None = None
    tensorrt_source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    cuda_bus_ids: list[str] | None = None
    """PCI bus id per CUDA ordinal (this process's numbering); None when the CUDA runtime could not be asked."""

    def nvml_index(self, device_id: int) -> int | None:
        """NVML index of CUDA ordinal ``device_id``, matched by PCI bus id (CUDA_VISIBLE_DEVICES renumbers CUDA
        ordinals, never NVML's); without CUDA's answer, the same number if NVML lists it."""
        if self.cuda_bus_ids is None:
            return device_id if device_id < len(self.nvml.devices) else None
        return match_cuda_to_nvml(self.cuda_bus_ids, self.nvml.devices).get(device_id)

    def device(self, device_id: int) -> DeviceInfo | None:
        index = self.nvml_index(device_id)
        return next((d for d in self.nvml.devices if d.index == index), None)

    def memory_total(self, device_id: int) -> int | None:
        """Total memory of the served device (bytes) as NVML reports it; None without NVML or a match."""
        device = self.device(device_id)
        return device.memory_total_bytes if device is not None else None

    def to_model(self) -> ProtocolObservations:
        return ProtocolObservations(
            onnxruntime=self.ort_version, onnxruntime_cuda_build=self.ort_cuda_version,
            available_providers=tuple(self.available_providers),
            provider_libraries={p: LibraryClosure(library=c.library, missing=dict(c.missing),
                                                  resolved=dict(c.resolved)) for p, c in self.closures.items()},
            nvml=self.nvml.to_model(), cudnn=FoundVersion(version=self.cudnn_version, source=self.cudnn_source),
            tensorrt=FoundVersion(version=self.tensorrt_version, source=self.tensorrt_source))


def _dist_version(names: tuple[str, ...]) -> tuple[str | None, str]:
    for name in names:
        try:
            return metadata.version(name), f"pip {name}"
        except metadata.PackageNotFoundError:
            continue
    return None, ""


def _lib_version(soname: str) -> tuple[str | None, str]:
    """Version from the resolved file's real name (libnvinfer.so.10.13.0 -> 10.13.0)."""
    found = resolve(soname)
    if found is None:
        return None, ""
    real = Path(found).resolve().name
    match = re.search(r"\.so\.(\d+(?:\.\d+)*)$", real)
    return (match.group(1) if match else soname.rsplit(".so.", 1)[-1]), found


def gather() -> Observations:
    from onnxruntime.capi import build_and_package_info

    capi = Path(ort.__file__).parent / "capi"
    closures = {p: provider_closure(p, capi) for p in PROVIDER_LIBRARIES if (capi / PROVIDER_LIBRARIES[p]).exists()}
    cudnn, cudnn_src = _dist_version(("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"))
    if cudnn is None:
        cudnn, cudnn_src = _lib_version("libcudnn.so.9")
    trt, trt_src = _dist_version(("tensorrt", "tensorrt-cu13", "tensorrt-cu13-libs", "tensorrt-libs"))
    if trt is None:
        trt, trt_src = _lib_version("libnvinfer.so.10")
    nvml = read_nvml()
    return Observations(ort.__version__, str(getattr(build_and_package_info, "cuda_version", "")),
                        list(ort.get_available_providers()), closures, nvml, cudnn, cudnn_src, trt, trt_src,
                        cuda_bus_ids=cuda_pci_bus_ids() if nvml.available else None)


def _versions(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    m = matrix
    checks = [
        Check("onnxruntime_version", "version", "pass" if matches(obs.ort_version, m.onnxruntime.version) else "fail",
              obs.ort_version, m.onnxruntime.version, f"pip install onnxruntime-gpu=={m.onnxruntime.version}"),
        Check("onnxruntime_cuda_build", "version",
              "pass" if matches(obs.ort_cuda_version, m.onnxruntime.cuda) else "fail", obs.ort_cuda_version or "none",
              m.onnxruntime.cuda, "install the onnxruntime-gpu build for the matrix's CUDA"),
    ]
    if obs.cudnn_version is None:
        checks.append(Check("cudnn_version", "gpu", "fail", f"not found ({obs.cudnn_source or 'no libcudnn.so.9'})",
                            f"{m.cudnn.major}.x", "pip install 'onnxruntime-gpu[cuda,cudnn]' (nvidia-cudnn-cu13)"))
    else:
        ok = matches(obs.cudnn_version, m.cudnn.major)
        checks.append(Check("cudnn_version", "version", "pass" if ok else "fail",
                            f"{obs.cudnn_version} ({obs.cudnn_source})", f"{m.cudnn.major}.x",
                            f"install cuDNN {m.cudnn.major} for CUDA {m.onnxruntime.cuda}"))
    if "TensorrtExecutionProvider" not in settings.providers:
        checks.append(Check("tensorrt_version", "version", "skip", obs.tensorrt_version or "not found",
                            m.tensorrt.version, "TensorRT is not in the provider policy"))
    elif obs.tensorrt_version is None:
        checks.append(Check("tensorrt_version", "gpu", "fail", "not found", f"{m.tensorrt.version}.x",
                            "pip install 'tensorrt-cu13==10.*' (not plain `tensorrt`: that is 11.x)"))
    else:
        ok = matches(obs.tensorrt_version, m.tensorrt.version)
        checks.append(Check("tensorrt_version", "version", "pass" if ok else "fail",
                            f"{obs.tensorrt_version} ({obs.tensorrt_source})", f"{m.tensorrt.version}.x",
                            f"TensorRT {obs.tensorrt_version} cannot load in ORT {obs.ort_version}'s provider; "
                            f"pip install 'tensorrt-cu13=={m.tensorrt.version}.*'"))
    return checks


def _providers(obs: Observations, settings: RuntimeSettings) -> list[Check]:
    checks = []
    for provider in settings.providers:
        if provider == "CPUExecutionProvider":
            continue
        compiled = provider in obs.available_providers
        checks.append(Check(f"provider_compiled:{provider}", "gpu", "pass" if compiled else "fail",
                            ", ".join(obs.available_providers), provider, "install onnxruntime-gpu, not onnxruntime"))
        closure = obs.closures.get(provider)
        if closure is None:
            continue
        missing = "; ".join(f"{lib} (needed by {closure.needed_by.get(lib, '?')}; ships in {pkg})"
                            for lib, pkg in closure.missing.items())
        checks.append(Check(f"provider_libraries:{provider}", "gpu", "fail" if closure.missing else "pass",
                            f"missing: {missing}" if missing else f"{len(closure.resolved)} libraries resolve",
                            "every dependency of " + Path(closure.library).name + " resolves",
                            "install the packages named (the server preloads the pip nvidia-* and TensorRT wheels as "
                            "onnxruntime.preload_dlls() does), or set LD_LIBRARY_PATH"))
    return checks


def _device(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    nv, m = obs.nvml, matrix
    if not nv.available:
        return [Check("nvml", "gpu", "fail", nv.error, "NVIDIA driver and device visible",
                      "run on a GPU node; in containers use the NVIDIA container toolkit (--gpus / nvidia.com/gpu)")]
    checks = [Check("nvml", "gpu", "pass", f"driver {nv.driver_version}", "NVIDIA driver and device visible")]
    count = len(nv.devices) if obs.cuda_bus_ids is None else len(obs.cuda_bus_ids)
    device = obs.device(settings.device_id)
    where = f"NVML index {device.index} ({device.pci_bus_id or 'bus id unknown'})" if device else "no NVML match"
    checks.append(Check("device_count", "gpu", "pass" if count >= m.device.count and device is not None
                        else "fail", f"{count} CUDA device(s), serving ordinal {settings.device_id}: {where}",
                        f">= {m.device.count} device(s)", "check CUDA_VISIBLE_DEVICES and --device-id"))
    checks.append(Check("driver_version", "version", "pass" if at_least(nv.driver_version, m.driver.min_version)
                        else "fail", nv.driver_version, f">= {m.driver.min_version}",
                        f"upgrade the NVIDIA driver to {m.driver.min_version} or newer"))
    checks.append(Check("cuda_driver", "version", "pass" if at_least(nv.cuda_driver_version, m.onnxruntime.cuda)
                        else "fail", nv.cuda_driver_version, f">= {m.onnxruntime.cuda}",
                        "the driver must support the CUDA version ORT was built for"))
    if device is not None:
        checks.append(Check("compute_capability", "gpu", "pass" if device.compute_capability in
                            m.device.compute_capabilities else "fail", f"{device.name} sm {device.compute_capability}",
                            ", ".join(m.device.compute_capabilities), "schedule onto a supported GPU"))
    return checks


def evaluate(obs: Observations, matrix: Matrix, settings: RuntimeSettings) -> list[Check]:
    """All checks. With a CPU-only policy they are reported but skipped (nothing GPU is required)."""
    checks = [*_versions(obs, matrix, settings), *_providers(obs, settings), *_device(obs, matrix, settings)]
    if settings.device == "cpu":
        return [Check(c.name, c.category, "skip" if c.status == "fail" else c.status, c.observed, c.expected,
                      "not required: the profile runs on the CPU") if c.status == "fail" else c for c in checks]
    return checks


def failures(checks: list[Check]) -> tuple[list[Check], list[Check]]:
    """(gpu-path failures, version-matrix failures)."""
    failed = [c for c in checks if c.status == "fail"]
    return [c for c in failed if c.category == "gpu"], [c for c in failed if c.category == "version"]
