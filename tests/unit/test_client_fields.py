"""The rule for fields clients always send (server/request_rules.py), on a fake engine: honoured (output_format,
output_compression, background opaque, gpt-image quality), accepted and named (style, moderation, compression with
PNG, A1111 schedules a sampler cannot use), refused where ignoring would mislead (background transparent, tiling,
a variation seed strength, an unserved size, named with the served sizes and the native size); DALL·E's url
default; the A1111 infotexts; unload/reload-checkpoint answered for a model that stays resident."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.config import SCHEDULER_NAMES
from engines.types.model import ModelInfo
from server.settings import Settings, load_settings
from tests.unit.fakes import DIGEST, TITLE, HashedEngine
from tests.unit.fakes import start as _start

GEN = "/v1/images/generations"
TXT2IMG = "/sdapi/v1/txt2img"


class SdxlEngine(HashedEngine):
    """The fake as an SDXL-family model (native 1024, factor 8)."""

    @property
    def info(self) -> ModelInfo:
        return ModelInfo("fake-xl", 8, 1024, SCHEDULER_NAMES, 77, DIGEST, family="sdxl", text_encoders=2)


def _openai_sizes(on: bool) -> Settings:
    dev = load_settings("dev")
    return dev.model_copy(update={"serving": dev.serving.model_copy(update={"openai_sizes": on})})


@pytest.mark.parametrize(("fmt", "magic", "media"), [("png", b"\x89PNG", "image/png"),
                                                      ("jpeg", b"\xff\xd8\xff", "image/jpeg"),
                                                      ("webp", b"RIFF", "image/webp")])
def test_output_format_is_honoured_in_b64_and_url(client: TestClient, fmt: str, magic: bytes, media: str) -> None:
    body = {"prompt": "a", "size": "64x64", "steps": 2, "seed": 3, "output_format": fmt}
    answer = client.post(GEN, json=body)
    assert answer.status_code == 200, answer.text
    assert base64.b64decode(answer.json()["data"][0]["b64_json"]).startswith(magic)
    assert answer.json()["output_format"] == fmt and answer.json()["size"] == "64x64"
    url = client.post(GEN, json={**body, "response_format": "url"}).json()["data"][0]["url"]
    assert url.startswith("http://localhost/v1/images/files/") and url.endswith(f".{fmt}")
    served = client.get(url)
    assert served.headers["content-type"] == media and served.content.startswith(magic)
    assert Image.open(io.BytesIO(served.content)).size == (64, 64)


def test_output_compression_sets_the_lossy_quality(client: TestClient) -> None:
    def size(compression: int) -> int:
        body = {"prompt": "a", "size": "64x64", "steps": 2, "seed": 3, "output_format": "jpeg",
                "output_compression": compression}
        answer = client.post(GEN, json=body)
        assert "x-sdserve-ignored-fields" not in answer.headers  # honoured, not ignored
        return len(base64.b64decode(answer.json()["data"][0]["b64_json"]))

    assert size(10) < size(100) / 2  # noise-like pixels: quality decides the byte count


@pytest.mark.parametrize(("extra", "ignored"), [
    ({"style": "vivid"}, "style"), ({"style": "natural"}, "style"), ({"moderation": "low"}, "moderation"),
    ({"moderation": "auto"}, "moderation"), ({"output_compression": 80}, "output_compression"),
    ({"output_format": "png", "output_compression": 100}, "output_compression"),
])
def test_fields_that_cannot_be_honoured_are_accepted_and_named(client: TestClient, extra: dict[str, Any],
                                                               ignored: str) -> None:
    answer = client.post(GEN, json={"prompt": "a", "size": "64x64", "steps": 2, **extra})
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sdserve-ignored-fields"] == ignored
    assert any(w.startswith(f"{ignored} ignored") for w in answer.json()["warnings"])
    assert f"{ignored} ignored" in answer.headers["x-sdserve-warnings"]


@pytest.mark.parametrize("background", ["auto", "opaque"])
def test_an_opaque_background_is_honoured_not_ignored(client: TestClient, background: str) -> None:
    answer = client.post(GEN, json={"prompt": "a", "size": "64x64", "steps": 2, "background": background})
    assert answer.status_code == 200 and "x-sdserve-ignored-fields" not in answer.headers
    assert answer.json()["background"] == "opaque" and "warnings" not in answer.json()


@pytest.mark.parametrize(("model", "kind"), [("dall-e-2", "url"), ("dall-e-3", "url"), ("gpt-image-1", "b64_json"),
                                             ("gpt-image-1.5", "b64_json"), (None, "b64_json")])
def test_response_format_defaults_as_openai_per_model(client: TestClient, model: str | None, kind: str) -> None:
    body = {"prompt": "a", "size": "64x64", "steps": 2} | ({"model": model} if model else {})
    item = client.post(GEN, json=body).json()["data"][0]
    assert set(item) == {kind}


def test_librechat_dalle3_request_on_sdxl_with_openai_sizes(engine: HashedEngine) -> None:
    """LibreChat's DALL·E 3 tool: model dall-e-3, quality standard, style vivid, size 1024x1024, n 1, reads url."""
    body = {"model": "dall-e-3", "quality": "standard", "style": "vivid", "size": "1024x1024", "prompt": "a", "n": 1}
    for client in _start(SdxlEngine(), _openai_sizes(True)):
        answer = client.post(GEN, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sdserve-ignored-fields"] == "style"
        assert Image.open(io.BytesIO(client.get(answer.json()["data"][0]["url"]).content)).size == (1024, 1024)
        wide = client.post(GEN, json={**body, "size": "1792x1024", "response_format": "b64_json"})
        assert wide.status_code == 200 and wide.json()["size"] == "1792x1024"
    for client in _start(SdxlEngine(), _openai_sizes(False)):
        refused = client.post(GEN, json={**body, "size": "1792x1024"}).json()["error"]
        assert refused["param"] == "size" and "enable [serving] openai_sizes" in refused["message"]


def test_an_openai_size_on_sd1_is_refused_naming_served_and_native_sizes(engine: HashedEngine) -> None:
    for client in _start(engine, _openai_sizes(True)):
        error = client.post(GEN, json={"prompt": "a", "size": "1024x1024"}).json()["error"]
        assert error["param"] == "size" and "multiple of 16" not in error["message"].split(";")[0]
        assert "up to 512x512" in error["message"] and "native size is 64x64" in error["message"]
        assert "this model is sd1" in error["message"] and "enable [serving] openai_sizes_hires" in error["message"]


@pytest.mark.parametrize(("sampler", "scheduler", "ran"), [
    ("DDIM", "normal", "ddim"),  # SillyTavern's fresh-install defaults
    ("DDIM", "Karras", "ddim"), ("PLMS", "uniform", "plms"),  # no schedule type for these samplers
    ("Euler a", "Normal", "euler_a"), ("DPM++ 2M", "no-such-schedule", "dpmpp_2m_karras"),  # Automatic
])
def test_a_scheduler_the_sampler_cannot_use_falls_back_to_automatic_with_a_warning(
        client: TestClient, engine: HashedEngine, sampler: str, scheduler: str, ran: str) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, "sampler_name": sampler, "scheduler": scheduler})
    assert answer.status_code == 200, answer.text
    assert engine.batches[-1].scheduler == ran
    info = json.loads(answer.json()["info"])
    assert any(f"scheduler {scheduler!r} ignored for {sampler}" in w for w in info["warnings"])
    assert f"scheduler {scheduler!r} ignored" in answer.headers["x-sdserve-warnings"]


