"""Our ORT pipeline vs diffusers' torch StableDiffusionPipeline on the same weights and initial latents."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.pipelines.contract import image_rng
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "ddim": "DDIMScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler",
              # multistep (engines/numerics/multistep.py): history ring, and Heun's/PLMS's second UNet call
              "plms": "PNDMScheduler", "lms": "LMSDiscreteScheduler", "unipc": "UniPCMultistepScheduler",
              "heun": "HeunDiscreteScheduler"}
"""Each diffusers scheduler gets the tiny model's scheduler_config.json (PNDM, skip_prk_steps) via from_config."""
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [11, 12]
SIZE, STEPS, GUIDANCE = 64, 20, 7.5


@pytest.fixture(scope="module")
def ours(tiny_model: Path) -> StableDiffusionOnnx:
    return StableDiffusionOnnx(tiny_model, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                   allow_cpu=True)))


def _torch_pipeline(diffusers_dir: Path, onnx_dir: Path, scheduler: str):  # type: ignore[no-untyped-def]
    import diffusers

    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(diffusers_dir, safety_checker=None)
    pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _streams(shape: tuple[int, ...]) -> tuple[np.ndarray, list[np.random.Generator]]:
    rngs = [image_rng(seed) for seed in SEEDS]
    return np.stack([r.standard_normal(shape, dtype=np.float32) for r in rngs]), rngs


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_images_match_diffusers(scheduler: str, ours: StableDiffusionOnnx, tiny_build: tuple[Path, Path],
                                shared_step_noise: list[list[np.random.Generator]]) -> None:
    onnx_dir, diffusers_dir = tiny_build
    latent_shape = (4, SIZE // 8, SIZE // 8)
    latents, rngs = _streams(latent_shape)
    shared_step_noise.append(rngs)
    pipe = _torch_pipeline(diffusers_dir, onnx_dir, scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                      latents=torch.from_numpy(latents), output_type="np").images
    theirs_u8 = (theirs * 255).round().astype(np.uint8)
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  SIZE, SIZE, STEPS, scheduler)
    mine = ours(batch, latents=latents).images
    diff = np.abs(mine.astype(np.int16) - theirs_u8.astype(np.int16))
    assert mine.shape == theirs_u8.shape == (2, SIZE, SIZE, 3)
    assert (diff <= 1).mean() >= 0.999, f"{scheduler}: {(diff > 1).sum()} pixels differ by more than 1/255"
    assert diff.max() <= 3, f"{scheduler}: max difference {diff.max()}/255"
    # The comparison has teeth: images of different seeds differ far more than the tolerance.
    assert (np.abs(mine[0].astype(np.int16) - mine[1].astype(np.int16)) > 1).mean() > 0.5
