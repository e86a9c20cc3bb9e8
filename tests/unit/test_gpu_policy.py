"""The GPU policy's pure parts, each against the bug it closes: TensorRT vanishing behind CUDA, the arena cap never
applied, NVML and CUDA numbering devices differently, pinned memory on the wrong card, CUDA graphs accepted."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from engines.config import Matrix, RuntimeSettings
from engines.engine import OrtEngine
from engines.errors import GpuUnavailableError
from engines.health import preflight
from engines.health.preflight import Observations
from engines.health.telemetry import DeviceInfo, NvmlReport, match_cuda_to_nvml, pci_key
from engines.runtime.libdeps import Closure
from engines.runtime.ortlog import classify
from engines.runtime.pinned import PinnedAllocator, cuda_pci_bus_ids
from engines.runtime.sessions import SessionReport, enforce, provider_options, session_providers

DATA = Path(__file__).parent.parent / "data" / "ort_logs"
TRT_CUDA = RuntimeSettings()  # production policy
CUDA_ONLY = RuntimeSettings(providers=("CUDAExecutionProvider",))


# 2. TensorRT cannot vanish silently

def _trt_failed_report() -> SessionReport:
    """TensorRT failed to create, ORT went on with CUDA. The log is assembled from lines of the real 1.31.1 format:
    the provider_bridge_ort.cc library line as captured in trt_cuda_enable_fallback_0.txt (library: libnvinfer),
    and the WARNING that CreateExecutionProviderFactoryInstance (onnxruntime/python/onnxruntime_pybind_state.cc)
    logs before returning no factory; its text is the strings "Failed to create ", ". Please reference ",
    "https://onnxruntime.ai/docs/execution-providers/", "TensorRT-ExecutionProvider.html#requirements to ensure all
    dependencies are met." of the installed onnxruntime_pybind11_state binary. No GPU here to print it for real."""
    lines = (DATA / "trt_provider_creation_failed_assembled.txt").read_text().splitlines()
    return SessionReport("unet", ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
                         ["CUDAExecutionProvider", "CPUExecutionProvider"], classify(lines), lines)


def test_tensorrt_missing_from_get_providers_is_fatal_naming_the_library() -> None:
    report = _trt_failed_report()
    assert ("provider_creation_failed", "TensorrtExecutionProvider") in [(e.kind, e.detail) for e in report.events]
    # The old check (first provider used is somewhere in the policy) accepted this session: CUDA is in the policy.
    assert report.providers_used[0] in report.providers_requested
    with pytest.raises(GpuUnavailableError) as info:
        enforce(report, TRT_CUDA)
    message = str(info.value)
    assert "TensorrtExecutionProvider missing" in message and "libnvinfer.so.10" in message


def test_a_provider_creation_failure_line_is_fatal_even_with_every_provider_listed() -> None:
    line = ("[W:onnxruntime:Default, onnxruntime_pybind_state.cc:1295 CreateExecutionProviderFactoryInstance] "
            "Failed to create TensorrtExecutionProvider. Please reference https://onnxruntime.ai/docs/"
            "execution-providers/TensorRT-ExecutionProvider.html#requirements to ensure all dependencies are met.")
    report = SessionReport("vae_decoder", ["CUDAExecutionProvider"], ["CUDAExecutionProvider", "CPUExecutionProvider"],
                           classify([line]))
    with pytest.raises(GpuUnavailableError, match="Failed to create TensorrtExecutionProvider. Please reference"):
        enforce(report, CUDA_ONLY)


def test_a_healthy_report_passes_and_dev_accepts_anything() -> None:
    enforce(SessionReport("unet", ["TensorrtExecutionProvider", "CUDAExecutionProvider"],
                          ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]), TRT_CUDA)
    enforce(_trt_failed_report(), RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))


# 3. The scheduler step is pinned to CUDA

def test_in_process_graphs_exclude_tensorrt_under_a_tensorrt_policy() -> None:
    step = session_providers(TRT_CUDA, True, Path("/models/m"), 80 << 30)
    assert [p for p, _ in step] == ["CUDAExecutionProvider"]
    assert step[0][1] == dict(provider_options(TRT_CUDA, Path("/models/m"), 80 << 30))["CUDAExecutionProvider"]
    assert [p for p, _ in session_providers(TRT_CUDA, False)] == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    trt_only = RuntimeSettings(providers=("TensorrtExecutionProvider",))
    assert [p for p, _ in session_providers(trt_only, True)] == ["CUDAExecutionProvider"]


# 4. gpu_mem_limit_fraction applied from preflight's NVML total

def test_gpu_mem_limit_is_the_fraction_of_the_device_total() -> None:
    settings = RuntimeSettings(cuda={"gpu_mem_limit_fraction": 0.5})
    cuda = dict(provider_options(settings, None, 80 << 30))["CUDAExecutionProvider"]
    assert cuda["gpu_mem_limit"] == str(40 << 30)
    assert "gpu_mem_limit" not in dict(provider_options(settings))["CUDAExecutionProvider"]


def _observations(devices: list[DeviceInfo], cuda_bus_ids: list[str] | None) -> Observations:
    closures = {p: Closure(p, f"lib{p}.so", {"libcudart.so.13": "/x"})
                for p in ("CUDAExecutionProvider", "TensorrtExecutionProvider")}
    return Observations("1.31.1", "13.0", ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                                            "CPUExecutionProvider"], closures,
                        NvmlReport(True, "", "580.95.05", "13.0", devices), "9.14.0", "pip nvidia-cudnn-cu13",
                        "10.13.3", "pip tensorrt-cu13", cuda_bus_ids=cuda_bus_ids)


