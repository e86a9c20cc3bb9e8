"""Helpers for the tests that run on OpenVINO's plugin execution provider (the openvino profile): real processes,
the tiny model, artifacts built once per session (tests/conftest.py ``openvino_model``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from engines.artifacts import ep_dir, file_table, sha256_file, write_model_manifest
from server.settings import CONFIG_DIR

EP = "OpenVINOExecutionProvider"
ARTIFACTS = ep_dir(EP)
PROFILE = CONFIG_DIR / "openvino.toml"


def sdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


def build_artifacts(source: Path, dest: Path) -> Path:
    """``source`` copied to ``dest`` and `sdserve engines build --profile openvino` run on it (asserted to pass)."""
    shutil.copytree(source, dest)
    done = sdserve("engines", "build", "--profile", "openvino", "--model", str(dest))
    assert done.returncode == 0, done.stderr[-3000:]
    return dest


def profile(tmp_path: Path, replace: dict[str, str] | None = None, append: str = "") -> Path:
    """configs/openvino.toml with exact-text replacements: a profile for one test."""
    text = PROFILE.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "openvino.toml"
    path.write_text(text + append)
    return path


def resign(root: Path) -> None:
    """Rewrite the files table of ``root``'s artifact manifest to what is on disk (as a rebuild would)."""
    manifest = root / "manifest.json"
    data = json.loads(manifest.read_text())
    data["files"] = file_table(root)
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True))


def listing(folder: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime_ns) of every file under ``folder``: equal listings mean nothing was written."""
    return {p.relative_to(folder).as_posix(): (sha256_file(p), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def with_cpu_node(source: Path, dest: Path) -> str:
    """A copy of ``source`` whose VAE decoder output goes through a ``Det`` node (which OpenVINO's EP does not take,
    so ONNX Runtime leaves it on the CPU) on the activation path: ``sample + 0 * Det(sample[..., :2, :2])``. The model
    manifest is re-signed so only the placement is wrong. Returns the Det node's name."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("ep"))
    path = dest / "vae_decoder" / "model.onnx"
    model = onnx.load(str(path))
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "pre_det"
    consts = {"starts": [0, 0], "ends": [2, 2], "axes": [2, 3], "zero": 0.0, "unsq": [2, 3]}
    for name, value in consts.items():
        graph.initializer.append(numpy_helper.from_array(
            np.array(value, dtype=np.float32 if name == "zero" else np.int64), f"det_{name}"))
    det = "cpu_only_Det"
    graph.node.extend([
        helper.make_node("Slice", ["pre_det", "det_starts", "det_ends", "det_axes"], ["det_in"], name="det_slice"),
        helper.make_node("Det", ["det_in"], ["det_out"], name=det),
        helper.make_node("Mul", ["det_out", "det_zero"], ["det_zeroed"], name="det_mul"),
        helper.make_node("Unsqueeze", ["det_zeroed", "det_unsq"], ["det_4d"], name="det_unsqueeze"),
        helper.make_node("Add", ["pre_det", "det_4d"], [out], name="det_add")])
    onnx.save(model, str(path))
    data = json.loads((dest / "manifest.json").read_text())
    write_model_manifest(dest, {k: v for k, v in data.items() if k not in ("files", "format")})
    return det
