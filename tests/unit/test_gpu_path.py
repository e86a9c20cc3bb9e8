"""Defects found by reading the production path against ONNX Runtime's source (no GPU here), each pinned by a test:
prebuilt engines load without cache options (a read-only model mount must work), the engine-build watch covers the
per-size engine folders, NHWC is refused while the placement audit is on, cuFFT is not a hard dependency, and one
broken GPU elsewhere on the node does not take NVML down for the served one."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

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

    def no_mig(handle: int) -> tuple[int, int]:
        raise _NvmlError("Not Supported")  # what a GPU without MIG answers

    pci = types.SimpleNamespace(busId=b"00000000:3B:00.0")
    mem = types.SimpleNamespace(total=80 << 30, used=1 << 30)
    return types.SimpleNamespace(
        NVMLError=_NvmlError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetCudaDriverVersion_v2=lambda: 13000, nvmlSystemGetDriverVersion=lambda: b"580.65.06",
        nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0), nvmlDeviceGetMemoryInfo=lambda h: mem,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200", nvmlDeviceGetPciInfo=lambda h: pci, nvmlDeviceGetMigMode=no_mig)


def test_one_lost_gpu_does_not_make_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(broken=1))
    report = telemetry.read_nvml()
    assert report.available and report.driver_version == "580.65.06"
    healthy, lost = report.devices
    assert healthy.name == "NVIDIA H200" and healthy.pci_bus_id == "00000000:3B:00.0"
    assert lost.name.startswith("unavailable: GPU is lost") and lost.pci_bus_id == ""


# --- the fourth review (issue 27): each decision that only a GPU would otherwise show --------------------------


def test_cuda_pointer_attributes_has_cuda_13s_size() -> None:
    """driver_types.h (CUDA 13): type, device, devicePointer, hostPointer, then long reserved[8]: 4 + 4 + 8 + 8 +
    64 bytes. The 24-byte struct of CUDA <= 12's documentation lets cudaPointerGetAttributes write 64 bytes past it."""
    import ctypes

    from engines.runtime.pinned import CudaPointerAttributes

    assert ctypes.sizeof(CudaPointerAttributes) == 88
    assert CudaPointerAttributes.reserved.offset == 24 and CudaPointerAttributes.type.offset == 0


def test_the_pinned_check_passes_the_whole_struct_to_the_runtime() -> None:
    import ctypes

    from engines.runtime.pinned import CudaPointerAttributes, memory_type

    class Cudart:
        class cudaPointerGetAttributes:  # noqa: N801 - the C symbol's name
            argtypes: object = None
            restype: object = None

            def __new__(cls, attributes: Any, address: Any) -> int:  # type: ignore[misc]
                struct = ctypes.cast(attributes, ctypes.POINTER(CudaPointerAttributes)).contents
                ctypes.memset(ctypes.addressof(struct), 0, 88)  # what CUDA 13 writes: the reserved words too
                struct.type = 1
                return 0

    assert memory_type(Cudart(), 0x1000) == 1


def _dims() -> dict[str, int | None]:
    return {"tokens": 77, "unet_channels": 4, "latent_channels": 4, "hidden": 768, "pooled": None, "time_ids": 6,
            "image_channels": 3, "factor": 8}


def test_an_sdxl_vae_is_never_built_fp16(tmp_path: Path) -> None:
    """TensorRT's fp16 flag applies to every component; the ONNX dtype of an fp32 VAE does not stop it."""
    import json

    from engines.build import trtplan

    vae = tmp_path / "vae_decoder"
    for part in ("vae_decoder", "text_encoder", "text_encoder_2", "unet"):
        (tmp_path / part).mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"addition_embed_type": "text_time"}))
    index = {"_class_name": "StableDiffusionXLPipeline"}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (vae / "config.json").write_text(json.dumps({"force_upcast": True}))
    sdxl = trtplan.fp32_components(tmp_path)
    (vae / "config.json").write_text(json.dumps({"force_upcast": False}))
    fixed = trtplan.fp32_components(tmp_path)
    assert "vae_decoder" in sdxl and "vae_encoder" in sdxl and fixed == ()
    flags = trtplan.BuildFlags(fp16=True)
    profile = trtplan.ShapeProfile(1024, 1024, 1, 1, 1)
    inputs = {"latent_sample": ["b", 4, "h", "w"]}
    assert trtplan._options("vae_decoder", inputs, _dims(), profile, flags, 0, fp32=True)["trt_fp16_enable"] == "False"
    assert trtplan._options("vae_decoder", inputs, _dims(), profile, flags, 0)["trt_fp16_enable"] == "True"


