"""Engine manifests bound to the node and the model: another TensorRT or compute capability is refused, naming both
values; every file in trt/ is listed; context models point at engines inside their folder; manifests are movable."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from pydantic import ValidationError

from engines.artifacts import (
    compare_node,
    context_models,
    node_identity,
    verify_engines,
    verify_files,
    verify_model,
    write_engine_manifest,
    write_model_manifest,
)
from engines.config import RuntimeSettings
from engines.errors import ArtifactError
from engines.types.snapshot import EngineArtifacts

BUILT = {"onnxruntime": "1.31.1", "cuda": "13.0", "cudnn_major": "9", "tensorrt": "10.13", "compute_capability": "9.0",
         "gpu": "NVIDIA H200", "driver": "580.95.05"}


def observations(trt: str | None = "10.13.3", cc: str = "9.0") -> dict[str, object]:
    return {"onnxruntime": "1.31.1", "onnxruntime_cuda_build": "13.0", "cudnn": {"version": "9.14.0"},
            "tensorrt": {"version": trt}, "nvml": {"driver_version": "580.95.05", "devices": [
                {"index": 0, "name": "NVIDIA H200", "compute_capability": cc}]}}


LIVE = node_identity(observations(), 0)


def ctx_model(path: Path, cache: str) -> None:
    """An EP-context model as ORT's TensorRT provider dumps it (onnx_ctx_model_helper.cc, CreateCtxModel): one
    com.microsoft EPContext node with embed_mode, ep_cache_context, hardware_architecture, onnx_model_filename."""
    node = helper.make_node("EPContext", ["sample"], ["out"], domain="com.microsoft", embed_mode=0,
                            ep_cache_context=cache, hardware_architecture="90", onnx_model_filename="model.onnx")
    x = helper.make_tensor_value_info("sample", TensorProto.FLOAT, [1])
    graph = helper.make_graph([node], "ctx", [x], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("com.microsoft", 1)]), str(path))


def engine_folder(model: Path, cache: str = "engines/unet.engine") -> Path:
    """A model folder with one file and a trt/ holding one size's context model and engine, plus the manifests."""
    (model / "unet").mkdir(parents=True)
    (model / "unet" / "model.onnx").write_bytes(b"unet graph")
    write_model_manifest(model, {})
    trt = model / "trt"
    ctx_model(trt / "512x512" / "unet_ctx.onnx", cache)
    (trt / "512x512" / "engines").mkdir()
    (trt / "512x512" / "engines" / "unet.engine").write_bytes(b"engine bytes")
    profile = {"width": 512, "height": 512, "batch_min": 1, "batch_opt": 4, "batch_max": 4, "name": "512x512"}
    sizes = {"512x512": {"profile": profile, "context_models": {"unet": "512x512/unet_ctx.onnx"}}}
    model_sha = json.loads((model / "manifest.json").read_text())["files"]["unet/model.onnx"]["sha256"]
    write_engine_manifest(trt, BUILT, sizes, {"fp16": True}, {"unet": model_sha})
    return trt


def test_same_node_matches() -> None:
    assert compare_node(BUILT, LIVE) == []


@pytest.mark.parametrize(("obs", "expected"), [
    (observations(trt="11.0.1"), "tensorrt: artifact built with 10.13, this node has 11.0"),
    (observations(cc="8.9"), "compute_capability: artifact built with 9.0, this node has 8.9"),
    (observations(trt=None), "tensorrt: artifact built with 10.13, this node has none"),
])
def test_other_tensorrt_or_gpu_is_named(obs: dict[str, object], expected: str) -> None:
    assert expected in compare_node(BUILT, node_identity(obs, 0))


def test_verify_engines_refuses_mismatch_then_tampering(tmp_path: Path) -> None:
    trt = engine_folder(tmp_path / "model")
    found = verify_engines(tmp_path / "model", LIVE, "full")
    assert found["path"] == str(trt)
    # what the engine puts in the capability snapshot must fit the protocol's type (extra keys are refused there)
    assert EngineArtifacts.model_validate(found).profiles[0]["name"] == "512x512"
    with pytest.raises(ArtifactError, match="tensorrt: artifact built with 10.13, this node has 11.0"):
        verify_engines(tmp_path / "model", node_identity(observations(trt="11.0.1"), 0), "full")
    engine = trt / "512x512" / "engines" / "unet.engine"
    engine.write_bytes(b"engine bytez")
    with pytest.raises(ArtifactError, match="512x512/engines/unet.engine: sha256"):
        verify_engines(tmp_path / "model", LIVE, "full")
    assert verify_engines(tmp_path / "model", LIVE, "size")  # same size: only the hash can see it
    engine.write_bytes(b"engine bytes, longer")
    with pytest.raises(ArtifactError, match="512x512/engines/unet.engine: 20 bytes, manifest says 12"):
        verify_engines(tmp_path / "model", LIVE, "size")
    manifest = json.loads((trt / "manifest.json").read_text())
    assert manifest["node"]["tensorrt"] == "10.13" and manifest["profiles"][0]["name"] == "512x512"