def test_info_carries_a1111_infotexts_per_image(client: TestClient) -> None:
    body = {"prompt": "a red kite", "negative_prompt": "blurry", "steps": 3, "cfg_scale": 7, "seed": 11,
            "batch_size": 2, "width": 64, "height": 64, "sampler_name": "DPM++ 2M", "scheduler": "Karras"}
    info = json.loads(client.post(TXT2IMG, json=body).json()["info"])
    assert info["infotexts"] == [
        f"a red kite\nNegative prompt: blurry\nSteps: 3, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 7, "
        f"Seed: {seed}, Size: 64x64, Model hash: {DIGEST[:10]}, Model: fake, Version: sdserve 0.1.0"
        for seed in (11, 12)]
    assert (info["seed"], info["width"], info["height"], info["all_seeds"]) == (11, 64, 64, [11, 12])
    assert info["all_negative_prompts"] == ["blurry", "blurry"] and info["sd_model_hash"] == DIGEST[:10]
    plain = json.loads(client.post(TXT2IMG, json={"prompt": "b", "steps": 2, "seed": 1}).json()["info"])
    assert plain["infotexts"][0].startswith("b\nSteps: 2, Sampler: Euler, Schedule type: Automatic, CFG scale: 7.5")


@pytest.mark.parametrize(("extra", "loc", "fragment"), [
    ({"tiling": True}, "tiling", "would not tile"),
    ({"enable_hr": True, "hr_upscaler": "Lanczos"}, "enable_hr", "second pass"),  # the fake serves txt2img only
    ({"enable_hr": True, "hr_upscaler": "Latent (antialiased)"}, "hr_upscaler", "antialiased"),
    ({"subseed_strength": 0.5}, "subseed_strength", "would change the image"),
    ({"clip_skip": 2}, "clip_skip", "only 1"),
])
def test_a1111_fields_whose_ignoring_would_mislead_are_422(client: TestClient, extra: dict[str, Any], loc: str,
                                                           fragment: str) -> None:
    answer = client.post(TXT2IMG, json={"prompt": "x", "steps": 2, **extra})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["body", loc] and fragment in answer.json()["detail"][0]["msg"]


