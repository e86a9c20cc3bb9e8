"""LoRA on the FLUX.2 [dev] transformer (its guidance embedder included), on real ONNX Runtime sessions of the tiny
model, against diffusers' ``Flux2Pipeline.load_lora_weights`` + ``fuse_lora(lora_scale=s)`` on the same PEFT file
(src/diffusers/loaders/lora_pipeline.py ``Flux2LoraLoaderMixin``: the transformer only); a file that also adapts the
Mistral text encoder is listed refused by name. ORT runs the graphs with its CPU provider
(onnxruntime/core/providers/cpu: fp32 kernels)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.pipelines.contract import image_rng
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
SEEDS = [11, 12]
STEPS, GUIDANCE, SIZE, MULTIPLIER = 3, 4.0, 64, 0.8
TARGETS = lf.FLUX2_TARGETS[:-1] + r"|guidance_embedder\.linear_[12])"
"""Every Linear of the FLUX.2 transformer, dev's guidance embedder too."""

Builder = Callable[[str], tuple[Path, Path]]


def _batch(uses: tuple[LoraUse, ...] = ()) -> Batch:
    return Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS,
                                                                                         strict=True)),
                 SIZE, SIZE, STEPS, loras=uses)


def _diffusers_images(diffusers_dir: Path, lora: Path) -> np.ndarray:
    import diffusers

    pipe = diffusers.Flux2Pipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.fuse_lora(lora_scale=MULTIPLIER)
    noise = np.stack([image_rng(s).standard_normal((128, SIZE // 16, SIZE // 16), dtype=np.float32)
                      for s in SEEDS])
    with torch.no_grad():
        images = pipe(prompt=PROMPTS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                      latents=torch.from_numpy(noise), max_sequence_length=512, output_type="np").images
    return np.asarray((images * 255).round().astype(np.uint8))


def test_transformer_lora_matches_diffusers_and_text_encoder_keys_are_refused(dit_build: Builder,
                                                                              tmp_path: Path) -> None:
    import diffusers
    from safetensors.torch import load_file

    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, TARGETS, 4, seed=5, scale=2.0)
    assert any("guidance_embedder" in k for k in factors)
    path = lf.peft_file(tmp_path / "dev_peft.safetensors", {"transformer": factors})
    with_te = lf.save_safetensors(tmp_path / "dev_with_te.safetensors", {
        **load_file(str(path)), "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 64), .1),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((64, 4), 0.1)})
    engine = OrtEngine(onnx_dir, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                                 lora=LoraSettings(dir=str(tmp_path))))
    engine.load()
    try:
        listed = {f.name: f for f in engine.loras()}
        assert not listed["dev_peft"].problem, listed["dev_peft"].problem
        refused = listed[with_te.stem].problem
        assert "adapts text_encoder" in refused and "Mistral" in refused and "Flux2LoraLoaderMixin" in refused
        base = np.stack([np.asarray(i.image) for i in engine.generate(_batch()).images])
        use = LoraUse("dev_peft", listed["dev_peft"].sha256, MULTIPLIER, MULTIPLIER)
        result = engine.generate(_batch((use,)))
    finally:
        engine.close()
    mine = np.stack([np.asarray(i.image) for i in result.images])
    assert result.adapted == ("transformer",)
    theirs = _diffusers_images(diffusers_dir, path)
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert (diff <= 1).mean() >= 0.999 and diff.max() <= 3, f"max difference {diff.max()}/255"
    assert theirs.std() > 10
    assert (np.abs(mine.astype(np.int16) - base.astype(np.int16)) > 2).mean() > 0.05  # the LoRA moved the image
