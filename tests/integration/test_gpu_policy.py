"""The GPU policy on real onnxruntime and the real tiny model: placement refused by data flow, the scheduler step
pinned to CUDA, on-node TensorRT builds detected from facts, and libraries resolved where the loader finds them.

No GPU here. Where a CUDA session's recorded assignment is needed, a real session's assignment is relabelled: the
nodes the CUDA partitioner keeps on the CPU (GetCpuPreferredNodes, onnxruntime/core/framework/
fallback_cpu_capability.cc, emulated in tests/integration/test_placement_dataflow.py) on the CPU, the rest on CUDA."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines.config import RuntimeSettings
from engines.errors import ArtifactError, GpuUnavailableError, PlacementError
from engines.numerics.step_graph import build_step_graph
from engines.runtime import enginecheck, libdeps, placement
from engines.runtime.dataflow import partitioned_graph, shape_tensors
from engines.runtime.sessions import Runtime, SessionReport, enforce
from server.settings import load_settings
from tests.integration.test_placement_dataflow import cuda_cpu_preferred_nodes

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
DEV = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)
Unet = tuple[Path, ort.InferenceSession, onnx.GraphProto]


def production(*providers: str) -> RuntimeSettings:
    return load_settings("production").runtime.model_copy(update={"providers": providers})


@dataclass(frozen=True)
class _Subgraph:
    ep_name: str
    nodes: tuple[object, ...]

    def get_nodes(self) -> tuple[object, ...]:
        return self.nodes


class Relabelled:
    """A real session whose recorded assignment puts ``on_cpu`` on the CPU provider and every other node on CUDA."""

    def __init__(self, session: ort.InferenceSession, on_cpu: set[str]) -> None:
        self.nodes = [n for sg in session.get_provider_graph_assignment_info() for n in sg.get_nodes()]
        self.on_cpu = on_cpu

    def get_provider_graph_assignment_info(self) -> list[_Subgraph]:
        return [_Subgraph(CUDA, tuple(n for n in self.nodes if n.name not in self.on_cpu)),
                _Subgraph(CPU, tuple(n for n in self.nodes if n.name in self.on_cpu))]


@pytest.fixture(scope="module")
def unet(tiny_model: Path) -> Unet:
    model = tiny_model / "unet" / "model.onnx"
    runtime = Runtime(DEV)
    return model, runtime.session(model, "unet"), partitioned_graph(model)


def _audit(unet: Unet, on_cpu: set[str]) -> SessionReport:
    model, session, _ = unet
    report = placement.audit(cast(ort.InferenceSession, Relabelled(session, on_cpu)), "unet", model)
    return SessionReport("unet", [CUDA], [CUDA, CPU], placement=report)


def _activation_node(graph: onnx.GraphProto, op: str) -> onnx.NodeProto:
    """The first ``op`` node whose data input is an activation (Conv: its weights aside; Add: both operands)."""
    shapes, weights = shape_tensors(graph), {t.name for t in graph.initializer}
    fed = {"Conv": 1, "Add": 2}[op]
    found: onnx.NodeProto = next(n for n in graph.node if n.op_type == op
                and all(i not in shapes and i not in weights for i in n.input[:fed]))
    return found


def test_the_shape_path_cuda_leaves_on_the_cpu_is_allowed_counted_and_reported(unet: Unet) -> None:
    preferred = cuda_cpu_preferred_nodes(unet[2])
    report = _audit(unet, preferred)
    enforce(report, production(CUDA))  # the op-name allowlist refused this (exit 22 on every real export)
    assert report.placement is not None
    snapshot = report.to_model().placement
    assert snapshot is not None and snapshot.ok and snapshot.activation_on_cpu == ()
    assert sum(snapshot.shape_path.values()) == len(preferred)
    old_allowlist = set(RuntimeSettings().cpu_allowlist)
    assert {"Div", "Mul", "Sqrt"} <= set(snapshot.shape_path) - old_allowlist


@pytest.mark.parametrize("op", ["Conv", "Add"])
def test_an_activation_op_moved_to_the_cpu_is_refused_by_name(unet: Unet, op: str) -> None:
    node = _activation_node(unet[2], op)
    report = _audit(unet, cuda_cpu_preferred_nodes(unet[2]) | {node.name})
    with pytest.raises(PlacementError, match=re.escape(f"{op} {node.name}")):
        enforce(report, production(CUDA))
    snapshot = report.to_model().placement
    assert snapshot is not None and snapshot.activation_on_cpu == (f"{op} {node.name}",)


def test_an_in_process_graph_is_audited_from_its_bytes() -> None:
    step = build_step_graph(np.float32, np.float32)
    runtime = Runtime(DEV)
    session = runtime.session(step, "scheduler_step")
    report = placement.audit(session, "scheduler_step", step)
    assert report.unmatched == [] and any(n.startswith("MatMul ") for n in report.activation_on_cpu)


def test_the_step_session_asks_for_cuda_only_under_a_tensorrt_policy() -> None:
    runtime = Runtime(production("TensorrtExecutionProvider", CUDA))
    with pytest.raises(GpuUnavailableError):  # no CUDA libraries on this machine; the request is what counts
        runtime.session(build_step_graph(np.float32, np.float32), "scheduler_step")
    assert runtime.reports["scheduler_step"].providers_requested == [CUDA]


def test_a_tensorrt_component_without_ep_context_nodes_is_refused_before_any_build(tiny_model: Path) -> None:
    runtime = Runtime(production("TensorrtExecutionProvider", CUDA), tiny_model)
    with pytest.raises(ArtifactError, match="no EPContext node in .*vae_decoder"):
        runtime.session(tiny_model / "vae_decoder" / "model.onnx", "vae_decoder")
    assert runtime.reports["vae_decoder"].providers_used == []  # refused before ORT was asked


def test_ep_context_models_are_recognised(tmp_path: Path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    node = helper.make_node("EPContext", ["x"], ["y"], name="unet_trt", domain="com.microsoft", embed_mode=0,
                            ep_cache_context="unet.engine", source="TensorrtExecutionProvider")
    model = helper.make_model(helper.make_graph([node], "ctx", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, tmp_path / "unet_ctx.onnx")
    assert enginecheck.ep_context_nodes(tmp_path / "unet_ctx.onnx") == 1
    assert enginecheck.ep_context_events(tmp_path / "unet_ctx.onnx", "unet") == []


def test_an_engine_written_after_load_is_caught_without_any_log_line(tmp_path: Path) -> None:
    runtime = Runtime(production("TensorrtExecutionProvider", CUDA), tmp_path)
    assert runtime.check_engine_cache("warm-up") == []
    cache = tmp_path / "trt" / "engines"
    cache.mkdir(parents=True)
    (cache / "TensorrtExecutionProvider_TRTKernel_graph_1.engine").write_bytes(b"engine")
    with pytest.raises(ArtifactError, match="TRTKernel_graph_1.engine"):
        runtime.check_engine_cache("self-test warm-up")
    allowed = production("TensorrtExecutionProvider", CUDA).model_copy(
        update={"tensorrt": RuntimeSettings().tensorrt.model_copy(update={"forbid_engine_build": False})})
    lenient = Runtime(allowed, tmp_path)
    (cache.parent / "timing").mkdir()
    (cache.parent / "timing" / "TensorrtExecutionProvider_cache_sm90.timing").write_bytes(b"t")
    assert [e.kind for e in lenient.check_engine_cache("warm-up")] == ["engine_rebuild"]


# 9. Libraries found as the loader finds them

def _preload_dlls_paths_from_source() -> set[tuple[str, ...]]:
    """The Linux tuples of onnxruntime/__init__.py's _get_nvidia_dll_paths for CUDA >= 13 (consolidated nvidia/cu13
    wheel) and cuDNN, read as text, not by calling it; fields filled from the installed build (cufft skipped)."""
    source = (Path(ort.__file__).parent / "__init__.py").read_text(encoding="utf-8")
    major = str(ort.capi.build_and_package_info.cuda_version).split(".")[0]
    found: set[tuple[str, ...]] = set()
    for folder, name in re.findall(r'\("nvidia", (cuda_dir|"cudnn"), "lib", f?"([^"]+)"\)', source):
        if "{cufft_version}" not in name:
            found.add(("nvidia", f"cu{major}" if folder == "cuda_dir" else "cudnn", "lib",
                       name.replace("{cuda_major_version}", major)))
    return found


def test_preload_plan_uses_the_wheel_folders_preload_dlls_uses(tmp_path: Path) -> None:
    expected = _preload_dlls_paths_from_source()
    assert ("nvidia", "cu13", "lib", "libcublasLt.so.13") in expected
    assert ("nvidia", "cudnn", "lib", "libcudnn.so.9") in expected
    assert expected <= set(libdeps.ort_preload_paths())
    for parts in [*expected, *libdeps.TENSORRT_PRELOADS]:
        tmp_path.joinpath(*parts[:-1]).mkdir(parents=True, exist_ok=True)
        tmp_path.joinpath(*parts).write_bytes(b"")
    plan = libdeps.preload_plan(tmp_path)
    assert {p.parent for p in plan.values()} == {tmp_path / "nvidia" / "cu13" / "lib", tmp_path / "nvidia" / "cudnn"
                                                 / "lib", tmp_path / "tensorrt_libs"}
    assert libdeps.resolve("libcublasLt.so.13", site=tmp_path) == str(tmp_path / "nvidia/cu13/lib/libcublasLt.so.13")
    assert libdeps.resolve("libnvinfer.so.10", site=tmp_path) == str(tmp_path / "tensorrt_libs/libnvinfer.so.10")


def test_a_wheel_library_nothing_preloads_is_not_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stray = tmp_path / "nvidia" / "nccl" / "lib"
    stray.mkdir(parents=True)
    (stray / "libsdserve_probe.so.1").write_bytes(b"")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    # The old search globbed nvidia/*/lib and called this resolved; the loader would not find it.
    assert libdeps.resolve("libsdserve_probe.so.1", site=tmp_path) is None
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stray))
    assert libdeps.resolve("libsdserve_probe.so.1", site=tmp_path) == str(stray / "libsdserve_probe.so.1")
