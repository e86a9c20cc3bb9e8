"""A1111's inpainting_fill 2 (latent noise) and 3 (latent nothing) on the real pipeline, against diffusers' 4-channel
inpainting pipeline given the same init latents A1111 makes.

AUTOMATIC1111/stable-diffusion-webui modules/processing.py StableDiffusionProcessingImg2Img.init: after encoding,
``init_latent = init_latent * mask + create_random_tensors(...) * nmask`` (fill 2) or ``init_latent * mask``
(fill 3), where ``nmask`` is the mask at latent size and the random tensors come from a fresh generator of the
image's seed: the same numbers as its start noise. The diffusers side gets exactly that through its
``_encode_vae_image``; the rest (noising to the first step, the per-step blend) is diffusers' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.pipelines.unet import StableDiffusionOnnx
from engines.types.request import Batch, EditImage, ImageSpec, LatentFill
from tests.integration.test_edit_parity import (
    GUIDANCE,
    PROMPTS,
    SEEDS,
    SIZE,
    STEPS,
    Draws,
    _compare,
    _ours,
    _theirs,
    init_image,
    square_mask,
)


@pytest.fixture(scope="module")
def sd1(tiny_build: tuple[Path, Path]) -> StableDiffusionOnnx:
    return _ours(tiny_build[0])


def _batch(fill: LatentFill) -> Batch:
    edit = EditImage(init_image(), square_mask(), fill)
    return Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, edit=edit) for p, s in zip(PROMPTS, SEEDS,
                                                                                                 strict=True)),
                 SIZE, SIZE, STEPS, "euler", strength=0.75, overlay=False)


@pytest.mark.parametrize("fill", ["noise", "nothing"])
def test_latent_fill_matches_a1111s_init_latent_on_diffusers(fill: LatentFill, sd1: StableDiffusionOnnx,
                                                              tiny_build: tuple[Path, Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

    onnx_dir, diffusers_dir = tiny_build
    draws = Draws(encodes=2)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionInpaintPipeline", diffusers_dir, onnx_dir, "euler")
    nmask = torch.from_numpy((square_mask()[::8, ::8] >= 128).astype(np.float32))[None, None]
    source = torch.from_numpy(draws.noise.copy()) if fill == "noise" else torch.zeros(draws.noise.shape)
    encode = pipe._encode_vae_image

    def a1111_init_latent(image: torch.Tensor, generator: Any) -> torch.Tensor:
        latents = encode(image=image, generator=generator)
        return latents * (1 - nmask) + source.to(latents.dtype) * nmask

    monkeypatch.setattr(pipe, "_encode_vae_image", a1111_init_latent)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2,
                      mask_image=[Image.fromarray(square_mask())] * 2, strength=0.75, num_inference_steps=STEPS,
                      guidance_scale=GUIDANCE, height=SIZE, width=SIZE, output_type="np").images
    mine = sd1(_batch(fill)).images
    print(f"latent {fill}: max |diff| {_compare(mine, theirs, fill)}/255")
    original = sd1(_batch("original")).images
    inside = square_mask() >= 128
    changed = np.abs(mine.astype(np.int16) - original.astype(np.int16)).max(axis=-1) > 8
    assert changed[:, inside].mean() > 0.3  # the fill changed what the masked area starts from
