"""Edits (img2img, inpainting) vs diffusers' torch pipelines on the same tiny weights and the same noise.

diffusers draws its noise from torch generators; ours comes from per-image numpy streams. The patched
``randn_tensor`` of each diffusers module answers every draw with what our stream drew for it (the encoder's sample
noise in vae.py, the start noise in the pipeline, the ancestral noise in the scheduler), so both sides compute on
the same numbers and the comparison sees only the pipeline: encoding and sampling the latent distribution,
strength -> first step, add_noise per sampler, the per-step inpainting blend and the 9-channel UNet input.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.build.tiny import build_tiny
from engines.config import RuntimeSettings
from engines.health import selftest
from engines.pipelines.contract import image_rng
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "ddim": "DDIMScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler"}
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [21, 22]
SIZE, STEPS, GUIDANCE = 64, 10, 7.5
LATENT = (4, SIZE // 8, SIZE // 8)


def init_image() -> np.ndarray:
    """A smooth, structured 64x64 RGB picture (not noise), the same on both sides."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x + 4 * y)], axis=-1)
    return (rgb * 255).round().astype(np.uint8)


def square_mask() -> np.ndarray:
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 20:52] = 255
    return mask


class Draws:
    """Our per-image streams' draws, in our order (start noise, image encoder noise, masked-image encoder noise,
    then step noise), answered to diffusers in its order."""

    def __init__(self, encodes: int) -> None:
        self.rngs = [image_rng(s) for s in SEEDS]
        self.noise = self._draw()
        self.eps = [self._draw() for _ in range(encodes)]
        self.encoded = 0

    def _draw(self) -> np.ndarray:
        return np.stack([r.standard_normal(LATENT, dtype=np.float32) for r in self.rngs])

    def patch(self, monkeypatch: pytest.MonkeyPatch, pipeline_module: Any) -> None:
        import diffusers.models.autoencoders.vae as vae
        import diffusers.schedulers.scheduling_euler_ancestral_discrete as ancestral

        def tensor(array: np.ndarray, shape: Any, dtype: Any) -> torch.Tensor:
            assert tuple(shape) == array.shape, (tuple(shape), array.shape)
            return torch.from_numpy(array.copy()).to(dtype=dtype)

        def encoder(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
            self.encoded += 1
            return tensor(self.eps[self.encoded - 1], shape, dtype)

        monkeypatch.setattr(vae, "randn_tensor", encoder)
        monkeypatch.setattr(pipeline_module, "randn_tensor",
                            lambda shape, generator=None, device=None, dtype=None, layout=None:
                            tensor(self.noise, shape, dtype))
        monkeypatch.setattr(ancestral, "randn_tensor",
                            lambda shape, generator=None, device=None, dtype=None, layout=None:
                            tensor(self._draw(), shape, dtype))


def _ours(folder: Path) -> StableDiffusionOnnx:
    return StableDiffusionOnnx(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                               allow_cpu=True)))


def _theirs(kind: str, diffusers_dir: Path, onnx_dir: Path, scheduler: str) -> Any:
    import diffusers

    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    extra = {} if "XL" in kind else {"safety_checker": None}
    pipe = getattr(diffusers, kind).from_pretrained(diffusers_dir, **extra)
    pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _compare(mine: np.ndarray, theirs: np.ndarray, what: str) -> int:
    theirs_u8 = (theirs * 255).round().astype(np.uint8)
    diff = np.abs(mine.astype(np.int16) - theirs_u8.astype(np.int16))
    assert mine.shape == theirs_u8.shape, what
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} pixels differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"
    assert (np.abs(mine[0].astype(np.int16) - mine[1].astype(np.int16)) > 1).mean() > 0.3  # seeds differ
    return int(diff.max())


def _batch(scheduler: str, strength: float, mask: np.ndarray | None) -> Batch:
    edit = EditImage(init_image(), mask)
    return Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, edit=edit) for p, s in zip(PROMPTS, SEEDS,
                                                                                                 strict=True)),
                 SIZE, SIZE, STEPS, scheduler, strength=strength, overlay=False)


@pytest.fixture(scope="module")
def sd1(tiny_build: tuple[Path, Path]) -> StableDiffusionOnnx:
    return _ours(tiny_build[0])