H200_A = DeviceInfo(0, "NVIDIA H200", "9.0", 141 << 30, 0, "00000000:19:00.0")
H200_B = DeviceInfo(1, "NVIDIA H200", "9.0", 80 << 30, 0, "00000000:3B:00.0")


def test_snapshot_reports_the_effective_byte_limit_from_the_observed_total(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    observed = _observations([H200_A, H200_B], ["0000:3b:00.0"])  # CUDA_VISIBLE_DEVICES=1: ordinal 0 is NVML 1
    monkeypatch.setattr("engines.engine.gather", lambda: observed)
    monkeypatch.setattr("engines.engine.preload", lambda tensorrt: [])
    engine = OrtEngine(tmp_path, CUDA_ONLY)
    engine.preflight()
    snapshot = engine.capabilities()
    limit = int((80 << 30) * 0.9)
    assert snapshot.provider_options["CUDAExecutionProvider"]["gpu_mem_limit"] == str(limit)
    assert snapshot.arena["gpu_mem_limit_bytes"] == limit and snapshot.arena["gpu_mem_limit_fraction"] == 0.9


# 10. Device identity

def test_pci_bus_ids_match_across_nvml_and_cuda_spellings() -> None:
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00.0") == (0, 0x3B, 0, 0)
    with pytest.raises(ValueError, match="not a PCI bus id"):
        pci_key("GPU-1234")


def test_cuda_ordinals_map_to_nvml_indices_by_bus_id_not_by_number() -> None:
    third = DeviceInfo(2, "NVIDIA H200", "9.0", 141 << 30, 0, "00000000:5D:00.0")
    # CUDA_VISIBLE_DEVICES=2,0: CUDA ordinal 0 is NVML index 2, ordinal 1 is NVML index 0.
    assert match_cuda_to_nvml(["0000:5d:00.0", "0000:19:00.0"], [H200_A, H200_B, third]) == {0: 2, 1: 0}
    assert match_cuda_to_nvml(["0000:99:00.0"], [H200_A]) == {}


def test_preflight_judges_the_device_cuda_serves_not_the_nvml_index_of_the_same_number() -> None:
    t4 = DeviceInfo(0, "Tesla T4", "7.5", 16 << 30, 0, "00000000:19:00.0")
    obs = _observations([t4, H200_B], ["0000:3b:00.0"])
    checks = {c.name: c for c in preflight.evaluate(obs, Matrix(), CUDA_ONLY)}
    assert checks["compute_capability"].status == "pass" and "H200" in checks["compute_capability"].observed
    assert "NVML index 1" in checks["device_count"].observed
    assert obs.memory_total(0) == 80 << 30
    unmatched = replace(obs, cuda_bus_ids=["0000:99:00.0"])
    assert {c.name: c for c in preflight.evaluate(unmatched, Matrix(), CUDA_ONLY)}[
        "device_count"].status == "fail"


class _Cudart:
    """Records the CUDA runtime calls made through ctypes (unit test stand-in for libcudart)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self._memory: list[ctypes.Array[ctypes.c_byte]] = []
        for name in ("cudaSetDevice", "cudaHostAlloc", "cudaFreeHost", "cudaGetDeviceCount", "cudaDeviceGetPCIBusId"):
            setattr(self, name, _Call(self, name))


class _Call:
    def __init__(self, lib: _Cudart, name: str) -> None:
        self.lib, self.name = lib, name
        self.argtypes: list[Any] = []
        self.restype: Any = None

    def __call__(self, *args: Any) -> int:
        self.lib.calls.append((self.name, args[0] if self.name == "cudaSetDevice" else None))
        if self.name == "cudaHostAlloc":
            block = (ctypes.c_byte * int(args[1]))()
            self.lib._memory.append(block)
            ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = ctypes.addressof(block)
        elif self.name == "cudaGetDeviceCount":
            ctypes.cast(args[0], ctypes.POINTER(ctypes.c_int))[0] = 2
        elif self.name == "cudaDeviceGetPCIBusId":
            args[0].value = [b"0000:3B:00.0", b"0000:19:00.0"][args[2]]
        return 0


def test_pinned_allocation_sets_the_served_device_before_every_cuda_call() -> None:
    lib = _Cudart()
    host = PinnedAllocator(device_id=1, cudart=lib)
    array = host.empty((2, 3), np.float32)
    host.free(array)
    host.empty((4,), np.float32)
    host.close()
    names = [name for name, _ in lib.calls]
    assert names == ["cudaSetDevice", "cudaHostAlloc", "cudaSetDevice", "cudaFreeHost", "cudaSetDevice",
                     "cudaHostAlloc", "cudaSetDevice", "cudaFreeHost"]
    assert all(device == 1 for name, device in lib.calls if name == "cudaSetDevice")


def test_cuda_bus_ids_are_read_per_ordinal() -> None:
    assert cuda_pci_bus_ids(_Cudart()) == ["0000:3B:00.0", "0000:19:00.0"]


# 12. CUDA graphs refused at validation

def test_cuda_graphs_are_refused_with_the_reason() -> None:
    with pytest.raises(ValidationError) as info:
        RuntimeSettings(cuda={"enable_cuda_graph": True})
    message = str(info.value)
    assert "gpu_graph_id" in message and "same device address" in message and "vary per request" in message
    assert RuntimeSettings(cuda={"enable_cuda_graph": False}).cuda.enable_cuda_graph is False