def test_a_vae_session_on_tensorrt_fp16_is_recognised(tmp_path: Path) -> None:
    from engines.pipelines.ort_model import tensorrt_fp16

    class Session:
        def __init__(self, options: dict[str, dict[str, str]]) -> None:
            self.options = options

        def get_provider_options(self) -> dict[str, dict[str, str]]:
            return self.options

    assert tensorrt_fp16(Session({TRT: {"trt_fp16_enable": "1"}}))  # type: ignore[arg-type]
    assert not tensorrt_fp16(Session({TRT: {"trt_fp16_enable": "0"}}))  # type: ignore[arg-type]
    assert not tensorrt_fp16(Session({"CUDAExecutionProvider": {}}))  # type: ignore[arg-type]


def test_a_failed_prebuilt_load_is_exit_23_only_for_an_artifact_fault() -> None:
    from engines.errors import ArtifactError, GpuUnavailableError
    from engines.runtime.sessions import classify_load_failure, prebuilt_load_error

    cases = {
        "TensorRT EP could not deserialize engine from cache: trt/512x512/engines/a.engine": "artifact mismatch",
        "TensorRT EP can't find engine cache: trt/engines/a.engine. Please make sure": "artifact mismatch",
        "[ONNXRuntimeError] : 10 : INVALID_GRAPH : [OpenVINO-EP] plugin/ov_bin_manager.cc:36 - Blob not found for "
        "unet_ctx_OpenVINOExecutionProvider_OpenVINO-EP-subgraph_3_0": "artifact mismatch",  # seen here: a stale blob
        "CUDA failure 2: out of memory ; GPU=0": "the GPU is out of memory",
        "Failed to allocate memory for requested buffer of size 4294967296": "the GPU is out of memory",
        "CUDA failure 35: CUDA driver version is insufficient for CUDA runtime version": "the NVIDIA driver refused",
        "Failed to load library libonnxruntime_providers_tensorrt.so with error: libnvonnxparser.so.10: cannot "
        "open shared object file": "a provider library is missing",
        "some new message": "unclassified",
    }
    assert {text: classify_load_failure(text) for text in cases} == cases
    model = Path("trt/512x512/unet_ctx.onnx")
    for text in list(cases)[:3]:
        assert isinstance(prebuilt_load_error("unet", [TRT], model, text), ArtifactError)
    for text, reason in list(cases.items())[3:]:
        error = prebuilt_load_error("unet", [TRT], model, text)
        assert type(error) is GpuUnavailableError and "artifact mismatch" not in str(error), reason


