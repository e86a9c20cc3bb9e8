"""The multistep samplers (PLMS, LMS, UniPC, Heun; engines/numerics/multistep.py) on edits vs diffusers' torch
pipelines on the same tiny weights and the same noise (the patched draws of tests/integration/test_edit_parity.py).

What an edit asks of them, as diffusers' StableDiffusionImg2ImgPipeline.get_timesteps and the schedulers do it:
the run begins at ``timesteps[t_start * order:]`` (Heun's order is 2: its steps hold two evaluations) with
``set_begin_index`` there and an empty history (LMS keeps its order-``step + 1`` coefficients but pairs them with
the derivatives it has; UniPC's first step there has no corrector; PNDM's counter starts afresh, so the first two
evaluations there make one step), ``add_noise`` at the first evaluation's noise level, and inpainting's blend after
every evaluation at the next one's level (Heun's corrector and PLMS's re-run included).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from engines.numerics.schedulers import EDIT_SCHEDULERS, SCHEDULERS, NoiseSchedule, make_plan
from engines.pipelines.unet import StableDiffusionOnnx
from engines.pipelines.unet_edits import strength_start
from tests.integration.test_edit_parity import (
    GUIDANCE,
    PROMPTS,
    SIZE,
    STEPS,
    Draws,
    _batch,
    _compare,
    _ours,
    init_image,
    square_mask,
)

CLASSES = {"plms": ("PNDMScheduler", {"skip_prk_steps": True}), "lms": ("LMSDiscreteScheduler", {}),
           "unipc": ("UniPCMultistepScheduler", {}), "heun": ("HeunDiscreteScheduler", {}),
           "lms_karras": ("LMSDiscreteScheduler", {"use_karras_sigmas": True}),
           "unipc_karras": ("UniPCMultistepScheduler", {"use_karras_sigmas": True})}
"""Our name -> the diffusers scheduler class and what the schedule suffix sets on the model's config."""


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The reference on one thread: torch's two threads spin against the other jobs on a busy 2-core machine
    (a 64 px run takes 12-28 s on two, under 3 s on one). The numbers are the same either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def components(tiny_build: tuple[Path, Path]) -> dict[str, Any]:
    """The diffusers model components, loaded once and shared by every reference pipeline here."""
    import diffusers

    return dict(diffusers.StableDiffusionImg2ImgPipeline.from_pretrained(tiny_build[1], safety_checker=None)
                .components)


def _theirs(kind: str, components: dict[str, Any], onnx_dir: Path, scheduler: str) -> Any:
    import diffusers

    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    name, extra = CLASSES[scheduler]
    pipe = getattr(diffusers, kind)(**{**components, "requires_safety_checker": False})
    pipe.scheduler = getattr(diffusers, name).from_config({**config, **extra})
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sd1(tiny_build: tuple[Path, Path]) -> StableDiffusionOnnx:
    return _ours(tiny_build[0])


def test_every_sampler_serves_edits(tiny_build: tuple[Path, Path]) -> None:
    """No sampler is refused for edits any more, and each plan from a later step carries one noise level per UNet
    evaluation plus the final 0 (what add_noise and the blend read)."""
    assert tuple(SCHEDULERS) == EDIT_SCHEDULERS
    schedule = NoiseSchedule.from_config(json.loads((tiny_build[0] / "scheduler" / "scheduler_config.json")
                                                    .read_text()))
    start, run = strength_start(STEPS, 0.6)
    for name in SCHEDULERS:
        plan = make_plan(name, schedule, STEPS, start, edit=True)
        assert len(plan.steps) == run, name
        assert len(plan.sigmas) == len(plan.evaluations()) + 1 and plan.sigmas[-1] == 0.0, name
        assert plan.sigmas[0] > 0.0, name


@pytest.mark.parametrize(("scheduler", "strength"), [(s, 0.6) for s in CLASSES] + [("heun", 0.3), ("plms", 1.0)])
def test_img2img_multistep_matches_diffusers(scheduler: str, strength: float, sd1: StableDiffusionOnnx,
                                             tiny_build: tuple[Path, Path], components: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    Draws(encodes=1).patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionImg2ImgPipeline", components, tiny_build[0], scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2, strength=strength, num_inference_steps=STEPS,
                      guidance_scale=GUIDANCE, output_type="np").images
    out = sd1(_batch(scheduler, strength, None))
    assert out.steps_total == int(STEPS * strength)
    worst = _compare(out.images, theirs, scheduler)
    assert worst <= 1, f"{scheduler}: max difference {worst}/255"
    print(f"img2img {scheduler} strength {strength}: max |diff| {worst}/255")


@pytest.mark.parametrize("scheduler", ["heun", "plms", "lms"])
def test_inpaint_multistep_matches_diffusers(scheduler: str, sd1: StableDiffusionOnnx,
                                             tiny_build: tuple[Path, Path], components: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4-channel UNet: diffusers blends the image back after every evaluation of its loop at the next
    evaluation's noise level, Heun's predictor and PLMS's first evaluation included."""
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

    Draws(encodes=2).patch(monkeypatch, module)
    pipe = _theirs("StableDiffusionInpaintPipeline", components, tiny_build[0], scheduler)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init_image())] * 2,
                      mask_image=[Image.fromarray(square_mask())] * 2,
                      strength=0.75, num_inference_steps=STEPS, guidance_scale=GUIDANCE, height=SIZE, width=SIZE,
                      output_type="np").images
    worst = _compare(sd1(_batch(scheduler, 0.75, square_mask())).images, theirs, scheduler)
    assert worst <= 1, f"{scheduler}: max difference {worst}/255"
    print(f"inpaint-4 {scheduler}: max |diff| {worst}/255")
