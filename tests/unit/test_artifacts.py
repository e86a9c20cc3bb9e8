"""Engine manifests bound to the node: another TensorRT or compute capability is refused, naming both values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.artifacts import compare_node, node_identity, verify_engines, write_engine_manifest
from engines.errors import ArtifactError

BUILT = {"onnxruntime": "1.31.1", "cuda": "13.0", "cudnn_major": "9", "tensorrt": "10.13", "compute_capability": "9.0",
         "gpu": "NVIDIA H200", "driver": "580.95.05"}


def observations(trt: str | None = "10.13.3", cc: str = "9.0") -> dict[str, object]:
    return {"onnxruntime": "1.31.1", "onnxruntime_cuda_build": "13.0", "cudnn": {"version": "9.14.0"},
            "tensorrt": {"version": trt}, "nvml": {"driver_version": "580.95.05", "devices": [
                {"name": "NVIDIA H200", "compute_capability": cc}]}}


def test_same_node_matches() -> None:
    assert compare_node(BUILT, node_identity(observations(), 0)) == []


@pytest.mark.parametrize(("obs", "expected"), [
    (observations(trt="11.0.1"), "tensorrt: artifact built with 10.13, this node has 11.0"),
    (observations(cc="8.9"), "compute_capability: artifact built with 9.0, this node has 8.9"),
    (observations(trt=None), "tensorrt: artifact built with 10.13, this node has none"),
])
def test_other_tensorrt_or_gpu_is_named(obs: dict[str, object], expected: str) -> None:
    assert expected in compare_node(BUILT, node_identity(obs, 0))


def test_verify_engines_refuses_mismatch_then_tampering(tmp_path: Path) -> None:
    trt = tmp_path / "trt"
    (trt / "engines").mkdir(parents=True)
    (trt / "engines" / "unet.engine").write_bytes(b"engine bytes")
    write_engine_manifest(trt, BUILT, [], {}, {})
    live = node_identity(observations(), 0)
    assert verify_engines(tmp_path, live, "full")["path"] == str(trt)
    with pytest.raises(ArtifactError, match="tensorrt: artifact built with 10.13, this node has 11.0"):
        verify_engines(tmp_path, node_identity(observations(trt="11.0.1"), 0), "full")
    (trt / "engines" / "unet.engine").write_bytes(b"engine bytez")
    with pytest.raises(ArtifactError, match="engines/unet.engine: sha256"):
        verify_engines(tmp_path, live, "full")
    assert verify_engines(tmp_path, live, "size")  # same size: the size check cannot see it (documented)
    manifest = json.loads((trt / "manifest.json").read_text())
    assert manifest["node"]["tensorrt"] == "10.13" and "engines/unet.engine" in manifest["files"]