def test_an_unlisted_file_in_trt_is_refused(tmp_path: Path) -> None:
    trt = engine_folder(tmp_path / "model")
    (trt / "512x512" / "engines" / "planted.engine").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="512x512/engines/planted.engine: not in the manifest"):
        verify_engines(tmp_path / "model", LIVE, "full")


def test_engines_of_another_model_are_refused(tmp_path: Path) -> None:
    model = tmp_path / "model"
    engine_folder(model)
    (model / "unet" / "model.onnx").write_bytes(b"another unet")
    write_model_manifest(model, {})  # a consistent model folder, but not the one the engines were built from
    verify_model(model, "full")
    with pytest.raises(ArtifactError, match="unet: engines built from sha256"):
        verify_engines(model, LIVE, "full")


@pytest.mark.parametrize("cache", ["/models/old/trt/512x512/engines/unet.engine", "../../elsewhere/unet.engine"])
def test_a_context_model_pointing_outside_its_folder_is_refused(tmp_path: Path, cache: str) -> None:
    """ORT refuses these at load (onnx_ctx_model_helper.cc, GetEpContextFromGraph): refused here first, by name."""
    engine_folder(tmp_path / "model", cache)
    with pytest.raises(ArtifactError, match="ep_cache_context .* is not a relative path inside 512x512/"):
        verify_engines(tmp_path / "model", LIVE, "full")


def test_a_moved_folder_still_verifies_and_names_its_own_context_models(tmp_path: Path) -> None:
    built = tmp_path / "build" / "model"
    engine_folder(built)
    moved = tmp_path / "models" / "model"
    shutil.copytree(built, moved)
    shutil.rmtree(tmp_path / "build")
    verify_model(moved, "full")
    verify_engines(moved, LIVE, "full")
    assert context_models(moved) == {"512x512": {"unet": moved / "trt" / "512x512" / "unet_ctx.onnx"}}
    for text in ((moved / "manifest.json").read_text(), (moved / "trt" / "manifest.json").read_text()):
        assert str(tmp_path) not in text


def test_size_mode_refuses_entries_without_a_size(tmp_path: Path) -> None:
    """Format 1 manifests stored only hashes: "size" would check nothing, so it says so."""
    (tmp_path / "model.onnx").write_bytes(b"graph")
    assert verify_files(tmp_path, {"files": {"model.onnx": "0" * 64}}, "size") == [
        "model.onnx: the manifest records no size (format 1): re-export the model to record sizes"]


def test_a_pinned_digest_needs_verification_on() -> None:
    digest = "ab" * 32
    assert RuntimeSettings(manifest_sha256=digest).manifest_sha256 == digest
    with pytest.raises(ValidationError, match="manifest_sha256 is pinned but runtime.verify is off"):
        RuntimeSettings(manifest_sha256=digest, verify="off")
    with pytest.raises(ValidationError, match="manifest_sha256"):
        RuntimeSettings(manifest_sha256="not-a-digest")


def test_link_tree_links_weights_copies_what_a_node_rewrites_and_skips_artifacts(tmp_path: Path) -> None:
    import os

    from engines.artifacts import link_tree

    src = tmp_path / "src"
    (src / "unet").mkdir(parents=True)
    (src / "trt" / "64x64").mkdir(parents=True)
    (src / "unet" / "model.onnx_data").write_bytes(b"w" * 4096)
    (src / "manifest.json").write_text("{}")
    (src / "trt" / "64x64" / "unet_ctx.onnx").write_bytes(b"ctx")
    done = link_tree(src, tmp_path / "dst")
    dst = tmp_path / "dst"
    assert os.stat(dst / "unet" / "model.onnx_data").st_ino == os.stat(src / "unet" / "model.onnx_data").st_ino
    assert os.stat(dst / "manifest.json").st_ino != os.stat(src / "manifest.json").st_ino
    assert not (dst / "trt").exists()
    assert (done.linked, done.linked_bytes, done.copied) == (1, 4096, 1)
    if os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:  # another filesystem: copied, not failed
        import tempfile

        with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
            across = link_tree(src, Path(other) / "dst")
            assert (across.linked, across.copied) == (0, 2)
