"""The fail-closed runtime against real onnxruntime-gpu on this machine — itself a misconfigured GPU node:
the provider libraries are installed, CUDA/cuDNN/TensorRT and the driver are not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from engines.config import RuntimeSettings
from engines.errors import GpuUnavailableError
from engines.runtime import placement
from engines.runtime.sessions import Runtime, enforce
from server.settings import load_settings

NO_GPU = pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="asserts the behaviour of a machine without a GPU")
SCHEMA = json.loads((Path(__file__).parents[2] / "engines" / "schemas" / "capabilities.schema.json").read_text())
CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


def _sdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=120)


def test_placement_audit_classifies_a_cpu_session_and_production_rejects_it(tiny_model: Path) -> None:
    model = tiny_model / "unet" / "model.onnx"
    runtime = Runtime(CPU)
    session = runtime.session(model, "unet")
    report = runtime.reports["unet"]
    assert report.placement is not None and not report.placement.ok
    assert report.placement.nodes_by_provider == {"CPUExecutionProvider": sum(report.placement.cpu_ops.values())}
    assert report.placement.unclassified == "CPU allowed by the profile"  # dev pays no data-flow audit
    enforce(report, CPU)  # dev accepts it
    classified = placement.audit(session, "unet", model)
    assert any(n.startswith("Conv ") for n in classified.activation_on_cpu)
    assert {"Gather", "Unsqueeze", "Concat"} <= set(classified.shape_path)  # shape arithmetic: allowed, counted
    report.placement = classified
    with pytest.raises(GpuUnavailableError, match=r"runs \['CPUExecutionProvider'\]"):
        enforce(report, load_settings("production").runtime)


@NO_GPU
def test_production_session_fails_closed_with_classified_ort_lines(tiny_model: Path) -> None:
    cuda_only = load_settings("production").runtime.model_copy(update={"providers": ("CUDAExecutionProvider",)})
    runtime = Runtime(cuda_only)  # (with TensorRT too, the plain model.onnx is refused first: no EPContext node)
    with pytest.raises(GpuUnavailableError, match="libcublas"):
        runtime.session(tiny_model / "vae_decoder" / "model.onnx", "vae_decoder")
    events = runtime.reports["vae_decoder"].events
    assert {"kind": "provider_library_missing", "detail": "libcublasLt.so.13"}.items() <= events[0].model_dump().items()
    assert runtime.reports["vae_decoder"].log_lines  # raw lines kept for operators


@NO_GPU
def test_doctor_json_validates_and_says_not_accelerated(tiny_model: Path) -> None:
    done = _sdserve("doctor", "--json", "--model", str(tiny_model))
    assert done.returncode == 20, done.stderr
    snapshot = json.loads(done.stdout)
    jsonschema.validate(snapshot, SCHEMA)
    assert snapshot["accelerated"] is False and snapshot["verdict"]["status"] == "fail"
    reasons = " ".join(snapshot["verdict"]["reasons"])
    assert "libcublasLt.so.13 (needed by libonnxruntime_providers_cuda.so; ships in pip nvidia-cublas" in reasons
    assert "libnvinfer.so.10" in reasons and "libcudnn.so.9" in reasons and "nvml" in reasons
    assert snapshot["exit_code"] == {"code": 20, "name": "GPU_UNAVAILABLE"}


def test_doctor_dev_profile_is_cpu_dev_and_validates(tiny_model: Path) -> None:
    done = _sdserve("doctor", "--json", "--profile", "dev", "--model", str(tiny_model))
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    jsonschema.validate(snapshot, SCHEMA)
    assert snapshot["accelerated"] is False and snapshot["verdict"]["status"] == "cpu-dev"
    assert snapshot["sessions"]["unet"]["providers_used"][0] == "CPUExecutionProvider"
    assert snapshot["io"]["host_staging"] == "pageable"


@pytest.mark.parametrize(("section", "fragment"), [
    ('[onnxruntime]\nversion = "1.30.0"\n', "onnxruntime_version: found 1.31.1, expected 1.30.0"),
    ('[onnxruntime]\ncuda = "12.8"\n', "onnxruntime_cuda_build: found 13.0, expected 12.8"),
])
def test_matrix_mismatch_refuses_naming_expected_and_found(tiny_model: Path, tmp_path: Path, section: str,
                                                            fragment: str) -> None:
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(section)
    done = _sdserve("doctor", "--matrix", str(matrix), "--model", str(tiny_model))
    assert done.returncode == 21, done.stdout + done.stderr
    assert fragment in done.stderr


def test_signature_watch_without_nvml_is_gpu_unavailable(tiny_model: Path) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU; tests/gpu covers the live reading")
    done = _sdserve("doctor", "--json", "--profile", "dev", "--watch", "0.5", "--model", str(tiny_model))
    assert done.returncode == 20
    assert "NVML unavailable" in json.loads(done.stdout)["signature"]["error"]
