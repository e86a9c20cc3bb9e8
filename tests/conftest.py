"""Shared fixtures: the tiny model built once per test session, from the same code `make run` uses."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(ONNX folder, diffusers folder) of the tiny model with identical weights."""
    from engines.build.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    onnx_dir, diffusers_dir = root / "onnx", root / "diffusers"
    build_tiny(onnx_dir, diffusers_out=diffusers_dir)
    return onnx_dir, diffusers_dir


@pytest.fixture(scope="session")
def tiny_model(tiny_build: tuple[Path, Path]) -> Path:
    return tiny_build[0]


@pytest.fixture(scope="session")
def openvino_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model with OpenVINO EP-context artifacts, built by a real `sdserve engines build --profile
    openvino` process (tests/plugin_ep.py); the tests that change it work on their own copies."""
    from tests.plugin_ep import build_artifacts

    return build_artifacts(tiny_model, tmp_path_factory.mktemp("openvino") / "model")
