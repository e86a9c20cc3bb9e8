"""Artifacts on the tiny model, on this CPU machine: manifests, tampering, the optimizer, the build plan, INT8 gate."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engines.artifacts import verify_model
from engines.config import RuntimeSettings
from engines.diffusion.pipeline import StableDiffusionOnnx
from engines.errors import ArtifactError
from engines.protocol import Batch, ImageSpec
from engines.runtime.sessions import Runtime

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=300)


def test_tiny_manifest_lists_every_file_and_the_build_versions(tiny_model: Path) -> None:
    manifest = json.loads((tiny_model / "manifest.json").read_text())
    on_disk = {p.relative_to(tiny_model).as_posix() for p in tiny_model.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == on_disk - {"manifest.json"}
    assert {"torch", "diffusers", "onnx", "sdserve"} <= set(manifest["built_with"])
    verify_model(tiny_model, "full")


def test_tampered_file_is_refused_naming_the_file(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    with (model / "vae_decoder" / "model.onnx").open("r+b") as fh:
        fh.seek(-16, 2)
        fh.write(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="vae_decoder/model.onnx: sha256"):
        verify_model(model, "full")
    done = _cli("doctor", "--profile", "dev", "--model", str(model))
    assert done.returncode == 23, done.stdout + done.stderr  # ExitCode.ARTIFACT_INVALID
    assert "vae_decoder/model.onnx" in done.stdout


def test_optimize_lists_fusions_and_stays_within_tolerance(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "opt"
    done = _cli("engines", "optimize", "--model", str(tiny_model), "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "optimize.json").read_text())
    fused = report["components"]["text_encoder"]["fusions"]
    assert fused.get("SkipLayerNormalization", 0) > 0 and fused.get("QuickGelu", 0) > 0
    assert report["components"]["unet"]["fusions"].get("SkipLayerNormalization", 0) > 0
    for component in report["components"].values():
        assert component["max_abs_diff_vs_unoptimized"] < 1e-4
        assert component["nodes_after"] <= component["nodes_before"]
    verify_model(out, "full")  # a fresh manifest for the optimized folder
    batch = Batch((ImageSpec("a lighthouse", seed=4),), 64, 64, 8, "ddim")
    ours = StableDiffusionOnnx(tiny_model, Runtime(CPU))(batch).images
    optimized = StableDiffusionOnnx(out, Runtime(CPU))(batch).images
    assert np.abs(ours.astype(int) - optimized.astype(int)).max() <= 1


def test_build_dry_run_prints_provider_options_and_plan(tiny_model: Path) -> None:
    done = _cli("engines", "build", "--profile", "production", "--model", str(tiny_model), "--dry-run")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert [p["name"] for p in plan["profiles"]] == ["512x512xb1-4"]
    unet = plan["components"]["unet"]["provider_options"]
    assert unet["trt_profile_min_shapes"].startswith("sample:2x4x64x64,")
    assert "sample:8x4x64x64" in unet["trt_profile_max_shapes"]
    assert unet["trt_dump_ep_context_model"] == "True" and unet["trt_fp16_enable"] == "True"
    assert plan["components"]["vae_decoder"]["provider_options"]["trt_profile_max_shapes"] == "latent_sample:4x4x64x64"


def test_build_without_tensorrt_fails_closed(tiny_model: Path) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("asserts the behaviour of a machine without a GPU")
    done = _cli("engines", "build", "--profile", "production", "--model", str(tiny_model))
    assert done.returncode == 20 and "libnvinfer.so.10" in done.stderr


def test_int8_needs_the_accuracy_gate(tiny_model: Path, tmp_path: Path) -> None:
    refused = _cli("engines", "build", "--profile", "production", "--model", str(tiny_model), "--int8")
    assert refused.returncode == 23 and "no passed accuracy gate" in refused.stderr
    strict = _cli("engines", "quantize", "--model", str(tiny_model), "--out", str(tmp_path / "q0"),
                  "--max-distance", "0.01")
    assert strict.returncode == 23 and "over the bound 0.01" in strict.stderr
    assert not (tmp_path / "q0").exists()
    passed = _cli("engines", "quantize", "--model", str(tiny_model), "--out", str(tmp_path / "q"))
    assert passed.returncode == 0, passed.stderr
    gate = json.loads((tmp_path / "q" / "manifest.json").read_text())["int8_gate"]
    assert gate["passed"] and gate["max_distance"] <= gate["bound"]
    verify_model(tmp_path / "q", "full")


def test_two_builds_give_the_same_hashes(tiny_model: Path, tmp_path: Path) -> None:
    """A second build in another process (another hash seed, no diffusers copy) is byte-identical, file by file."""
    import os

    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "tiny", "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert done.returncode == 0, done.stderr
    first = json.loads((tiny_model / "manifest.json").read_text())
    second = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert first["files"] == second["files"] and len(first["files"]) == 13
