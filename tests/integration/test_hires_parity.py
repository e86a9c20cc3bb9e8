"""Hires fix on the real pipeline, stage by stage against what A1111 and diffusers do (server/hires.py).

Stage 1 is txt2img (its parity with diffusers: tests/integration/test_parity.py); stage 2 is A1111's upscaler
(PIL's resamplers, tests/unit/test_a1111_compat.py; the latent modes against torch's interpolate, here);
stage 3 is the second pass: the upscaled images (or latents) through diffusers' StableDiffusionImg2ImgPipeline with
A1111's step arithmetic (modules/sd_samplers_common.py setup_img2img_steps: ``hr_second_pass_steps`` steps at the
end of a ``steps / denoising_strength`` schedule) on the same tiny weights and the same noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.pipelines.unet import StableDiffusionOnnx
from engines.types.model import ModelInfo
from engines.types.request import Batch, ImageSpec
from server.hires import LATENT_MODES, make_plan, second_pass, upscale, upscale_latents
from tests.integration.test_edit_parity import GUIDANCE, PROMPTS, SEEDS, Draws, _compare, _ours, _theirs

INFO = ModelInfo("tiny", 16, 64, SCHEDULER_NAMES, 77, modes=("txt2img", "img2img", "inpaint"),
                 edit_schedulers=SCHEDULER_NAMES)


class HiresDraws(Draws):
    """The per-image streams' draws at the second pass's latent size (128x128 pixels: 16x16 latents)."""

    def _draw(self) -> np.ndarray:
        return np.stack([r.standard_normal((4, 16, 16), dtype=np.float32) for r in self.rngs])


@pytest.fixture(scope="module")
def sd1(tiny_build: tuple[Path, Path]) -> StableDiffusionOnnx:
    return _ours(tiny_build[0])


@pytest.mark.parametrize(("upscaler", "steps", "strength"), [("Lanczos", 4, 0.5), ("Nearest", 0, 0.7)])
def test_the_second_pass_matches_diffusers_img2img_with_a1111s_steps(upscaler: str, steps: int, strength: float,
                                                                     sd1: StableDiffusionOnnx,
                                                                     tiny_build: tuple[Path, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    first = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  64, 64, 6, "euler")
    images = [Image.fromarray(a) for a in sd1(first).images]
    plan = make_plan(first, INFO, scale=2.0, upscaler=upscaler, steps=steps, denoising_strength=strength)
    batch = second_pass(first, images, plan, INFO)
    run = steps or first.steps
    assert (batch.width, batch.height, int(batch.steps * batch.strength)) == (128, 128, run)
    mine = sd1(batch)
    assert mine.steps_total == run  # exactly the second-pass steps A1111 runs

    onnx_dir, diffusers_dir = tiny_build
    draws = HiresDraws(encodes=1)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionImg2ImgPipeline", diffusers_dir, onnx_dir, "euler")
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[upscale(im, upscaler, 128, 128) for im in images], strength=batch.strength,
                      num_inference_steps=plan.schedule_steps, guidance_scale=GUIDANCE, output_type="np").images
    print(f"hires {upscaler}: max |diff| {_compare(mine.images, theirs, upscaler)}/255")


@pytest.mark.parametrize("mode", sorted({m for m in LATENT_MODES.values() if m is not None}))
@pytest.mark.parametrize(("size", "target"), [((8, 8), (16, 16)), ((8, 12), (13, 20)), ((6, 10), (15, 24))])
def test_latent_upscale_matches_torch_interpolate(mode: str, size: tuple[int, int],
                                                  target: tuple[int, int]) -> None:
    """A1111's sample_hr_pass: torch.nn.functional.interpolate(samples, size, mode, antialias=False)."""
    latents = np.random.default_rng(3).standard_normal((4, *size), dtype=np.float32)
    theirs = torch.nn.functional.interpolate(torch.from_numpy(latents)[None], size=target, mode=mode,
                                             antialias=False)[0].numpy()
    mine = upscale_latents(latents, *target, mode)
    assert mine.shape == theirs.shape and np.abs(mine - theirs).max() < 1e-5


def test_a_latent_second_pass_matches_diffusers_img2img_from_latents(sd1: StableDiffusionOnnx,
                                                                    tiny_build: tuple[Path, Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Hires fix with "Latent": the first pass's latents, resized bilinearly, are the second pass's init latents
    (diffusers' img2img takes a 4-channel image as latents); nothing is encoded, so the stream's first draw is the
    start noise on both sides."""
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    first = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, keep_latents=True)
                        for p, s in zip(PROMPTS, SEEDS, strict=True)), 64, 64, 6, "euler")
    out = sd1(first)
    assert out.latents is not None and out.latents.shape == (2, 4, 8, 8)
    plan = make_plan(first, INFO, scale=2.0, steps=3, denoising_strength=0.55)  # A1111's default: Latent
    batch = second_pass(first, [Image.fromarray(a) for a in out.images], plan, INFO, list(out.latents))
    mine = sd1(batch)
    assert mine.steps_total == 3

    onnx_dir, diffusers_dir = tiny_build
    draws = HiresDraws(encodes=0)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionImg2ImgPipeline", diffusers_dir, onnx_dir, "euler")
    upscaled = torch.nn.functional.interpolate(torch.from_numpy(out.latents), size=(16, 16), mode="bilinear")
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=upscaled, strength=batch.strength, num_inference_steps=plan.schedule_steps,
                      guidance_scale=GUIDANCE, output_type="np").images
    print(f"hires Latent: max |diff| {_compare(mine.images, theirs, 'latent')}/255")
