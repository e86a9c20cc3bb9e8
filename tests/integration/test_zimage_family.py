"""Z-Image's two families on one architecture row, told apart by detection (engines/pipelines/flow_family.py
``detect_dit`` hands the family claims the scheduler config): a folder whose scheduler shifts by 3.0 (Turbo's
released config, engines/build/zimage.py) is ``z-image-turbo`` with its own defaults (8 steps, no CFG), the base
(shift 6.0) is ``z-image`` (50 steps, guidance 5), both as built in diffusers' layout and as exported to ONNX."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.build.dit import build_tiny_dit
from engines.pipelines.flow_family import detect_dit


@pytest.mark.parametrize(("family", "steps", "guidance"), [("z-image-turbo", 8, 0.0), ("z-image", 50, 5.0)])
def test_each_folder_is_detected_as_its_family(tmp_path: Path, family: str, steps: int, guidance: float) -> None:
    build_tiny_dit(family, tmp_path / "onnx", diffusers_out=tmp_path / "diffusers", vae_encoder=False)
    for folder in (tmp_path / "onnx", tmp_path / "diffusers"):
        found = detect_dit(folder)
        assert (found.name, found.base, found.steps, found.guidance) == (family, "z-image", steps, guidance)
