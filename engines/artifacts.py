"""Model and engine artifacts: manifests bound to the version matrix, verified at boot.

A model folder's ``manifest.json`` lists the sha256 of every file. TensorRT engines live in ``<model>/trt/`` with
their own manifest: the profiles and build flags, the ORT / CUDA / cuDNN / TensorRT versions, GPU name, compute
capability and driver they were built with, and the sha256 of every file. In production the server never builds an
engine on the node: a manifest that does not match the live node is refused, naming each difference.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from engines.errors import ArtifactError

TRT_DIR = "trt"
VerifyMode = Literal["full", "size", "off"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_table(folder: Path, exclude: tuple[str, ...] = ("manifest.json",)) -> dict[str, dict[str, Any]]:
    return {p.relative_to(folder).as_posix(): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in exclude}


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"manifest {path} is missing") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"manifest {path} is not JSON: {exc}") from None
    return data


def _expected(entry: Any) -> tuple[str, int | None]:
    """Model manifests store ``path: sha256``; engine manifests ``path: {sha256, bytes}``."""
    if isinstance(entry, str):
        return entry, None
    return str(entry["sha256"]), int(entry["bytes"]) if "bytes" in entry else None


def verify_files(folder: Path, manifest: dict[str, Any], mode: VerifyMode) -> list[str]:
    """Differences between the files on disk and the manifest; empty when they match."""
    if mode == "off":
        return []
    problems = []
    for rel, entry in sorted(manifest.get("files", {}).items()):
        path = folder / rel
        digest, size = _expected(entry)
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif mode == "size" and size is not None and path.stat().st_size != size:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {size}")
        elif mode == "full" and sha256_file(path) != digest:
            problems.append(f"{rel}: sha256 {sha256_file(path)[:12]}… differs from the manifest's {digest[:12]}…")
    return problems


def verify_model(folder: Path, mode: VerifyMode) -> None:
    """The model folder against its manifest.json; raises ArtifactError naming every tampered file."""
    if mode == "off":
        return
    problems = verify_files(folder, read_manifest(folder / "manifest.json"), mode)
    if problems:
        raise ArtifactError(f"model folder {folder} does not match its manifest: " + "; ".join(problems))


NODE_KEYS = ("onnxruntime", "cuda", "cudnn_major", "tensorrt", "compute_capability")


def node_identity(observations: dict[str, Any], device_id: int) -> dict[str, str | None]:
    """What an engine is bound to, read from preflight observations."""
    devices = observations.get("nvml", {}).get("devices", [])
    device = devices[device_id] if device_id < len(devices) else {}
    cudnn = observations.get("cudnn", {}).get("version")
    trt = observations.get("tensorrt", {}).get("version")
    return {"onnxruntime": observations.get("onnxruntime"), "cuda": observations.get("onnxruntime_cuda_build"),
            "cudnn_major": cudnn.split(".")[0] if cudnn else None,
            "tensorrt": ".".join(trt.split(".")[:2]) if trt else None,
            "compute_capability": device.get("compute_capability"), "gpu": device.get("name"),
            "driver": observations.get("nvml", {}).get("driver_version")}


def compare_node(built: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """Each binding key whose artifact value differs from the node's, naming both."""
    return [f"{key}: artifact built with {built.get(key)!s}, this node has {live.get(key) or 'none'}"
            for key in NODE_KEYS if str(built.get(key)) != str(live.get(key))]


def verify_engines(folder: Path, live: dict[str, Any], mode: VerifyMode) -> dict[str, Any]:
    """``<model>/trt``: manifest bound to this node's versions and GPU, every file intact."""
    trt = folder / TRT_DIR
    manifest = read_manifest(trt / "manifest.json")
    problems = compare_node(manifest.get("node", {}), live)
    if problems:
        raise ArtifactError("TensorRT engines do not match this node (rebuild them with `sdserve engines build` on "
                            "the deployed versions): " + "; ".join(problems))
    problems = verify_files(trt, manifest, mode)
    if problems:
        raise ArtifactError(f"TensorRT artifacts in {trt} do not match their manifest: " + "; ".join(problems))
    return {"path": str(trt), "profiles": manifest.get("profiles", []),
            "cache_read_only": not os.access(trt, os.W_OK)}


def write_engine_manifest(trt: Path, node: dict[str, Any], profiles: list[dict[str, Any]], flags: dict[str, Any],
                          model: dict[str, str]) -> Path:
    path = trt / "manifest.json"
    data = {"format": 1, "model": model, "node": node, "profiles": profiles, "build_flags": flags,
            "files": file_table(trt)}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path
