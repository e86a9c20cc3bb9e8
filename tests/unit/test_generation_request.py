"""The serving core's neutral request (server/generation.py): each API's wire schema mapped into it field by field,
bad values refused naming the wire field, the seed drawn once per request, the step cache named as clients send it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engines.errors import InvalidRequestError
from engines.types.request import Batch, ImageSpec
from server import request_rules
from server.a1111_request import Txt2ImgRequest, from_a1111
from server.generation import A1111_NAMES, OPENAI_NAMES, RANDOM_SEEDS, GenerationRequest, LoraAsk, draw_seed
from server.metrics import Metrics
from server.request_rules import from_openai, generation_batches
from server.schemas import ImageGenerationRequest
from server.service import ImageService
from server.settings import load_settings
from server.state import ServerState
from tests.unit.fakes import FakeEngine

INFO = FakeEngine().info
SETTINGS = load_settings("dev")


def test_an_a1111_payload_maps_field_by_field() -> None:
    req = Txt2ImgRequest.model_validate({"prompt": "a cat", "negative_prompt": "blur", "seed": 7, "steps": 12,
                                         "cfg_scale": 5.5, "width": 64, "height": 48, "batch_size": 2, "n_iter": 3,
                                         "step_cache": False, "save_images": True})
    assert from_a1111(req, INFO, "euler_a") == GenerationRequest(
        prompt="a cat", negative_prompt="blur", images=2, batches=3, size="64x48", seed=7, steps=12, guidance=5.5,
        scheduler="euler_a", loras=(), original_size=None, crops=None, step_cache=False, names=A1111_NAMES)
    plain = from_a1111(Txt2ImgRequest.model_validate({"prompt": "a cat"}), INFO, None)
    assert (plain.seed, plain.size, plain.steps, plain.guidance, plain.images, plain.batches) == \
        (None, None, None, None, 1, 1)  # seed -1: drawn by the core


def test_an_openai_payload_maps_field_by_field() -> None:
    req = ImageGenerationRequest.model_validate({
        "prompt": "a cat", "negative_prompt": "blur", "n": 2, "size": "64x64", "seed": 9, "steps": 10,
        "guidance_scale": 4.0, "scheduler": "euler", "loras": [{"name": "ink", "weight": 0.5, "unet_weight": 0.2}],
        "original_size": "128x96", "crops_coords_top_left": [4, 8], "step_cache": True, "model": INFO.name,
        "style": "vivid"})
    assert from_openai(req, SETTINGS, INFO) == GenerationRequest(
        prompt="a cat", negative_prompt="blur", images=2, batches=1, size="64x64", seed=9, steps=10, guidance=4.0,
        scheduler="euler", loras=(LoraAsk("ink", 0.5, 0.2),), original_size="128x96", crops=(4, 8),
        step_cache=True, names=OPENAI_NAMES)


def test_openai_quality_becomes_steps() -> None:
    settings = SETTINGS.model_copy(update={"api": SETTINGS.api.model_copy(update={"quality_steps": {"hd": 17}})})
    req = ImageGenerationRequest.model_validate({"prompt": "a cat", "quality": "hd"})
    assert from_openai(req, settings, INFO).steps == 17


@pytest.mark.parametrize(("body", "param"), [({"model": "dall-e-9"}, "model"), ({"quality": "ultra"}, "quality")])
def test_the_openai_mapping_refuses_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        from_openai(ImageGenerationRequest.model_validate({"prompt": "a cat", **body}), SETTINGS, INFO)
    assert caught.value.param == param


@pytest.mark.parametrize(("fields", "names", "param"), [
    ({"seed": 2**32}, A1111_NAMES, "seed"), ({"steps": 0}, OPENAI_NAMES, "steps"),
    ({"guidance": -1.0}, A1111_NAMES, "cfg_scale"), ({"guidance": -1.0}, OPENAI_NAMES, "guidance_scale"),
    ({"batches": 0}, A1111_NAMES, "n_iter")])
def test_a_bad_value_is_refused_naming_the_wire_field(fields: dict[str, Any], names: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        GenerationRequest(prompt="a cat", names=names, **fields)
    assert caught.value.param == param


@pytest.mark.parametrize(("names", "param"), [(A1111_NAMES, "batch_size"), (OPENAI_NAMES, "n")])
def test_the_core_names_the_field_each_api_sends(names: Any, param: str) -> None:
    over = SETTINGS.limits.max_n + 1
    with pytest.raises(InvalidRequestError, match=f"{param} must be between 1 and") as caught:
        generation_batches(GenerationRequest(prompt="a cat", images=over, names=names), SETTINGS, INFO)
    assert caught.value.param == param


def test_the_seed_is_drawn_once_per_request_and_goes_on_across_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[int] = []

    def draw() -> int:
        drawn.append(2**32 - 3)  # near the top: the later images wrap around as a sent seed's do
        return drawn[-1]

    monkeypatch.setattr(request_rules, "draw_seed", draw)
    req = from_a1111(Txt2ImgRequest.model_validate({"prompt": "a cat", "batch_size": 2, "n_iter": 3}), INFO, None)
    batches = generation_batches(req, SETTINGS, INFO)
    assert len(drawn) == 1
    assert [[s.seed for s in b.images] for b in batches] == [[2**32 - 3, 2**32 - 2], [2**32 - 1, 0], [1, 2]]
    sent = generation_batches(GenerationRequest(prompt="a cat", seed=5, images=2, batches=2), SETTINGS, INFO)
    assert len(drawn) == 1 and [s.seed for b in sent for s in b.images] == [5, 6, 7, 8]


def test_a_drawn_seed_leaves_room_for_the_requests_images() -> None:
    assert all(0 <= draw_seed() < RANDOM_SEEDS for _ in range(200))
    assert RANDOM_SEEDS + 16 * 16 <= 2**32


def test_an_engine_refusal_of_the_cache_names_step_cache() -> None:
    engine = FakeEngine()
    service = ImageService(engine, SETTINGS, Metrics(), ServerState())

    async def refuse(batch: Batch, deadline: float | None, owner: str | None) -> None:
        raise InvalidRequestError("the first-block step cache runs the transformer's parts with their base "
                                  "weights: not with a LoRA on the transformer", param="cache")

    service.batcher.submit = refuse  # type: ignore[assignment,method-assign]
    with pytest.raises(InvalidRequestError, match="not with a LoRA") as caught:
        asyncio.run(service.generate(Batch((ImageSpec("a cat"),))))
    assert caught.value.param == "step_cache"
