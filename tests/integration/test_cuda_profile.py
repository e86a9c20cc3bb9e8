"""The cuda profile (configs/cuda.toml): ONNX Runtime's CUDA provider alone, no TensorRT, fail-closed like production.
Its whole plan is executed on this CPU, through real ONNX Runtime, as far as a machine without a GPU allows:

- the profile parses and validates, the CPU provider is never listed, and it keeps production's serving, limits and
  queue (step batching, the step cache, LoRA);
- every provider option set the engine would build under it goes through ORT's real option parser
  (engines/runtime/optcheck.py: the binding's ``initialize_session``, onnxruntime/python/onnxruntime_pybind_state.cc;
  the CUDA keys against cuda_execution_provider_info.cc's names);
- the placement audit's classification under this policy runs on real sessions with CPU nodes;
- ``sdserve engines optimize --target cuda`` on the tiny model writes the graphs the profile serves, and boot
  verifies the model folder without asking for TensorRT engines (engines/artifact_checks.py);
- ``sdserve serve --profile cuda`` and ``sdserve accept --profile cuda`` exit 20 (GPU path unavailable) here, saying
  why on stderr.

What only a GPU can show (docs/deployment.md): the sessions actually on the CUDA provider, their CPU-node counts, the
arena cap enforced, and the speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import onnx.helper as oh
import onnxruntime as ort
import pytest

from engines.artifact_checks import ANY, ArtifactChecks
from engines.errors import PlacementError
from engines.health.preflight import Observations, evaluate
from engines.health.telemetry import NvmlReport
from engines.runtime import optcheck, placement
from engines.runtime.sessions import CPU, CUDA, TRT, SessionReport, enforce, provider_options, session_providers
from server.exitcodes import ExitCode, exit_code_for
from server.settings import PROFILES, Settings, load_settings

NO_GPU = pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="asserts the behaviour of a machine without a GPU")
TOTAL = 80 * 1024**3
"""An H100's device memory, as NVML would report it to preflight (the arena cap is a fraction of it)."""


def _sdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def optimized(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The graphs the cuda profile serves: a real `sdserve engines optimize --target cuda` process (~30 s here)."""
    out = tmp_path_factory.mktemp("cuda") / "model"
    done = _sdserve("engines", "optimize", "--model", str(tiny_model), "--out", str(out), "--target", "cuda")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_profile_is_shipped_and_valid() -> None:
    settings = load_settings("cuda")
    runtime = settings.runtime
    assert "cuda" in PROFILES and settings.profile == "cuda" and settings.on_boot_failure == "exit"
    assert runtime.providers == (CUDA,) and CPU not in runtime.providers and TRT not in runtime.providers
    assert not runtime.allow_cpu and runtime.placement_audit and runtime.plugin is None and runtime.device == "cuda"
    assert runtime.cuda.shared_arena and runtime.cuda.arena_extend_strategy == "kSameAsRequested"
    assert not runtime.cuda.enable_cuda_graph
    assert settings.serving.sizes == ()  # every size within the limits: no per-size build
    production = load_settings("production")
    for section in ("limits", "queue", "cache", "auth", "watchdog", "selftest", "provenance", "api", "defaults"):
        assert getattr(settings, section) == getattr(production, section), section
    assert settings.queue.batching == "step" and runtime.lora == production.runtime.lora


def test_the_cpu_is_refused_in_the_profile() -> None:
    data = load_settings("cuda").model_dump()
    data["runtime"] |= {"providers": [CUDA, CPU], "allow_cpu": True}
    with pytest.raises(ValueError, match="cuda profile with runtime.allow_cpu = true: cuda never runs on the CPU"):
        Settings.model_validate(data)
    data["runtime"] |= {"providers": [CUDA, CPU], "allow_cpu": False}
    with pytest.raises(ValueError, match="runtime.allow_cpu is false"):
        Settings.model_validate(data)


def test_every_option_set_passes_orts_parser(optimized: Path) -> None:
    """The sessions the engine builds under the profile: files (the optimized graphs), graphs built in process
    (LoRA variants, the step graph): each (provider, options) list is the CUDA provider alone, its options
    accepted by ORT's real parser (onnxruntime_pybind_state.cc; cuda_execution_provider_info.cc's names), the
    provider not loaded here. The probe carries the optimized UNet's real input names, types and ranks."""
    runtime = load_settings("cuda").runtime
    sets = {"policy": provider_options(runtime, optimized, TOTAL),
            "file": session_providers(runtime, False, optimized, TOTAL),
            "in process": session_providers(runtime, True, optimized, TOTAL)}
    inputs = optcheck.graph_input_types(optimized / "unet" / "model.onnx")
    for label, providers in sets.items():
        assert [p for p, _ in providers] == [CUDA], label  # never the CPU, never TensorRT
        for provider, options in providers:
            result = optcheck.parse(provider, options, inputs)
            assert result.accepted, f"{label}: {result.detail}"
            assert not result.loaded  # no GPU here: the parse is what this proves
    cuda = dict(sets["policy"])[CUDA]
    assert cuda["gpu_mem_limit"] == str(int(TOTAL * runtime.cuda.gpu_mem_limit_fraction))
    assert cuda["arena_extend_strategy"] == "kSameAsRequested" and cuda["enable_cuda_graph"] == "0"
    assert not optcheck.parse(CUDA, {**cuda, "trt_fp16_enable": "True"}).accepted  # the parser does refuse


