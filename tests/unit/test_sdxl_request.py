"""SDXL's per-request micro-conditioning (original_size, crops_coords_top_left) reaches the Batch as diffusers
takes it, is refused for other families, and keeps requests with different values out of one micro-batch; the
family's defaults apply when a request leaves steps and guidance out."""

from __future__ import annotations

import asyncio

import pytest

from engines.config import SCHEDULER_NAMES
from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo
from server.batcher import Job
from server.schemas import ImageGenerationRequest
from server.service import build_batch
from server.settings import load_settings

SDXL = ModelInfo("xl", 16, 128, SCHEDULER_NAMES, 77, family="sdxl")
SD1 = ModelInfo("sd", 16, 64, SCHEDULER_NAMES, 77, family="sd1")
TURBO = ModelInfo("t", 16, 64, SCHEDULER_NAMES, 77, family="turbo")


def _req(**extra: object) -> ImageGenerationRequest:
    return ImageGenerationRequest.model_validate({"prompt": "a lighthouse", "seed": 1, **extra})


def test_original_size_and_crop_reach_the_batch_as_height_width() -> None:
    batch = build_batch(_req(original_size="1024x768", crops_coords_top_left=[32, 16]), load_settings("dev"), SDXL)
    assert batch.original_size == (768, 1024) and batch.crops_coords_top_left == (32, 16)
    plain = build_batch(_req(), load_settings("dev"), SDXL)
    assert plain.original_size is None and plain.crops_coords_top_left == (0, 0)


@pytest.mark.parametrize("field", [{"original_size": "1024x1024"}, {"crops_coords_top_left": [0, 8]}])
def test_micro_conditioning_is_refused_for_other_families(field: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError, match="SDXL models only; this model is sd1") as caught:
        build_batch(_req(**field), load_settings("dev"), SD1)
    assert caught.value.param == next(iter(field))


@pytest.mark.parametrize("body", [{"original_size": "big"}, {"crops_coords_top_left": [1]},
                                  {"crops_coords_top_left": [-1, 0]}])
def test_malformed_micro_conditioning_is_a_validation_error(body: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="original_size|crops_coords_top_left"):
        _req(**body)


def test_different_micro_conditioning_never_shares_a_batch() -> None:
    settings = load_settings("dev")
    a = build_batch(_req(original_size="512x512"), settings, SDXL)
    b = build_batch(_req(original_size="1024x1024"), settings, SDXL)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job(x, loop.create_future(), 0.0, None) for x in (a, b, a)]
        assert jobs[0].group != jobs[1].group and jobs[0].group == jobs[2].group
    finally:
        loop.close()


def test_family_defaults_fill_steps_and_guidance() -> None:
    settings = load_settings("dev")
    turbo = build_batch(_req(), settings, TURBO)
    assert (turbo.steps, turbo.images[0].guidance_scale) == (settings.defaults_for("turbo").steps,
                                                             settings.defaults_for("turbo").guidance_scale)
    assert (turbo.steps, turbo.images[0].guidance_scale) != (settings.defaults.steps, settings.defaults.guidance_scale)
    sd1 = build_batch(_req(), settings, SD1)
    assert (sd1.steps, sd1.images[0].guidance_scale) == (settings.defaults.steps, settings.defaults.guidance_scale)
