"""Defects found by reading the production path against ONNX Runtime's source (no GPU here), each pinned by a test:
prebuilt engines load without cache options (a read-only model mount must work), the engine-build watch covers the
per-size engine folders, NHWC is refused while the placement audit is on, cuFFT is not a hard dependency, and one
broken GPU elsewhere on the node does not take NVML down for the served one."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from pydantic import ValidationError

from engines.config import CudaOptions, RuntimeSettings
from engines.health import telemetry
from engines.runtime import enginecheck, libdeps
from engines.runtime.sessions import ENGINE_CACHE_KEYS, engine_cache_dir, loading_prebuilt, provider_options

TRT = "TensorrtExecutionProvider"


def test_prebuilt_engines_load_without_engine_or_timing_cache_options(tmp_path: Path) -> None:
    """onnx_ctx_model_helper.cc (GetEpContextFromGraph) finds the engine from the EPContext node; a cache path would
    make the provider create folders, which fails on a read-only mount."""
    trt = dict(provider_options(RuntimeSettings(), tmp_path))[TRT]
    assert set(ENGINE_CACHE_KEYS) <= set(trt)  # what a build (or a plain model) gets
    loaded = loading_prebuilt(trt)
    assert not set(ENGINE_CACHE_KEYS) & set(loaded)
    assert loaded["device_id"] == trt["device_id"] and loaded["trt_fp16_enable"] == trt["trt_fp16_enable"]


def test_the_engine_build_watch_covers_every_size_folder(tmp_path: Path) -> None:
    dirs = enginecheck.watched_dirs(engine_cache_dir(RuntimeSettings(), tmp_path))
    before = enginecheck.snapshot(dirs)
    engine = tmp_path / "trt" / "512x512" / "engines" / "unet.engine"  # where `engines build` writes (per size)
    engine.parent.mkdir(parents=True)
    engine.write_bytes(b"built on the node")
    events = enginecheck.cache_events(before, enginecheck.snapshot(dirs), "first run")
    assert [e.kind for e in events] == ["engine_rebuild"] and "unet.engine" in events[0].line


def test_nhwc_is_refused_while_the_placement_audit_is_on() -> None:
    with pytest.raises(ValidationError, match="prefer_nhwc"):
        RuntimeSettings(cuda=CudaOptions(prefer_nhwc=True))
    assert RuntimeSettings(cuda=CudaOptions(prefer_nhwc=True), placement_audit=False).cuda.prefer_nhwc


def test_cufft_is_not_a_hard_dependency_of_the_cuda_provider() -> None:
    assert "libcudnn.so.9" in libdeps.DLOPENED["CUDAExecutionProvider"]
    assert not any(name.startswith("libcufft") for name in libdeps.DLOPENED["CUDAExecutionProvider"])


class _NvmlError(Exception):
    pass


def _fake_pynvml(broken: int) -> types.SimpleNamespace:
    """NVML with two devices, one of which fails every query (GPU_IS_LOST)."""
    def handle(index: int) -> int:
        if index == broken:
            raise _NvmlError("GPU is lost")
        return index

    pci = types.SimpleNamespace(busId=b"00000000:3B:00.0")
    mem = types.SimpleNamespace(total=80 << 30, used=1 << 30)
    return types.SimpleNamespace(
        NVMLError=_NvmlError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetCudaDriverVersion_v2=lambda: 13000, nvmlSystemGetDriverVersion=lambda: b"580.65.06",
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0), nvmlDeviceGetMemoryInfo=lambda h: mem,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200", nvmlDeviceGetPciInfo=lambda h: pci)


def test_one_lost_gpu_does_not_make_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(broken=1))
    report = telemetry.read_nvml()
    assert report.available and report.driver_version == "580.65.06"
    healthy, lost = report.devices
    assert healthy.name == "NVIDIA H200" and healthy.pci_bus_id == "00000000:3B:00.0"
    assert lost.name.startswith("unavailable: GPU is lost") and lost.pci_bus_id == ""
