"""Clients, fourth pass, on a fake engine behind the protocol (issue 43): JSON without a Content-Type on the A1111
routes (Dify), empty overrides, integral floats in integer fields (aiyabot's Hires steps), Forge's
distilled_cfg_scale on a guidance-distilled family, samplers and schedules listed per family, sizes from the
family's trained size, OpenAI edits under the same 1024 rule as generations, size messages naming the setting that
applies, and seed -1 randomised with the seed that ran reported."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.types.model import ModelInfo
from engines.types.request import Batch, BatchResult, StepHook
from server.settings import Settings, load_settings
from tests.unit.fakes import DIGEST, HashedEngine, start

TXT2IMG, IMG2IMG, OPTIONS = "/sdapi/v1/txt2img", "/sdapi/v1/img2img", "/sdapi/v1/options"
GEN, EDITS = "/v1/images/generations", "/v1/images/edits"
SD1 = ModelInfo("fake", 8, 64, ("euler", "euler_a", "euler_karras", "ddim", "dpmpp_2m", "dpmpp_2m_karras"), 77,
                DIGEST, modes=("txt2img", "img2img", "inpaint"), edit_schedulers=("euler", "euler_a", "ddim"))
FLUX = ModelInfo("flux-fake", 16, 64, ("euler",), 77, DIGEST, family="flux", prediction_type="flow",
                 cfg_default=False, default_steps=28, default_guidance=3.5, modes=("txt2img", "img2img"),
                 edit_schedulers=("euler",), token_patch=16, text_tokens=512, hidden_size=64)


class InfoEngine(HashedEngine):
    """The fake serving a given ModelInfo (family, schedulers, native size, modes)."""

    def __init__(self, info: ModelInfo) -> None:
        super().__init__()
        self.model_info = info

    @property
    def info(self) -> ModelInfo:
        super().info  # noqa: B018 (raises until loaded, as the real engine)
        return self.model_info

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        return super().generate(batch, on_step)


def _settings(base: str = "dev", **sections: dict[str, Any]) -> Settings:
    settings = load_settings(base)
    return settings.model_copy(update={name: getattr(settings, name).model_copy(update=values)
                                       for name, values in sections.items()})


def _clients(info: ModelInfo = SD1, settings: Settings | None = None) -> Iterator[tuple[TestClient, InfoEngine]]:
    engine = InfoEngine(info)
    for client in start(engine, settings or load_settings("dev")):
        yield client, engine


@pytest.fixture
def sd1() -> Iterator[tuple[TestClient, InfoEngine]]:
    yield from _clients()


@pytest.fixture
def flux() -> Iterator[tuple[TestClient, InfoEngine]]:
    yield from _clients(FLUX)


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def _detail(answer: Any) -> dict[str, Any]:
    assert answer.status_code == 422, answer.text
    return dict(answer.json()["detail"][0])


# 1. Dify: JSON without a Content-Type, an empty checkpoint override


def test_a1111_routes_read_a_body_without_content_type_as_json(sd1: tuple[TestClient, InfoEngine]) -> None:
    client, engine = sd1
    body = json.dumps({"prompt": "a cat", "width": 64, "height": 64, "steps": 2, "seed": 5})
    set_model = client.post(OPTIONS, content=json.dumps({"sd_model_checkpoint": "fake"}))
    assert set_model.status_code == 200, set_model.text
    answer = client.post(TXT2IMG, content=body)
    assert answer.status_code == 200, answer.text
    assert engine.batches[-1].images[0].seed == 5 and engine.batches[-1].images[0].prompt == "a cat"
    assert "content-type" not in answer.request.headers
    # only there: the OpenAI route keeps its 400, and a body that names another type is not read as JSON
    assert client.post(GEN, content=body).status_code == 400
    assert client.post(TXT2IMG, content=body, headers={"content-type": "text/plain"}).status_code == 422


def test_empty_overrides_are_ignored_by_name_and_others_still_judged(sd1: tuple[TestClient, InfoEngine]) -> None:
    client, _ = sd1
    body = {"prompt": "a", "width": 64, "height": 64, "steps": 2,
            "override_settings": {"sd_model_checkpoint": "", "sd_vae": None}}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 200, answer.text
    ignored = answer.headers["x-sdserve-ignored-fields"].split(",")
    assert {"override_settings.sd_model_checkpoint", "override_settings.sd_vae"} <= set(ignored)
    other = client.post(TXT2IMG, json={**body, "override_settings": {"sd_model_checkpoint": "sdxl.safetensors"}})
    assert _detail(other)["loc"] == ["body", "override_settings", "sd_model_checkpoint"]


# 2. aiyabot: integral floats in integer fields


def test_integral_floats_are_integers_and_fractions_a_422_naming_the_field(sd1: tuple[TestClient, InfoEngine]
                                                                          ) -> None:
    client, engine = sd1
    body = {"prompt": "a", "width": 64.0, "height": 64, "steps": 2.0, "batch_size": 1.0, "enable_hr": True,
            "hr_scale": 2, "hr_second_pass_steps": 3.0, "hr_upscaler": "Lanczos", "seed": 9.0}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 200, answer.text
    assert (engine.batches[-2].steps, engine.batches[-1].images[0].seed) == (2, 9)
    assert "Hires steps: 3" in json.loads(answer.json()["info"])["infotexts"][0]
    for name in ("hr_second_pass_steps", "steps", "width"):
        refused = _detail(client.post(TXT2IMG, json={**body, name: 15.5}))
        assert refused["loc"] == ["body", name] and "fractional" in refused["msg"]
    assert _detail(client.post(TXT2IMG, json={**body, "steps": True}))["loc"] == ["body", "steps"]


# 3. Forge's Flux guidance, samplers and schedules per family


def test_distilled_cfg_scale_sets_flux_devs_guidance(flux: tuple[TestClient, InfoEngine]) -> None:
    client, engine = flux
    base = {"prompt": "a fox", "width": 64, "height": 64, "steps": 2}
    for extra, expected in (({"cfg_scale": 1, "distilled_cfg_scale": 3.5}, 3.5), ({"distilled_cfg_scale": 2.0}, 2.0),
                            ({"cfg_scale": 4.0}, 4.0), ({}, 3.5)):
        answer = client.post(TXT2IMG, json={**base, **extra})
        assert answer.status_code == 200, answer.text
        assert {s.guidance_scale for s in engine.batches[-1].images} == {expected}, extra
        assert "distilled_cfg_scale" not in answer.headers.get("x-sdserve-ignored-fields", "")
    refused = _detail(client.post(TXT2IMG, json={**base, "cfg_scale": 7, "distilled_cfg_scale": 3.5}))
    assert refused["loc"] == ["body", "cfg_scale"] and "true CFG" in refused["msg"]


def test_distilled_cfg_scale_is_named_as_ignored_where_the_model_has_no_distilled_guidance(
        sd1: tuple[TestClient, InfoEngine]) -> None:
    client, engine = sd1
    answer = client.post(TXT2IMG, json={"prompt": "a", "width": 64, "height": 64, "steps": 2, "cfg_scale": 6,
                                        "distilled_cfg_scale": 3.5})
    assert answer.status_code == 200, answer.text
    assert engine.batches[-1].images[0].guidance_scale == 6
    assert "distilled_cfg_scale" in answer.headers["x-sdserve-ignored-fields"].split(",")


def test_samplers_and_schedules_are_listed_per_family(flux: tuple[TestClient, InfoEngine]) -> None:
    client, _ = flux
    assert [s["name"] for s in client.get("/sdapi/v1/samplers").json()] == ["Euler"]
    assert [s["label"] for s in client.get("/sdapi/v1/schedulers").json()] == ["Automatic"]
    refused = _detail(client.post(TXT2IMG, json={"prompt": "a", "width": 64, "height": 64, "sampler_name": "Euler a"}))
    assert refused["loc"] == ["body", "sampler_name"] and "['Euler']" in refused["msg"]
    assert "euler_a" not in refused["msg"]
    karras = client.post(TXT2IMG, json={"prompt": "a", "width": 64, "height": 64, "steps": 2, "sampler_name": "Euler",
                                        "scheduler": "Karras"})
    assert karras.status_code == 200, karras.text  # as A1111: a schedule the sampler cannot use falls back
    assert "used Automatic" in karras.headers["x-sdserve-warnings"]


def test_sd1_lists_only_what_its_model_serves(sd1: tuple[TestClient, InfoEngine]) -> None:
    client, _ = sd1
    assert [s["name"] for s in client.get("/sdapi/v1/samplers").json()] == ["Euler", "Euler a", "DDIM", "DPM++ 2M"]
    assert [s["label"] for s in client.get("/sdapi/v1/schedulers").json()] == ["Automatic", "Karras"]
    refused = _detail(client.post(TXT2IMG, json={"prompt": "a", "width": 64, "height": 64, "sampler_name": "LMS"}))
    assert refused["loc"] == ["body", "sampler_name"] and "'DPM++ 2M'" in refused["msg"]
    init = base64.b64encode(_encoded(Image.new("RGB", (64, 64), (9, 9, 9)))).decode()
    edit = _detail(client.post(IMG2IMG, json={"prompt": "a", "init_images": [init], "sampler_name": "DPM++ 2M"}))
    assert edit["loc"] == ["body", "sampler_name"] and "['Euler', 'Euler a', 'DDIM']" in edit["msg"]


# 4. Sizes: the family's trained size, messages that name what applies


def test_flux_serves_openai_sizes_as_a_family_trained_at_1024() -> None:
    native = dataclasses.replace(FLUX, default_size=1024)
    settings = _settings(serving={"sizes": ("512x512",), "openai_sizes": True, "openai_sizes_hires": True})
    for client, engine in _clients(native, settings):
        answer = client.post(GEN, json={"prompt": "a", "size": "1024x1024", "steps": 1})
        assert answer.status_code == 200, answer.text
        assert (engine.batches[-1].width, engine.batches[-1].height) == (1024, 1024)
        assert "Hires" not in answer.headers.get("x-sdserve-warnings", "")  # never a Hires fix on a 1024 family
    for client, _ in _clients(native, _settings(serving={"sizes": ("512x512",)})):
        refused = client.post(TXT2IMG, json={"prompt": "a", "width": 1024, "height": 1024})
        message = _detail(refused)["msg"]
        assert "enable [serving] openai_sizes" in message and "openai_sizes_hires" not in message


def test_sd1_size_messages_name_the_settings_that_apply(sd1: tuple[TestClient, InfoEngine]) -> None:
    client, _ = sd1
    a1111 = _detail(client.post(TXT2IMG, json={"prompt": "a", "width": 1024, "height": 1024}))["msg"]
    assert "[limits] max_width" in a1111 and "OpenAI routes only" in a1111
    assert "enable [serving] openai_sizes_hires" not in a1111
    hires = _detail(client.post(TXT2IMG, json={"prompt": "a", "width": 64, "height": 64, "enable_hr": True,
                                                "hr_resize_x": 1024, "hr_resize_y": 1024}))
    assert hires["loc"] == ["body", "hr_resize_x"] and "[limits] max_width" in hires["msg"]
    assert "openai_sizes" not in hires["msg"] and "hr_resize_x/y 1024x1024" in hires["msg"]
    openai = client.post(GEN, json={"prompt": "a", "size": "1024x1024"}).json()["error"]["message"]
    assert "enable [serving] openai_sizes_hires" in openai


def _encoded(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_openai_edits_at_1024_go_through_hires_fix_under_the_option() -> None:
    """n8n's edit node (gpt-image-1 defaults: image[], size 1024x1024, quality auto) on an SD 1.x model."""
    picture = Image.new("RGBA", (256, 256), (200, 30, 30, 255))
    mask = Image.new("RGBA", (256, 256), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, 128, 256))  # transparent: repaint the left half
    fields = {"prompt": "a red cube", "model": "gpt-image-1", "n": "1", "size": "1024x1024", "quality": "auto",
              "steps": "2"}
    for client, engine in _clients(settings=_settings(serving={"openai_sizes_hires": True})):
        for files in ([("image[]", ("a.png", _encoded(picture), "image/png"))],
                      [("image[]", ("a.png", _encoded(picture), "image/png")),
                       ("mask", ("m.png", _encoded(mask), "image/png"))]):
            answer = client.post(EDITS, data=fields, files=files)
            assert answer.status_code == 200, answer.text
            assert _png(answer.json()["data"][0]["b64_json"]).size == (1024, 1024)
            first, second = engine.batches[-2:]
            assert (first.width, second.width) == (64, 1024) and first.images[0].edit is not None
            assert "through Hires fix" in answer.headers["x-sdserve-warnings"]
            masked = second.images[0].edit
            assert masked is not None and (masked.mask is None) == (len(files) == 1)
        assert masked is not None and masked.mask is not None and masked.mask[:, :400].min() > 127
        assert masked.mask[:, 600:].max() < 128  # the second pass repaints only where the edit did
        variation = client.post("/v1/images/variations", data={"size": "1024x1024", "n": "1"},
                                files=[("image", ("a.png", _encoded(picture), "image/png"))])
        assert variation.status_code == 200, variation.text
        assert (engine.batches[-2].width, engine.batches[-1].width) == (64, 1024)
    for client, _ in _clients():
        refused = client.post(EDITS, data=fields, files=[("image[]", ("a.png", _encoded(picture), "image/png"))])
        assert refused.status_code == 400 and "openai_sizes_hires" in refused.json()["error"]["message"]


# 5. seed -1


@pytest.mark.parametrize("route", [TXT2IMG, IMG2IMG])
def test_seed_minus_one_is_randomised_and_the_seed_that_ran_reported(sd1: tuple[TestClient, InfoEngine],
                                                                     route: str) -> None:
    client, engine = sd1
    body: dict[str, Any] = {"prompt": "a", "width": 64, "height": 64, "steps": 2, "seed": -1, "batch_size": 2}
    if route == IMG2IMG:
        body["init_images"] = [base64.b64encode(_encoded(Image.new("RGB", (64, 64), (9, 9, 9)))).decode()]
    seeds = []
    for _ in range(3):
        answer = client.post(route, json=body)
        assert answer.status_code == 200, answer.text
        info = json.loads(answer.json()["info"])
        ran = [s.seed for s in engine.batches[-1].images]
        assert info["all_seeds"] == ran and ran[1] == ran[0] + 1 and 0 <= ran[0] < 2**32
        assert f"Seed: {ran[0]}," in info["infotexts"][0] and f"Seed: {ran[1]}," in info["infotexts"][1]
        seeds.append(info["seed"])
    assert len(set(seeds)) == 3, seeds  # a fixed seed for -1 would repeat