def test_cuda_only_fusions_of_unsupported_widths_are_found() -> None:
    """bias_add.cc takes C in {320, 640, 1280}; bias_split_gelu.cc hidden in {2560, 5120, 10240}."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from engines.build.optimize import unsupported_widths

    def graph(add: int, gelu: int) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.zeros(add, np.float32), "add_bias"),
                 numpy_helper.from_array(np.zeros(gelu, np.float32), "gelu_bias")]
        nodes = [helper.make_node("BiasAdd", ["x", "add_bias", "skip"], ["y"], domain="com.microsoft"),
                 helper.make_node("BiasSplitGelu", ["h", "gelu_bias"], ["g"], domain="com.microsoft"),
                 helper.make_node("BiasSplitGelu", ["h", "dynamic_bias"], ["g2"], domain="com.microsoft")]
        value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        return helper.make_model(helper.make_graph(nodes, "g", [value], [value], inits))

    assert unsupported_widths(graph(320, 2560)) == {"BiasSplitGelu": [-1]}  # a bias that is not a constant
    assert unsupported_widths(graph(32, 512)) == {"BiasAdd": [32], "BiasSplitGelu": [-1, 512]}


def test_clip_attention_with_its_causal_bias_at_77_tokens_is_named_unfused_on_cuda() -> None:
    """multihead_attention.cc: flash/cuDNN/fused runners need no attention_bias; memory-efficient needs
    S % (4 * sizeof(T)) == 0 with one."""
    from engines.build.optimize import cuda_attention_kernel

    assert cuda_attention_kernel(77, True, fp16=True).startswith("unfused on CUDA")
    assert cuda_attention_kernel(77, True, fp16=False).startswith("unfused on CUDA")
    assert cuda_attention_kernel(72, True, fp16=True).startswith("memory-efficient")  # 72 % 8 == 0
    assert cuda_attention_kernel(72, True, fp16=False).startswith("unfused")  # 72 % 16 != 0
    assert cuda_attention_kernel(4096, False, fp16=True).startswith("fused")


# --- NVML: never the CUDA ordinal as an NVML index; MIG slices ----------------------------------------------------


def test_without_cudas_bus_ids_no_nvml_device_is_guessed() -> None:
    from engines.health.preflight import Observations
    from engines.health.telemetry import DeviceInfo, NvmlReport

    nvml = NvmlReport(True, devices=[telemetry.DeviceInfo(0, "NVIDIA H200", "9.0", 141 << 30, 0,
                                                          "00000000:3B:00.0")])
    obs = Observations("1.31.1", "13.0", [], {}, nvml, "9.10")
    assert obs.nvml_index(0) is None and obs.device(0) is None and obs.memory_total(0) is None
    sliced = NvmlReport(True, devices=[DeviceInfo(0, "NVIDIA H200", "9.0", 0, 0, "00000000:3B:00.0", mig=True)])
    mig = Observations("1.31.1", "13.0", [], {}, sliced, "9.10", cuda_bus_ids=["0000:3b:00.0"])
    assert mig.nvml_index(0) == 0 and mig.memory_total(0) is None  # never the parent GPU's 141 GB


def _mig_pynvml(util_supported: bool) -> types.SimpleNamespace:
    nv = _fake_pynvml(broken=-1)
    slices = {0: "MIG-aaaa", 1: "MIG-bbbb"}

    def mig_handle(handle: int, slot: int) -> str:
        if slot not in slices:
            raise _NvmlError("Not Found")
        return slices[slot]

    def memory(handle: object) -> types.SimpleNamespace:
        total = {"MIG-aaaa": 18 << 30, "MIG-bbbb": 35 << 30}.get(str(handle), 141 << 30)
        return types.SimpleNamespace(total=total, used=1 << 30)

    def utilization(handle: object) -> types.SimpleNamespace:
        if not util_supported:
            raise _NvmlError("Not Supported")
        return types.SimpleNamespace(gpu=90, memory=40)

    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetMigMode = lambda h: (1, 1)
    nv.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    nv.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    nv.nvmlDeviceGetUUID = lambda h: h
    nv.nvmlDeviceGetMemoryInfo = memory
    nv.nvmlDeviceGetUtilizationRates = utilization
    nv.nvmlDeviceGetPowerUsage = lambda h: 300_000
    nv.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    return nv


def test_under_mig_memory_total_is_the_visible_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _mig_pynvml(util_supported=False))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-bbbb")
    device = telemetry.read_nvml().devices[0]
    assert device.mig and device.memory_total_bytes == 35 << 30
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert telemetry.read_nvml().devices[0].memory_total_bytes == 0  # unknown slice: not the parent's 141 GB


def test_telemetry_refuses_unmapped_ordinals_and_unsupported_utilization(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", _mig_pynvml(util_supported=False))
    with pytest.raises(telemetry.TelemetryUnavailable, match="no NVML index"):
        telemetry.NvmlTelemetry().sample(0)
    with pytest.raises(telemetry.TelemetryUnavailable, match="utilization is not available.*Not Supported"):
        telemetry.NvmlTelemetry({0: 0}).sample(0)
    monkeypatch.setitem(sys.modules, "pynvml", _mig_pynvml(util_supported=True))
    assert telemetry.NvmlTelemetry({0: 0}).sample(0).sm_percent == 90.0


def test_with_real_onnxruntime_a_tensorrt_build_here_is_refused_as_gpu_unavailable(tmp_path: Path) -> None:
    """This machine has no TensorRT: the build is a GPU-path refusal (exit 20), never "TensorRT wrote no EP-context
    model" (exit 23); and a real CPU session never passes as a TensorRT build."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from engines.build import trt_build
    from engines.errors import GpuUnavailableError

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [value],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    (tmp_path / "unet").mkdir()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.save(model, str(tmp_path / "unet" / "model.onnx"))
    spec = {"source": "unet/model.onnx", "provider_options": {"trt_ep_context_file_path": "trt/64x64/unet_ctx.onnx",
                                                              "trt_engine_cache_path": "engines"}}
    plan = {"sizes": {"64x64": {"profile": {}, "components": {"unet": spec}}}, "build_flags": {}}
    with pytest.raises(GpuUnavailableError, match="TensorRT"):
        trt_build.build(tmp_path, plan, {}, 0)
    cpu = ort.InferenceSession(str(tmp_path / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(GpuUnavailableError, match=r"did not come up \(the session runs on \['CPUExecutionProvider'\]"):
        trt_build.require_tensorrt(cpu.get_providers(), "unet at 64x64", [])


def test_an_engine_built_fp16_for_a_force_upcast_vae_is_recognised(tmp_path: Path) -> None:
    """Artifacts from before fp32_components (or built by hand with fp16) would run SDXL's VAE in fp16: refused."""
    import json

    from engines.pipelines.ort_model import built_fp16

    ctx = tmp_path / "trt" / "1024x1024" / "vae_decoder_ctx.onnx"
    ctx.parent.mkdir(parents=True)
    manifest = tmp_path / "trt" / "manifest.json"
    manifest.write_text(json.dumps({"files": {}, "build_flags": {"fp16": True}}))
    assert built_fp16(ctx, "vae_decoder")
    manifest.write_text(json.dumps({"files": {}, "build_flags": {"fp16": True, "fp32_components": ["vae_decoder"]}}))
    assert not built_fp16(ctx, "vae_decoder") and built_fp16(ctx, "unet")
    assert not built_fp16(tmp_path / "vae_decoder" / "model.onnx", "vae_decoder")  # a plain model: no engine yet


def test_an_fp32_component_gets_tensorrt_fp16_off_whatever_the_profile(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import onnx
    from onnx import TensorProto, helper

    from engines.runtime import sessions

    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    model = tmp_path / "model.onnx"
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [value],
                                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])),
              str(model))
    monkeypatch.setattr(sessions, "preload", lambda tensorrt: [])
    runtime = sessions.Runtime(RuntimeSettings(allow_cpu=True, placement_audit=False))
    asked: dict[str, list[tuple[str, dict[str, str]]]] = {}

    def create(model: object, report: sessions.SessionReport, providers: list[tuple[str, dict[str, str]]],
               extra: object = None) -> object:
        asked[report.name] = providers
        return types.SimpleNamespace(get_providers=lambda: [p for p, _ in providers])

    monkeypatch.setattr(runtime, "_create", create)
    runtime.session(model, "vae_decoder", fp32=True)
    runtime.session(model, "unet")
    assert dict(asked["vae_decoder"])[TRT]["trt_fp16_enable"] == "False"
    assert dict(asked["unet"])[TRT]["trt_fp16_enable"] == "True"  # the profile's default
