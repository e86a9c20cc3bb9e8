"""The model manifest covers every file, on a real `sdserve doctor` process: a changed, resized, missing or unlisted
file, or a file dropped from the manifest, each refuses boot with exit 23 naming the file; an edited manifest is
refused where its digest is pinned (runtime.manifest_sha256). Exempt on purpose: selftest.json and trt/."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engines.artifacts import file_table, verify_model

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT_INVALID = 23


def _doctor(model: Path, config: Path | None = None) -> subprocess.CompletedProcess[str]:
    extra = ["--config", str(config)] if config else []
    return subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--profile", "dev", "--model", str(model),
                           *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)


def _pinned_profile(tmp_path: Path, digest: str) -> Path:
    """configs/dev.toml with the manifest's digest pinned, as a deployment would pin it."""
    text = (ROOT / "configs" / "dev.toml").read_text(encoding="utf-8")
    assert "\n[runtime]\n" in text
    path = tmp_path / "dev-pinned.toml"
    path.write_text(text.replace("\n[runtime]\n", f'\n[runtime]\nmanifest_sha256 = "{digest}"\n', 1))
    return path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _flip_last_bytes(model: Path) -> None:
    with (model / "unet" / "model.onnx").open("r+b") as fh:  # same size: only the hash can tell
        fh.seek(-16, 2)
        fh.write(b"\x00" * 16)


def _grow_config(model: Path) -> None:
    with (model / "text_encoder" / "config.json").open("a") as fh:
        fh.write(" ")


def _drop_entry(model: Path) -> None:
    manifest = json.loads((model / "manifest.json").read_text())
    del manifest["files"]["scheduler/scheduler_config.json"]
    (model / "manifest.json").write_text(json.dumps(manifest))


def _plant(model: Path) -> None:
    (model / "unet" / "extra.onnx").write_bytes(b"planted")


TAMPERING: dict[str, tuple[Callable[[Path], None], str]] = {
    "changed": (_flip_last_bytes, "unet/model.onnx: sha256"),
    "resized": (_grow_config, "text_encoder/config.json: "),
    "missing": (lambda m: (m / "tokenizer" / "vocab.json").unlink(), "tokenizer/vocab.json: missing"),
    "unlisted": (_plant, "unet/extra.onnx: not in the manifest"),
    "entry dropped": (_drop_entry, "scheduler/scheduler_config.json: not in the manifest"),
}


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_each_tampering_refuses_boot_naming_the_file(tiny_model: Path, tmp_path: Path, case: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    tamper, needle = TAMPERING[case]
    tamper(model)
    done = _doctor(model)
    assert done.returncode == ARTIFACT_INVALID, done.stdout + done.stderr
    assert needle in done.stdout + done.stderr


def test_a_resigned_manifest_passes_unless_its_digest_is_pinned(tiny_model: Path, tmp_path: Path) -> None:
    """Whoever can write the folder can rewrite the manifest to match a changed file: only a digest kept outside the
    folder (the profile or deployment) can tell."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    pinned = _pinned_profile(tmp_path, _sha(model / "manifest.json"))
    assert _doctor(model, pinned).returncode == 0  # the genuine folder passes under its pin
    scheduler = model / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "beta_end": 0.02}))  # still loads
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"] = file_table(model, ("manifest.json",))
    (model / "manifest.json").write_text(json.dumps(manifest))
    assert _doctor(model).returncode == 0  # consistent again: without a pin nothing can see it
    done = _doctor(model, pinned)
    assert done.returncode == ARTIFACT_INVALID, done.stdout + done.stderr
    assert "manifest.json: sha256" in done.stdout and "runtime.manifest_sha256" in done.stdout


def test_selftest_record_and_trt_folder_are_exempt(tiny_model: Path, tmp_path: Path) -> None:
    """selftest.json is written after the manifest by `sdserve selftest --record`; trt/ by `sdserve engines build`,
    with its own manifest (checked when TensorRT is in the policy)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    pinned = _pinned_profile(tmp_path, _sha(model / "manifest.json"))
    recorded = subprocess.run([sys.executable, "-m", "server.cli", "selftest", "--profile", "dev", "--model",
                               str(model), "--record"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert recorded.returncode == 0, recorded.stderr
    assert (model / "selftest.json").is_file()
    (model / "trt" / "512x512").mkdir(parents=True)
    (model / "trt" / "512x512" / "unet_ctx.onnx").write_bytes(b"not loaded by a CPU profile")
    done = _doctor(model, pinned)
    assert done.returncode == 0, done.stdout + done.stderr


def test_size_mode_now_checks_sizes(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    _flip_last_bytes(model)
    verify_model(model, "size")  # same size: "size" cannot see a same-size change (documented trade-off)
    _grow_config(model)
    with pytest.raises(Exception, match=r"text_encoder/config.json: \d+ bytes, manifest says \d+"):
        verify_model(model, "size")


NODE = {"onnxruntime": "1.31.1", "cuda": "13.0", "cudnn_major": "9", "tensorrt": "10.13", "compute_capability": "9.0",
        "gpu": "NVIDIA H200", "driver": "580.95.05"}


def _fake_engines(model: Path) -> None:
    """trt/ as `sdserve engines build` leaves it for one size: EP-context models whose EPContext node names its
    engine relative to the context model (onnx_ctx_model_helper.cc, CreateCtxModel), the engines, the manifest."""
    import onnx
    from onnx import TensorProto, helper

    from engines.artifacts import COMPONENTS, write_engine_manifest

    size = model / "trt" / "512x512"
    (size / "engines").mkdir(parents=True)
    for component in COMPONENTS:
        engine = f"engines/TensorrtExecutionProvider_TRTKernel_{component}_sm90.engine"
        (size / engine).write_bytes(component.encode() * 64)
        node = helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", embed_mode=0,
                                ep_cache_context=engine, hardware_architecture="90", onnx_model_filename="model.onnx")
        graph = helper.make_graph([node], component, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(graph), str(size / f"{component}_ctx.onnx"))
    sources = {c: _sha(model / c / "model.onnx") for c in COMPONENTS}
    profile = {"width": 512, "height": 512, "batch_min": 1, "batch_opt": 4, "batch_max": 4, "name": "512x512"}
    write_engine_manifest(model / "trt", NODE, {"512x512": {
        "profile": profile, "context_models": {c: f"512x512/{c}_ctx.onnx" for c in COMPONENTS}}}, {"fp16": True},
        sources)


def test_artifacts_built_in_one_folder_verify_after_a_move(tiny_model: Path, tmp_path: Path) -> None:
    """Built under /build/..., served from /models/model: nothing in either manifest or the context models names the
    build folder, so the moved copy verifies and names its own context models."""
    from engines.artifacts import context_models, verify_engines

    built = tmp_path / "build" / "model"
    shutil.copytree(tiny_model, built)
    _fake_engines(built)
    moved = tmp_path / "models" / "model"
    shutil.copytree(built, moved)
    shutil.rmtree(tmp_path / "build")
    verify_model(moved, "full")
    assert verify_engines(moved, NODE, "full")["path"] == str(moved / "trt")
    found = context_models(moved)
    assert found["512x512"]["unet"] == moved / "trt" / "512x512" / "unet_ctx.onnx"
    assert all(path.is_file() for paths in found.values() for path in paths.values())
    for path in moved.rglob("*"):
        if path.is_file():
            assert str(tmp_path / "build").encode() not in path.read_bytes(), path