@pytest.mark.parametrize(("scheduler", "strength"), [(s, 0.6) for s in sorted(SCHEDULERS)] + [("euler", 1.0)])
def test_img2img_matches_diffusers(scheduler: str, strength: float, sd1: StableDiffusionOnnx,
                                   tiny_build: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    onnx_dir, diffusers_dir = tiny_build
    draws = Draws(encodes=1)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionImg2ImgPipeline", diffusers_dir, onnx_dir, scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2, strength=strength, num_inference_steps=STEPS,
                      guidance_scale=GUIDANCE, output_type="np").images
    out = sd1(_batch(scheduler, strength, None))
    assert out.steps_total == int(STEPS * strength)
    print(f"img2img {scheduler} strength {strength}: max |diff| {_compare(out.images, theirs, scheduler)}/255")


@pytest.mark.parametrize("scheduler", ["euler", "ddim", "dpmpp_2m"])
def test_inpaint_4_channel_matches_diffusers(scheduler: str, sd1: StableDiffusionOnnx,
                                             tiny_build: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A regular UNet: the mask blended in latent space after every step (diffusers' StableDiffusionInpaintPipeline
    with a 4-channel UNet); diffusers encodes the masked image too (unused), so it draws twice."""
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

    onnx_dir, diffusers_dir = tiny_build
    draws = Draws(encodes=2)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionInpaintPipeline", diffusers_dir, onnx_dir, scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2,
                      mask_image=[Image.fromarray(square_mask())] * 2,
                      strength=0.75, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
                      output_type="np").images
    print(f"inpaint-4 {scheduler}: max |diff| "
          f"{_compare(sd1(_batch(scheduler, 0.75, square_mask())).images, theirs, scheduler)}/255")


@pytest.fixture(scope="module")
def inpaint_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inpaint")
    return build_tiny(root / "onnx", diffusers_out=root / "diffusers", family="inpaint"), root / "diffusers"


@pytest.mark.parametrize(("scheduler", "strength"), [("euler", 1.0), ("ddim", 0.7)])
def test_inpaint_9_channel_matches_diffusers(scheduler: str, strength: float, inpaint_build: tuple[Path, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An inpainting UNet (in_channels 9) takes [latents, mask, masked-image latents]; at strength 1.0 diffusers
    does not encode the image (pure noise start), so it draws once."""
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

    onnx_dir, diffusers_dir = inpaint_build
    ours = _ours(onnx_dir)
    assert ours.family.inpainting and ours.latent_channels == 4
    draws = Draws(encodes=1 if strength == 1.0 else 2)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionInpaintPipeline", diffusers_dir, onnx_dir, scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2,
                      mask_image=[Image.fromarray(square_mask())] * 2,
                      strength=strength, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE,
                      width=SIZE, output_type="np").images
    print(f"inpaint-9 {scheduler} strength {strength}: max |diff| "
          f"{_compare(ours(_batch(scheduler, strength, square_mask())).images, theirs, scheduler)}/255")


def test_sdxl_img2img_matches_diffusers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDXL img2img (StableDiffusionXLImg2ImgPipeline; the base model's requires_aesthetics_score is False, so the
    time ids are txt2img's)."""
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as module

    onnx_dir = build_tiny(tmp_path / "onnx", diffusers_out=tmp_path / "diffusers", family="sdxl")
    draws = Draws(encodes=1)
    draws.patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionXLImg2ImgPipeline", tmp_path / "diffusers", onnx_dir, "euler")
    assert not pipe.config.requires_aesthetics_score
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2, strength=0.5, num_inference_steps=STEPS,
                      guidance_scale=5.0, output_type="np", height=SIZE, width=SIZE).images
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=5.0, edit=EditImage(init_image()))
                        for p, s in zip(PROMPTS, SEEDS, strict=True)), SIZE, SIZE, STEPS, "euler", strength=0.5)
    print(f"sdxl img2img euler: max |diff| {_compare(_ours(onnx_dir)(batch).images, theirs, 'sdxl')}/255")



def test_9_channel_model_serves_txt2img_as_a1111(inpaint_build: tuple[Path, Path]) -> None:
    """txt2img on an inpainting UNet is inpainting of the whole image at strength 1.0 (nothing under the mask):
    the same image, exactly. (Against diffusers' inpainting with an all-white mask it differs by up to 5/255, mean
    0.6/255, unlike the partial masks above: not explained yet, so not claimed.)"""
    ours = _ours(inpaint_build[0])
    specs = [ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)]
    plain = ours(Batch(tuple(specs), SIZE, SIZE, STEPS, "euler")).images
    whole = EditImage(init_image(), np.full((SIZE, SIZE), 255, np.uint8))
    masked = ours(Batch(tuple(dataclasses.replace(s, edit=whole) for s in specs), SIZE, SIZE, STEPS, "euler",
                        overlay=False)).images
    assert np.array_equal(plain, masked)
    assert selftest.sanity(plain[0]) is None
