"""Our torch-free ORT Z-Image pipeline (engines/pipelines/zimage.py, exported by engines/build/zimage.py) vs
diffusers' ZImagePipeline on the same tiny weights and initial noise: Turbo-style (guidance 0, no CFG) and base-style
CFG with negative prompts at two sizes (one whose image tokens are padded to a multiple of 32, one not), both
prompts in one diffusers call (different caption lengths: diffusers pads and masks the shorter one); the schedule's
timesteps and sigmas against diffusers' scheduler."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.pipelines.contract import image_rng
from engines.pipelines.zimage import ZImagePipeline
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [11, 12]
STEPS = 3
CASES = [(64, 64, 0.0), (48, 32, 0.0), (64, 64, 4.0), (48, 32, 4.0)]
"""(width, height, guidance_scale): no CFG (Turbo) at two sizes, then CFG with negatives (base)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


@functools.lru_cache(maxsize=2)
def _ours(folder: Path) -> ZImagePipeline:
    return ZImagePipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=2)
def _torch_pipeline(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.ZImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(width: int, height: int) -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((16, height // 8, width // 8), dtype=np.float32) for s in SEEDS])


@pytest.mark.parametrize(("width", "height", "cfg"), CASES, ids=[f"{w}x{h}-cfg{c}" for w, h, c in CASES])
def test_images_match_diffusers(width: int, height: int, cfg: float, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build("z-image-turbo")
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=cfg) for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS,
                                                                                         strict=True)),
                  width=width, height=height, steps=STEPS)
    out = _ours(onnx_dir)(batch)
    with torch.no_grad():
        theirs = _torch_pipeline(diffusers_dir)(
            PROMPTS, negative_prompt=NEGATIVES if cfg > 0 else None, guidance_scale=cfg, height=height, width=width,
            num_inference_steps=STEPS, latents=torch.from_numpy(_noise(width, height)), output_type="np").images
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nz-image {width}x{height} guidance {cfg}: {match:.6f} within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10  # a real pattern, not a flat image any pipeline would match
    assert not np.array_equal(out.images[0], out.images[1])


@pytest.mark.parametrize("steps", [1, 3, 8, 9, 50])
def test_schedule_matches_diffusers(steps: int, dit_build: Builder) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    onnx_dir, diffusers_dir = dit_build("z-image-turbo")
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(diffusers_dir / "scheduler")
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(steps), mu=0.5)
    ours = _ours(onnx_dir).schedule(steps, 8, 8)
    np.testing.assert_array_equal(ours.timesteps, scheduler.timesteps.numpy())
    np.testing.assert_array_equal(ours.sigmas, scheduler.sigmas.numpy())
