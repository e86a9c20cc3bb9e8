"""Issue 18: the plugin-EP policy and the GPU-path defects a source review found, each checked where it can fail."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from pydantic import ValidationError

from engines import artifacts
from engines.accept import run as accept_run
from engines.build import trtplan
from engines.config import Matrix, PluginEp, PluginMatrix, RuntimeSettings
from engines.engine import OrtEngine
from engines.errors import ArtifactError, GpuUnavailableError, InferenceError
from engines.health.capabilities import GPU_MEM_LIMIT_SCOPE
from engines.health.preflight import Observations, decode_version, evaluate, library_or_pip, tensorrt_install
from engines.health.telemetry import DeviceInfo, NvmlReport
from engines.pipelines.ort_model import check_output_type
from engines.runtime import enginecheck, ortlog
from engines.runtime.plugins import PluginReport, no_device_message
from engines.runtime.sessions import Runtime

OV = PluginEp(name="OpenVINOExecutionProvider", package="onnxruntime-ep-openvino")
PLUGIN_POLICY = RuntimeSettings(providers=(), plugin=OV, disable_cpu_ep_fallback=True)
PINNED = Matrix(plugins={"OpenVINOExecutionProvider": PluginMatrix(package="onnxruntime-ep-openvino",
                                                                   version="1.8.1")})


# Plugin EPs in the provider policy

def test_a_plugin_ep_named_in_providers_is_refused_saying_why() -> None:
    with pytest.raises(ValidationError, match=r"plugin execution provider.*runs every node on "
                                              r"CPUExecutionProvider.*\[runtime.plugin\]"):
        RuntimeSettings(providers=("OpenVINOExecutionProvider",))  # type: ignore[arg-type]


def test_plugin_and_providers_together_are_refused() -> None:
    with pytest.raises(ValidationError, match="keeps only providers="):
        RuntimeSettings(providers=("CUDAExecutionProvider",), plugin=OV)


def test_a_plugin_policy_runs_on_the_ep_with_host_memory() -> None:
    assert PLUGIN_POLICY.accelerators == ("OpenVINOExecutionProvider",)
    assert PLUGIN_POLICY.device == "cpu" and not PLUGIN_POLICY.uses_cuda


def _plugin_obs(**changes: object) -> Observations:
    report = PluginReport("OpenVINOExecutionProvider", "onnxruntime-ep-openvino", "1.8.1", "/lib/x.so",
                          "1.8.1+95d534b.ci.79", [{"device_name": "Xeon", "version": "1.8.1+95d534b.ci.79"}])
    obs = Observations("1.31.1", "13.0", ["CPUExecutionProvider"], {}, NvmlReport(False, "no driver"), None,
                       plugin=replace(report, **changes))  # type: ignore[arg-type]
    return obs


def _failed(checks: list[object]) -> dict[str, str]:
    return {c.name: c.observed for c in checks if c.status == "fail"}  # type: ignore[attr-defined]


def test_a_healthy_plugin_needs_no_gpu() -> None:
    assert _failed(evaluate(_plugin_obs(), PINNED, PLUGIN_POLICY)) == {}


def test_a_missing_plugin_package_is_a_gpu_path_failure_naming_it() -> None:
    failed = _failed(evaluate(_plugin_obs(package_version=None, error="pip package onnxruntime-ep-openvino is not "
                                          "installed"), PINNED, PLUGIN_POLICY))
    assert list(failed) == ["plugin_package:OpenVINOExecutionProvider"]
    assert "onnxruntime-ep-openvino" in failed["plugin_package:OpenVINOExecutionProvider"]


@pytest.mark.parametrize(("matrix", "library"), [(Matrix(), "1.8.1"), (PINNED, "1.9.0")],
                         ids=["not-pinned", "loaded-library-differs"])
def test_plugin_versions_are_pinned_by_the_matrix(matrix: Matrix, library: str) -> None:
    checks = evaluate(_plugin_obs(library_version=library), matrix, PLUGIN_POLICY)
    assert list(_failed(checks)) == ["plugin_version:OpenVINOExecutionProvider"]


# Versions from the loaded libraries; TensorRT install honesty

def test_library_versions_decode_as_the_headers_define_them() -> None:
    assert decode_version(91400) == "9.14.0"  # cuDNN 9: major*10000 + minor*100 + patch
    assert decode_version(101303) == "10.13.3"  # TensorRT 10
    assert decode_version(8907) == "8.9.7"  # cuDNN 8's encoding


def test_the_loaded_library_beats_pip_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    def version() -> int:  # a plain function, like a ctypes symbol, takes restype/argtypes attributes
        return 101303

    monkeypatch.setattr("engines.health.preflight.resolve", lambda soname: "/libs/libnvinfer.so.10")
    found, source = library_or_pip("libnvinfer.so.10", "getInferLibVersion", ("tensorrt-cu13",),
                                   load=lambda path: SimpleNamespace(getInferLibVersion=version))
    assert (found, source) == ("10.13.3", "getInferLibVersion() of /libs/libnvinfer.so.10")


def test_a_tensorrt_wheel_without_libnvinfer_is_named_a_placeholder() -> None:
    assert tensorrt_install("10.13.3", None) == "placeholder"
    assert tensorrt_install(None, None) == "not installed"
    assert tensorrt_install("10.13.3", "/x/libnvinfer.so.10") == "installed"
    obs = Observations("1.31.1", "13.0", [], {}, NvmlReport(False), "9.14.0", "", "10.13.3", "pip tensorrt-cu13",
                       tensorrt_install="placeholder")
    check = next(c for c in evaluate(obs, Matrix(), RuntimeSettings()) if c.name == "tensorrt_version")
    assert check.status == "fail" and "TensorRT wheel is a placeholder" in check.observed
    assert obs.to_model().tensorrt_install == "placeholder"  # and so in /capabilities


# A stale engine is an artifact mismatch (exit 23), not "GPU unavailable" nor an on-node build

def test_an_engine_that_does_not_deserialize_is_an_artifact_mismatch() -> None:
    events = ortlog.classify(["[E:onnxruntime:, tensorrt_execution_provider.cc:1234] TensorRT EP could not "
                              "deserialize engine from cache: /m/trt/512x512/engines/x.engine"])
    assert [e.kind for e in events] == ["artifact_mismatch"]
    with pytest.raises(ArtifactError, match="artifact mismatch"):
        enginecheck.gate("unet", events, forbid=False)


def _ep_context_model(path: Path) -> Path:
    node = helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", embed_mode=0,
                            ep_cache_context="engines/unet.engine")
    graph = helper.make_graph([node], "ctx", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(path))
    return path


def test_a_context_model_that_fails_to_load_is_exit_23(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True, placement_audit=False))

    def refuse(*args: object, **kwargs: object) -> object:
        raise RuntimeError("TensorRT EP failed to deserialize the engine")

    monkeypatch.setattr(runtime, "_construct", refuse)
    with pytest.raises(ArtifactError, match=r"artifact mismatch: unet: .*cannot load the prebuilt EP-context"):
        runtime.session(_ep_context_model(tmp_path / "unet_ctx.onnx"), "unet")


# engines build: no com.microsoft ops for TensorRT; context models reopened

def test_contrib_ops_are_refused_for_tensorrt_naming_them(tmp_path: Path) -> None:
    for component in artifacts.COMPONENTS:
        (tmp_path / component).mkdir()
        nodes = [helper.make_node("Relu", ["x"], ["y"])]
        if component == "unet":
            nodes = [helper.make_node("SkipLayerNormalization", ["x", "x", "g"], ["y"], domain="com.microsoft"),
                     helper.make_node("QuickGelu", ["y"], ["z"], domain="com.microsoft")]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], [])
        onnx.save(helper.make_model(graph), str(tmp_path / component / "model.onnx"))
    with pytest.raises(ArtifactError, match=r"unet: com.microsoft.QuickGelu x1, com.microsoft.SkipLayerNormalization"):
        trtplan.refuse_unimportable(tmp_path)


def test_a_context_model_must_be_one_epcontext_node_with_the_source_io(tmp_path: Path) -> None:
    ctx = _ep_context_model(tmp_path / "ctx.onnx")
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "src",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(tmp_path / "source.onnx"))
    assert artifacts.context_model_problems(ctx, tmp_path / "source.onnx") == []
    assert artifacts.context_model_problems(tmp_path / "source.onnx", tmp_path / "source.onnx") == [
        "source.onnx: 1 node(s) ['ai.onnx.Relu'], expected one com.microsoft.EPContext node"]
    graph.output[0].name = "other"
    graph.node[0].output[0] = "other"
    onnx.save(helper.make_model(graph), str(tmp_path / "source.onnx"))
    assert any("outputs" in p for p in artifacts.context_model_problems(ctx, tmp_path / "source.onnx"))


# accept profiles what is served

def test_accept_profiles_the_served_per_size_context_model(tmp_path: Path) -> None:
    (tmp_path / "trt" / "512x512").mkdir(parents=True)
    ctx = _ep_context_model(tmp_path / "trt" / "512x512" / "unet_ctx.onnx")
    (tmp_path / "trt" / "manifest.json").write_text(json.dumps(
        {"files": {}, "sizes": {"512x512": {"context_models": {"unet": "512x512/unet_ctx.onnx"}}}}))
    source, options = accept_run.served_unet(tmp_path, "512x512", RuntimeSettings())
    assert source == ctx
    trt = dict(options)["TensorrtExecutionProvider"]
    assert not {"trt_engine_cache_path", "trt_engine_cache_enable", "trt_timing_cache_path"} & set(trt)
    with pytest.raises(ArtifactError, match="no prebuilt TensorRT UNet for 768x768"):
        accept_run.served_unet(tmp_path, "768x768", RuntimeSettings())


# NVML by PCI bus id, never by ordinal

def _gpu_obs(bus_ids: list[str]) -> Observations:
    devices = [DeviceInfo(1, "NVIDIA L4", "8.9", 24 << 30, 0, pci_bus_id="00000000:3B:00.0"),
               DeviceInfo(0, "NVIDIA H200", "9.0", 141 << 30, 0, pci_bus_id="00000000:19:00.0")]
    return Observations("1.31.1", "13.0", [], {}, NvmlReport(True, "", "580.95.05", "13.0", devices), "9.14.0",
                        cuda_bus_ids=bus_ids)


def test_artifacts_are_bound_to_the_nvml_device_by_index_not_list_position() -> None:
    identity = artifacts.node_identity(_gpu_obs(["0000:19:00.0"]).to_model().model_dump(), 0)
    assert identity["gpu"] == "NVIDIA H200" and identity["compute_capability"] == "9.0"


def test_no_pci_match_is_refused_not_guessed_by_ordinal(tmp_path: Path) -> None:
    engine = OrtEngine(tmp_path, RuntimeSettings())
    engine._observations = _gpu_obs(["0000:99:00.0"])
    with pytest.raises(GpuUnavailableError, match="matches no NVML device by PCI bus id"):
        engine.nvml_index()
    with pytest.raises(GpuUnavailableError):
        accept_run.nvml_index(_gpu_obs(["0000:99:00.0"]), 0)
    assert accept_run.nvml_index(_gpu_obs(["0000:3b:00.0"]), 0) == 1


# Buffers: element types, the pinned check, the memory claim

def test_a_preallocated_output_of_another_element_type_is_refused() -> None:
    check_output_type("text_encoder", "last_hidden_state", "tensor(float)", "tensor(float)")
    with pytest.raises(InferenceError, match=r"bound to a tensor\(float16\) buffer but the session writes "
                                             r"tensor\(float\)"):
        check_output_type("text_encoder", "last_hidden_state", "tensor(float16)", "tensor(float)")


def test_the_pinned_check_never_creates_the_buffer_it_checks() -> None:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    assert runtime.staged("image", (1, 3, 64, 64), np.float32) is None
    array, _ = runtime.staging("image", (1, 3, 64, 64), np.float32)
    assert runtime.staged("image", (1, 3, 64, 64), np.float32) is array
    assert runtime.staged("image", (2, 3, 64, 64), np.float32) is None


def test_gpu_mem_limit_claims_a_budget_only_with_the_shared_arena() -> None:
    # The cap covers the process only when the one shared CUDA arena was registered; the statement names the
    # condition (and what stays outside every arena) instead of claiming a budget unconditionally.
    assert "shared_device_arena.registered" in GPU_MEM_LIMIT_SCOPE
    assert "without it the cap covers only sessions whose first provider is CUDA" in GPU_MEM_LIMIT_SCOPE
    assert "TensorRT engine memory" in GPU_MEM_LIMIT_SCOPE and "IO-binding buffers" in GPU_MEM_LIMIT_SCOPE


def test_the_copy_count_says_what_it_cannot_see() -> None:
    from engines.accept.copies import count_copies

    events = [{"cat": "Node", "name": "conv_kernel_time", "args": {"op_name": "Conv"}}]
    summary = count_copies(events, unet_runs=2).summary()
    assert "feed copy" in summary and "per-step uploads" in summary and "trivially true" in summary


# A plugin EP that loads but offers no device (issue 26): the message says why, never "reinstall"

AMD_CPU = [("CPU", 0x1022, "AMD")]


def test_no_device_on_an_amd_cpu_names_openvinos_vendor_rule() -> None:
    text = no_device_message(OV, [], AMD_CPU)
    assert "ONNX Runtime found: CPU AMD (vendor id 0x1022)" in text
    assert "the plugin offered: nothing" in text
    assert "vendor rule" in text and "ov_factory.cc" in text and "0x8086 (Intel)" in text
    assert "reinstall" not in text


def test_no_device_on_an_intel_cpu_does_not_blame_the_vendor_rule() -> None:
    text = no_device_message(OV, ["OpenVINOExecutionProvider.AUTO on CPU"], [("CPU", 0x8086, "Intel")])
    assert "vendor rule" not in text and "reinstall" not in text
    assert "OpenVINOExecutionProvider.AUTO on CPU" in text and "device_type" in text


def test_no_device_of_the_wanted_type_says_so_for_any_plugin() -> None:
    gpu_plugin = PluginEp(name="NvTensorRTRTXExecutionProvider", package="onnxruntime-ep-nv-tensorrt-rtx",
                          device_type="GPU")
    text = no_device_message(gpu_plugin, [], AMD_CPU)
    assert "found no GPU device at all" in text and "vendor rule" not in text