def test_a1111_neutral_values_of_those_fields_are_accepted_and_named(client: TestClient) -> None:
    body = {"prompt": "x", "steps": 2, "tiling": False, "subseed_strength": 0, "clip_skip": 1,
            "seed_resize_from_w": -1, "hr_scale": "1.0", "denoising_strength": 0.61}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-sdserve-ignored-fields"] == ("clip_skip,denoising_strength,hr_scale,"
                                                         "seed_resize_from_w,subseed_strength")


@pytest.mark.parametrize("route", ["unload-checkpoint", "reload-checkpoint"])
def test_checkpoint_unload_and_reload_say_the_model_stays_resident(client: TestClient, route: str) -> None:
    answer = client.post(f"/sdapi/v1/{route}", content=b'""', headers={"content-type": "application/json"})
    assert answer.status_code == 200 and answer.headers["x-sdserve-resident"] == "true"
    assert answer.json()["resident"] is True and answer.json()["model"] == TITLE
    assert "resident" in answer.json()["detail"]
    assert client.post(TXT2IMG, json={"prompt": "x", "steps": 2}).status_code == 200  # still serving at once


def test_an_always_on_script_is_refused_naming_it_as_a1111_refuses_a_missing_script(client: TestClient) -> None:
    """SillyTavern sends ADetailer in alwayson_scripts: A1111 without it answers 422 "always on script ADetailer not
    found" (modules/api/api.py init_script_args); so does sdserve, naming the script; an empty table is no script."""
    body: dict[str, Any] = {"prompt": "a", "width": 64, "height": 64, "steps": 2,
                            "alwayson_scripts": {"ADetailer": {"args": [True, {"ad_model": "face_yolov8n.pt"}]}}}
    answer = client.post(TXT2IMG, json=body)
    assert answer.status_code == 422, answer.text
    text = json.dumps(answer.json())
    assert "always on script ADetailer not found" in text and "ADetailer is not installed" in text
    assert client.post(TXT2IMG, json={**body, "alwayson_scripts": {}}).status_code == 200