def _shape_only_model(path: Path) -> Path:
    """A graph whose every node computes on shape values only: a small static input (as a Shape output the CUDA
    provider leaves on the host would be) -> Gather -> Cast."""
    nodes = [oh.make_node("Gather", ["s", "i"], ["g"], name="gather", axis=0),
             oh.make_node("Cast", ["g"], ["y"], name="cast", to=onnx.TensorProto.FLOAT)]
    graph = oh.make_graph(nodes, "shape_only", [oh.make_tensor_value_info("s", onnx.TensorProto.INT64, [4])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])],
                          [oh.make_tensor("i", onnx.TensorProto.INT64, [], [0])])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = optcheck.PROBE_IR_VERSION
    onnx.save(model, str(path))
    return path


def _audited(model: Path, name: str) -> placement.PlacementReport:
    so = ort.SessionOptions()
    so.add_session_config_entry(placement.CONFIG_KEY, "1")
    session = ort.InferenceSession(str(model), so, providers=[CPU])
    return placement.audit(session, name, model, classify=not load_settings("cuda").runtime.allow_cpu)


def test_the_placement_audit_under_the_policy(tiny_model: Path, tmp_path: Path) -> None:
    """Real sessions with CPU nodes (record_ep_graph_assignment_info, engines/runtime/placement.py; the partitioned
    graph classified by data flow, engines/runtime/dataflow.py). Under the cuda policy a UNet with its convolutions on
    the CPU is refused by name (exit 22), while CPU nodes that compute only on shape values, which the CUDA provider
    leaves on the CPU on purpose (GetCpuPreferredNodes, onnxruntime/core/framework/fallback_cpu_capability.cc), pass.
    ``providers_used`` is what a GPU node reports (ORT always appends the CPU provider)."""
    runtime = load_settings("cuda").runtime
    on_gpu = [CUDA, CPU]
    unet = _audited(tiny_model / "unet" / "model.onnx", "unet")
    assert not unet.ok and any(n.startswith("Conv ") for n in unet.activation_on_cpu)
    assert {"Gather", "Unsqueeze", "Concat"} <= set(unet.shape_path)
    with pytest.raises(PlacementError, match=r"unet: \d+ node\(s\) on the activation path run on the CPU: "
                       r"Shape /model/Shape, .* and \d+ more \(shape-path nodes allowed"):
        enforce(SessionReport("unet", [CUDA], on_gpu, placement=unet), runtime)
    shapes = _audited(_shape_only_model(tmp_path / "shape.onnx"), "shape")
    assert shapes.ok and shapes.cpu_nodes and not shapes.activation_on_cpu
    enforce(SessionReport("shape", [CUDA], on_gpu, placement=shapes), runtime)  # allowed, counted
    assert exit_code_for(PlacementError("unet")) == ExitCode.PLACEMENT_FAILED


