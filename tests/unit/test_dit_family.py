"""DiT family detection from a folder's model_index.json and transformer config, and refusals by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.errors import ModelLoadError
from engines.pipelines.flow_family import detect_dit, is_dit_folder


def _folder(root: Path, class_name: str, transformer: dict[str, Any] | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name}), encoding="utf-8")
    if transformer is not None:
        (root / "transformer").mkdir()
        (root / "transformer" / "config.json").write_text(json.dumps(transformer), encoding="utf-8")
    return root


@pytest.mark.parametrize(("class_name", "transformer", "family", "steps", "cfg"), [
    ("FluxPipeline", {"_class_name": "FluxTransformer2DModel", "guidance_embeds": True}, "flux", 28, False),
    ("FluxPipeline", {"_class_name": "FluxTransformer2DModel", "guidance_embeds": False}, "flux-schnell", 4, False),
    ("OnnxFluxPipeline", {"guidance_embeds": False}, "flux-schnell", 4, False),
    ("FluxKontextPipeline", {"_class_name": "FluxTransformer2DModel", "guidance_embeds": True}, "flux-kontext", 28,
     False),
    ("OnnxFluxKontextPipeline", {"guidance_embeds": True}, "flux-kontext", 28, False),
    ("StableDiffusion3Pipeline", {"_class_name": "SD3Transformer2DModel", "qk_norm": None,
                                  "dual_attention_layers": []}, "sd3", 28, True),
    ("StableDiffusion3Pipeline", {"qk_norm": "rms_norm", "dual_attention_layers": []}, "sd35", 28, True),
    ("OnnxStableDiffusion3Pipeline", {"qk_norm": "rms_norm", "dual_attention_layers": [0, 1]}, "sd35", 28, True),
    ("Flux2Pipeline", {"_class_name": "Flux2Transformer2DModel", "guidance_embeds": True}, "flux2-dev", 50, False),
    ("OnnxFlux2Pipeline", {"guidance_embeds": True}, "flux2-dev", 50, False),
])
def test_families_are_detected(tmp_path: Path, class_name: str, transformer: dict[str, Any], family: str,
                               steps: int, cfg: bool) -> None:
    found = detect_dit(_folder(tmp_path / "m", class_name, transformer))
    assert (found.name, found.steps, found.cfg) == (family, steps, cfg)
    assert found.guidance_embeds == (family in ("flux", "flux-kontext", "flux2-dev"))
    assert found.max_sequence_length == (512 if family in ("flux", "flux-kontext", "flux2-dev") else 256)


@pytest.mark.parametrize(("class_name", "named"), [
    ("FluxKontextInpaintPipeline", "Flux.1 Kontext inpainting"),
    ("OnnxFluxKontextInpaintPipeline", "Kontext inpainting"),
    ("Flux2KleinKVPipeline", r"FLUX\.2 \[klein\] with a reference-image KV cache"),
    ("Flux2KleinInpaintPipeline", r"FLUX\.2 \[klein\] inpainting"),
    ("FluxFillPipeline", "Flux.1 Fill"),
    ("FluxControlPipeline", "control"), ("StableDiffusion3ControlNetPipeline", "ControlNet"),
])
def test_unsupported_dit_folders_are_refused_by_name(tmp_path: Path, class_name: str, named: str) -> None:
    folder = _folder(tmp_path / "m", class_name, {"_class_name": "FluxTransformer2DModel"})
    assert is_dit_folder(folder)
    with pytest.raises(ModelLoadError, match=named) as caught:
        detect_dit(folder)
    assert class_name in str(caught.value) and "serves Flux.1 dev/schnell" in str(caught.value)


def test_a_flux_folder_with_another_transformer_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", "FluxPipeline", {"_class_name": "Flux2Transformer2DModel"})
    with pytest.raises(ModelLoadError, match="Flux2Transformer2DModel"):
        detect_dit(folder)


def test_unet_folders_and_broken_dit_folders(tmp_path: Path) -> None:
    assert not is_dit_folder(_folder(tmp_path / "sd", "StableDiffusionPipeline", None))
    assert not is_dit_folder(tmp_path / "missing")
    with pytest.raises(ModelLoadError, match="not a DiT family"):
        detect_dit(tmp_path / "sd")
    with pytest.raises(ModelLoadError, match=r"no transformer/config\.json"):
        detect_dit(_folder(tmp_path / "flux", "FluxPipeline", None))
