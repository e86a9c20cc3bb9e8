"""evaluate() on observations of other machines: a TensorRT 11 install, an old driver, an unsupported GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engines.config import Matrix, RuntimeSettings
from engines.health.matrix import matches
from engines.health.preflight import Check, Observations, evaluate, failures
from engines.health.telemetry import DeviceInfo, NvmlReport
from engines.runtime.libdeps import Closure

GPU = RuntimeSettings()  # production policy: TensorRT + CUDA
BUS = "00000000:3B:00.0"


def healthy() -> Observations:
    return Observations(
        "1.31.1", "13.0", ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
        {"CUDAExecutionProvider": Closure("CUDAExecutionProvider", "libonnxruntime_providers_cuda.so",
                                          {"libcudart.so.13": "/x"}),
         "TensorrtExecutionProvider": Closure("TensorrtExecutionProvider", "libonnxruntime_providers_tensorrt.so",
                                              {"libnvinfer.so.10": "/x"})},
        NvmlReport(True, "", "580.95.05", "13.0", [DeviceInfo(0, "NVIDIA H200", "9.0", 141 << 30, 1 << 30, BUS)]),
        "9.14.0", "pip nvidia-cudnn-cu13", "10.13.3", "pip tensorrt-cu13", cuda_bus_ids=["0000:3b:00.0"])


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_node_passes_everything() -> None:
    checks = evaluate(healthy(), Matrix(), GPU)
    assert [c.name for c in checks if c.status != "pass"] == []


def test_tensorrt_11_is_named_as_a_version_mismatch() -> None:
    checks = by_name(evaluate(replace(healthy(), tensorrt_version="11.0.1", tensorrt_source="pip tensorrt"),
                              Matrix(), GPU))
    trt = checks["tensorrt_version"]
    assert trt.status == "fail" and trt.category == "version"
    assert "11.0.1" in trt.observed and trt.expected == "10.x"
    assert "tensorrt-cu13==10.*" in trt.remediation


def test_old_driver_and_unsupported_gpu() -> None:
    nvml = NvmlReport(True, "", "550.54.15", "12.4", [DeviceInfo(0, "Tesla T4", "7.5", 16 << 30, 0, BUS)])
    checks = by_name(evaluate(replace(healthy(), nvml=nvml), Matrix(), GPU))
    assert checks["driver_version"].status == "fail" and checks["driver_version"].expected == ">= 580.65"
    assert checks["cuda_driver"].status == "fail"
    assert checks["compute_capability"].status == "fail" and "7.5" in checks["compute_capability"].observed


def test_missing_library_is_a_gpu_failure_naming_library_user_and_package() -> None:
    closure = Closure("CUDAExecutionProvider", "libonnxruntime_providers_cuda.so", {},
                      {"libcublasLt.so.13": "pip nvidia-cublas (CUDA 13) or the CUDA 13 toolkit"},
                      {"libcublasLt.so.13": "libonnxruntime_providers_cuda.so"})
    obs = replace(healthy(), closures={"CUDAExecutionProvider": closure})
    gpu, versions = failures(evaluate(obs, Matrix(), GPU))
    assert versions == []
    assert "libcublasLt.so.13 (needed by libonnxruntime_providers_cuda.so; ships in pip nvidia-cublas" \
        in gpu[0].observed


def test_device_count_and_device_id() -> None:
    settings = RuntimeSettings(device_id=1)
    checks = by_name(evaluate(healthy(), Matrix(), settings))
    count = checks["device_count"]
    assert count.status == "fail" and "serving ordinal 1: no NVML match" in count.observed


def test_without_cudas_bus_ids_the_device_is_not_guessed_by_ordinal() -> None:
    """NVML index 0 is not CUDA ordinal 0 under CUDA_VISIBLE_DEVICES: no bus ids from CUDA, no device."""
    checks = by_name(evaluate(replace(healthy(), cuda_bus_ids=None), Matrix(), GPU))
    assert checks["device_count"].status == "fail" and "no NVML match" in checks["device_count"].observed
    assert "compute_capability" not in checks


def test_cpu_policy_reports_but_requires_nothing() -> None:
    obs = replace(healthy(), nvml=NvmlReport(False, "NVML did not start"), cudnn_version=None)
    checks = evaluate(obs, Matrix(), RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    assert all(c.status != "fail" for c in checks)
    assert by_name(checks)["nvml"].status == "skip"


@pytest.mark.parametrize(("observed", "prefix", "ok"), [
    ("13.0.2", "13.0", True), ("13.1", "13.0", False), ("10.13.3", "10", True), ("11.0", "10", False),
    ("9.14.0", "9", True), ("1.31.1", "1.31.1", True), ("1.30.0", "1.31.1", False),
])
def test_version_prefix_matching(observed: str, prefix: str, ok: bool) -> None:
    assert matches(observed, prefix) is ok