def test_the_optimized_graphs_are_what_the_profile_serves(optimized: Path) -> None:
    """`engines optimize --target cuda`: fused attention and the CUDA-only fusions (engines/build/optimize.py),
    recorded in optimize.json and the manifest; the folder verifies under the cuda policy with no TensorRT engine
    asked for (engines/artifact_checks.py); ops that have no CPU kernel (GroupNorm, NhwcConv:
    contrib_ops/cuda/diffusion) mean the CPU provider cannot even build the UNet, so these graphs cannot silently
    run on the CPU."""
    report = json.loads((optimized / "optimize.json").read_text())
    assert report["target"] == "cuda"
    manifest = json.loads((optimized / "manifest.json").read_text())
    assert manifest["source"]["optimized"]["target"] == "cuda"
    unet = onnx.load(str(optimized / "unet" / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in unet.graph.node}
    assert {"MultiHeadAttention", "GroupNorm"} <= ops
    for component in report["components"].values():
        assert component["attention"]["fused"] == component["attention"]["expected"] > 0
    runtime = load_settings("cuda").runtime
    assert runtime.tensorrt.require_engines and not (optimized / "trt").exists()  # required only with TensorRT
    assert ArtifactChecks(optimized, runtime).verify(None, lambda: 0) == {ANY: {}}
    with pytest.raises(Exception, match=r"NOT_IMPLEMENTED : Could not find an implementation for "
                                         r"(NhwcConv|GroupNorm|SkipGroupNorm)"):
        ort.InferenceSession(str(optimized / "unet" / "model.onnx"), providers=[CPU])


def test_preflight_checks_versions_and_reports_tensorrt_absent_by_design() -> None:
    """engines/health/preflight.py on observations of a healthy CUDA node without TensorRT: ORT, its CUDA build and
    cuDNN are checked against configs/matrix.toml; TensorRT is skipped as absent by design, not failed."""
    from engines.config import load_matrix
    from server.bootstrap import config_path

    matrix = load_matrix(config_path("matrix.toml"))
    obs = Observations(ort_version=matrix.onnxruntime.version, ort_cuda_version=f"{matrix.onnxruntime.cuda}.1",
                       available_providers=[TRT, CUDA, CPU], closures={}, nvml=NvmlReport(False, "not asked"),
                       cudnn_version="9.10.2", cudnn_source="libcudnn.so.9")
    checks = {c.name: c for c in evaluate(obs, matrix, load_settings("cuda").runtime)}
    assert checks["onnxruntime_version"].status == checks["onnxruntime_cuda_build"].status == "pass"
    assert checks["cudnn_version"].status == "pass"
    trt = checks["tensorrt_version"]
    assert trt.status == "skip" and trt.remediation.startswith("absent by design") and CUDA in trt.remediation
    older = Observations(ort_version="1.30.0", ort_cuda_version="12.8", available_providers=[CUDA, CPU],
                         closures={}, nvml=NvmlReport(False, "not asked"), cudnn_version="8.9.7",
                         cudnn_source="libcudnn.so.8")
    failed = {c.name for c in evaluate(older, matrix, load_settings("cuda").runtime) if c.status == "fail"}
    assert {"onnxruntime_version", "onnxruntime_cuda_build", "cudnn_version"} <= failed
    assert "tensorrt_version" not in failed


@NO_GPU
def test_serve_exits_20_saying_why(optimized: Path) -> None:
    """Fail-closed as production: no usable GPU here, so the boot ends with exit 20 (GPU_UNAVAILABLE) before any
    session is built, and stderr names what is missing."""
    done = _sdserve("serve", "--profile", "cuda", "--model", str(optimized), "--port", "0")
    assert done.returncode == int(ExitCode.GPU_UNAVAILABLE), done.stderr[-3000:]
    assert "boot failed (exit code 20 GPU_UNAVAILABLE): GPU path unavailable" in done.stderr
    assert "libonnxruntime_providers_cuda.so" in done.stderr and "libnvinfer" not in done.stderr


@NO_GPU
def test_accept_takes_the_profile_and_exits_20(tiny_model: Path, tmp_path: Path) -> None:
    done = _sdserve("accept", "--profile", "cuda", "--model", str(tiny_model), "--out", str(tmp_path / "report"))
    assert done.returncode == int(ExitCode.GPU_UNAVAILABLE), done.stderr[-3000:]
    assert "needs an NVIDIA GPU node" in done.stderr and not (tmp_path / "report").exists()


def test_engines_build_under_the_profile_is_refused_pointing_at_optimize(tiny_model: Path) -> None:
    """Nothing to build for a CUDA-only policy: `engines build --profile cuda` exits 10 (CONFIG_INVALID) before any
    plan, naming `engines optimize --target cuda`, instead of planning TensorRT engines it would never load."""
    done = _sdserve("engines", "build", "--profile", "cuda", "--model", str(tiny_model), "--dry-run")
    assert done.returncode == int(ExitCode.CONFIG_INVALID), done.stderr[-3000:]
    assert "no engines to build" in done.stderr and "--target cuda" in done.stderr


def test_the_kubernetes_render_carries_the_profile() -> None:
    """`sdserve deploy render --profile cuda` (server/cli/deploy.py): every replica boots the cuda profile, the pod
    template says TensorRT is absent by design, and the GPU request and node affinity are production's."""
    from server.bootstrap import settings_matrix
    from server.cli.deploy import render

    def pod(profile: str) -> dict:
        settings = load_settings(profile)
        rendered = render(settings, settings_matrix(settings, None), "sdserve:0.1.0-notrt", kind="deployment")
        return rendered["deployment.yaml"][0]["spec"]["template"]

    cuda, production = pod("cuda"), pod("production")
    container = cuda["spec"]["containers"][0]
    assert container["args"][:2] == ["--profile", "cuda"]
    assert cuda["metadata"]["annotations"]["sdserve/matrix-tensorrt"] == "absent by design (cuda profile)"
    assert production["metadata"]["annotations"]["sdserve/matrix-tensorrt"] == "10"
    assert container["resources"] == production["spec"]["containers"][0]["resources"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert cuda["spec"]["affinity"] == production["spec"]["affinity"]
    assert container["readinessProbe"] == production["spec"]["containers"][0]["readinessProbe"]
