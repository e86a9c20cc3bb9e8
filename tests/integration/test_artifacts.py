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
from engines.build.trtplan import graph_inputs
from engines.config import RuntimeSettings
from engines.errors import ArtifactError
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=300)


def test_tiny_manifest_lists_every_file_and_the_build_versions(tiny_model: Path) -> None:
    manifest = json.loads((tiny_model / "manifest.json").read_text())
    on_disk = {p.relative_to(tiny_model).as_posix(): p.stat().st_size for p in tiny_model.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == set(on_disk) - {"manifest.json"}
    assert all(entry["bytes"] == on_disk[rel] for rel, entry in manifest["files"].items())  # sizes recorded
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
    assert list(plan["sizes"]) == ["512x512"]  # one engine per served size
    assert plan["sizes"]["512x512"]["profile"] | {"name": "512x512"} == {
        "width": 512, "height": 512, "batch_min": 1, "batch_opt": 4, "batch_max": 4, "name": "512x512"}
    components = plan["sizes"]["512x512"]["components"]
    unet = components["unet"]["provider_options"]
    assert unet["trt_profile_min_shapes"] == "sample:1x4x64x64,timestep:1,encoder_hidden_states:1x77x32"
    assert unet["trt_profile_max_shapes"] == "sample:8x4x64x64,timestep:8,encoder_hidden_states:8x77x32"
    assert unet["trt_dump_ep_context_model"] == "True" and unet["trt_fp16_enable"] == "True"
    assert unet["trt_engine_cache_path"] == "engines"  # relative to the context model (ORT's EP-context rule)
    assert unet["trt_ep_context_file_path"] == "trt/512x512/unet_ctx.onnx"
    assert components["vae_decoder"]["provider_options"]["trt_profile_max_shapes"] == "latent_sample:4x4x64x64"
    assert str(tiny_model) not in done.stdout  # nothing in the plan ties the artifacts to this folder


def test_optimum_style_symbolic_dims_plan_like_the_tiny_model(tiny_model: Path, tmp_path: Path) -> None:
    """optimum-cli exports name batch, sequence and channel dims; the plan resolves them from the configs to the same
    shapes as the tiny model's own export (the old planner set them to 1: encoder_hidden_states:8x1x32)."""
    import onnx

    symbolic = {"text_encoder": {"input_ids": ["batch_size", "sequence_length"]},
                "unet": {"sample": ["batch_size", "num_channels", "height", "width"], "timestep": ["steps"],
                         "encoder_hidden_states": ["batch_size", "sequence_length", "hidden_size"]},
                "vae_decoder": {"latent_sample": ["batch_size", "num_channels_latent", "height_latent",
                                                  "width_latent"]}}
    model = tmp_path / "optimum"
    shutil.copytree(tiny_model, model)
    for component, inputs in symbolic.items():
        graph = onnx.load(str(model / component / "model.onnx"))
        for value in graph.graph.input:
            for dim, name in zip(value.type.tensor_type.shape.dim, inputs.get(value.name, []), strict=False):
                dim.dim_param = name  # clears dim_value (a oneof)
        onnx.save(graph, str(model / component / "model.onnx"))
    assert graph_inputs(model / "unet" / "model.onnx")["encoder_hidden_states"] == symbolic["unet"][
        "encoder_hidden_states"]
    plans = [json.loads(_cli("engines", "build", "--profile", "production", "--model", str(m), "--dry-run").stdout)
             for m in (tiny_model, model)]
    ours, theirs = (p["sizes"]["512x512"]["components"] for p in plans)
    for component in ("text_encoder", "unet", "vae_decoder"):
        for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
            assert theirs[component]["provider_options"][key] == ours[component]["provider_options"][key]
    assert "encoder_hidden_states:8x77x32" in theirs["unet"]["provider_options"]["trt_profile_max_shapes"]


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
    # A passed gate is not enough for TensorRT: its ONNX parser imports neither op (onnx-tensorrt operators.md).
    for extra in ((), ("--dry-run",)):
        split = _cli("engines", "build", "--profile", "production", "--model", str(tmp_path / "q"), "--int8", *extra)
        assert split.returncode == 23, split.stdout + split.stderr
        assert "DynamicQuantizeLinear" in split.stderr and "MatMulInteger" in split.stderr
        assert "unet:" in split.stderr and "would split between providers" in split.stderr


def test_two_builds_give_the_same_hashes(tiny_model: Path, tmp_path: Path) -> None:
    """A second build in another process (another hash seed, no diffusers copy) is byte-identical, file by file."""
    import os

    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "tiny", "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert done.returncode == 0, done.stderr
    first = json.loads((tiny_model / "manifest.json").read_text())
    second = json.loads((tmp_path / "again" / "manifest.json").read_text())
    on_disk = {p.relative_to(tmp_path / "again").as_posix() for p in (tmp_path / "again").rglob("*") if p.is_file()}
    assert first["files"] == second["files"] and set(second["files"]) == on_disk - {"manifest.json"}
