"""Every row of the exit-code table (docs/gpu-path.md), asserted as the exit status of a real `sdserve` process
(`python -m server.cli ...`), each reached by the failure the row documents.

22 (placement audit failed) needs a GPU: a policy that forbids the CPU lists only GPU providers, and on a machine
without one preflight refuses it first (20, tested below), before any session is built; with the CPU allowed the
audit is informational. On a GPU node an empty ``cpu_allowlist`` makes the CUDA provider's own shape-op placement
(GetCpuPreferredNodes, onnxruntime/core/framework/fallback_cpu_capability.cc) a refusal: that test runs there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from server.exitcodes import ExitCode
from server.settings import CONFIG_DIR
from tests.e2e.conftest import dev_config, model_with_vae_output

HAS_GPU = Path("/dev/nvidia0").exists()


def sdserve(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=180,
                          cwd=cwd)


def assert_exit(done: subprocess.CompletedProcess[str], code: ExitCode, fragment: str) -> None:
    assert done.returncode == int(code), f"exit {done.returncode}, want {int(code)}:\n{done.stderr[-3000:]}"
    assert fragment in done.stdout + done.stderr


def test_documented_codes_are_the_enum() -> None:
    """The exit-code table of docs/gpu-path.md and server/exitcodes.py list the same codes (each row is exercised
    below; docs/reference/exit-codes.md is generated from the enum)."""
    readme = (Path(__file__).parents[2] / "docs" / "gpu-path.md").read_text()
    rows = {int(line.split("|")[1]) for line in readme.splitlines() if line.startswith("| ") and
            line.split("|")[1].strip().isdigit() and "exit" not in line}
    assert {int(c) for c in ExitCode} <= rows | {0}
    assert {1, 2, 10, 11, 20, 21, 22, 23, 24, 30} <= {int(c) for c in ExitCode}


def test_1_internal_error_non_finite_vae_output(tiny_model: Path, tmp_path: Path) -> None:
    """`sdserve generate` on a model whose VAE outputs NaN: the pipeline's own failure, and no image is written."""
    model = model_with_vae_output(tiny_model, tmp_path / "nan", float("nan"))
    out = tmp_path / "out.png"
    done = sdserve("generate", "a lighthouse", "--profile", "dev", "--model", str(model), "--steps", "2", "-o",
                   str(out))
    assert_exit(done, ExitCode.INTERNAL, "NaN/inf")
    assert not out.exists()


@pytest.mark.parametrize(("args", "fragment"), [
    (("serve", "--port", "eighty"), "invalid int value: 'eighty'"),
    (("bench", "--url", "http://192.0.2.1:8000"), "only targets loopback"),
])
def test_2_usage_error(args: tuple[str, ...], fragment: str) -> None:
    assert_exit(sdserve(*args), ExitCode.USAGE, fragment)


def test_10_invalid_config_names_file_and_field(tiny_model: Path, tmp_path: Path) -> None:
    config = dev_config(tmp_path, replace={"max_size = 32": "max_size = 0"})
    done = sdserve("doctor", "--config", str(config), "--model", str(tiny_model))
    assert_exit(done, ExitCode.CONFIG_INVALID, "queue.max_size")
    assert str(config) in done.stderr


def test_11_folder_that_is_not_a_model(tmp_path: Path) -> None:
    """A folder whose (empty) manifest verifies but holds no model."""
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "files": {}}))
    assert_exit(sdserve("selftest", "--profile", "dev", "--model", str(tmp_path)), ExitCode.MODEL_INVALID,
                "has no text_encoder/model.onnx")


def test_20_gpu_path_unavailable(tiny_model: Path) -> None:
    """Production policy on device 63: no such device here, and on a machine without a GPU no provider library."""
    assert_exit(sdserve("selftest", "--device-id", "63", "--model", str(tiny_model)), ExitCode.GPU_UNAVAILABLE,
                "GPU path unavailable")


def test_21_version_matrix_mismatch_before_20(tiny_model: Path, tmp_path: Path) -> None:
    matrix = tmp_path / "matrix.toml"
    matrix.write_text('[onnxruntime]\nversion = "1.0.0"\n')
    assert_exit(sdserve("doctor", "--matrix", str(matrix), "--model", str(tiny_model)), ExitCode.VERSION_MISMATCH,
                "expected 1.0.0")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="22 needs a GPU: without one preflight refuses a GPU policy first (20)")
def test_22_placement_audit_failed_on_a_gpu(tiny_model: Path, tmp_path: Path) -> None:
    text = (CONFIG_DIR / "production.toml").read_text().replace(
        'providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]',
        'providers = ["CUDAExecutionProvider"]\nplacement_audit = true\ncpu_allowlist = []')
    profile = tmp_path / "production.toml"
    profile.write_text(text.replace("require_fingerprints = true", "require_fingerprints = false"))
    assert_exit(sdserve("doctor", "--config", str(profile), "--model", str(tiny_model)), ExitCode.PLACEMENT_FAILED,
                "ops placed on the CPU that the policy forbids")


def test_23_artifact_verification_failed(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    with (model / "unet" / "config.json").open("a") as fh:
        fh.write(" ")
    assert_exit(sdserve("doctor", "--profile", "dev", "--model", str(model)), ExitCode.ARTIFACT_INVALID,
                "unet/config.json")


def test_24_self_test_failed(tiny_model: Path, tmp_path: Path) -> None:
    slo = tmp_path / "slo.toml"
    slo.write_text('[[dev]]\nsize = "64x64"\nbatch = 1\nsteps = 8\nbudget_s = 0.0001\n')
    config = dev_config(tmp_path, replace={"timed_runs = 3": f'timed_runs = 3\nslo_file = "{slo}"'})
    assert_exit(sdserve("selftest", "--config", str(config), "--model", str(tiny_model)), ExitCode.SELF_TEST_FAILED,
                "over budget")


def _bench_result(p95_s: float) -> dict[str, object]:
    return {"format": 1, "fingerprints": {}, "capabilities": {"providers": {"unet": ["CUDAExecutionProvider"]}},
            "levels": [{"concurrency": 1, "requests": 8, "ok": 8, "rejected_429": 0, "errors": 0, "p50_s": p95_s,
                        "p95_s": p95_s, "p99_s": p95_s, "images_per_minute": 600.0}]}


def test_30_gate_regression_and_0_without_one(tmp_path: Path) -> None:
    base, same, slower = (tmp_path / f"{n}.json" for n in ("base", "same", "slower"))
    base.write_text(json.dumps(_bench_result(0.10)))
    same.write_text(json.dumps(_bench_result(0.10)))
    slower.write_text(json.dumps(_bench_result(0.20)))
    assert_exit(sdserve("gate", "--baseline", str(base), "--candidate", str(slower)), ExitCode.GATE_REGRESSION,
                "REGRESSION")
    assert_exit(sdserve("gate", "--baseline", str(base), "--candidate", str(same)), ExitCode.OK, "no regression")
