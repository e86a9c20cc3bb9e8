"""Qwen-Image served by a real `sdserve serve` (dev profile, CPU) from the tiny faithful build: booted through the
same self-test as every family (its canary table: true CFG 4.0), through the official openai SDK and webuiapi,
with the family's defaults from the registry (50 steps, true_cfg_scale 4.0) when a request leaves them out, the
negative prompt carried, img2img served and inpainting and other samplers refused naming the field."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import webuiapi
from PIL import Image

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def server(dit_build: Builder) -> Iterator[str]:
    process = ServerProcess("--profile", "dev", "--model", str(dit_build("qwen-image")[0]))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_through_the_openai_sdk(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a sign that says HELLO", size="64x64", n=2,
                                                   response_format="b64_json", extra_body={"steps": 4})
    assert raw.headers["x-sdserve-provider"] == "CPUExecutionProvider"
    images = [_png(d.b64_json or "") for d in raw.parse().data or []]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    first, second = (np.asarray(im.convert("RGB"), dtype=np.int16) for im in images)
    assert np.abs(first - second).max() > 0, "two seeds, two images"
    caps = httpx.get(f"{server}/capabilities", timeout=30).json()
    assert caps["family"]["family"] == "qwen-image" and caps["family"]["prediction_type"] == "flow"
    assert caps["family"]["modes"] == "txt2img,img2img" and caps["family"]["native_size"] == 64


def test_through_webuiapi_with_a_negative_prompt(server: str) -> None:
    """The negative prompt is the true-CFG row: changing it changes the image; the same seed repeats it."""
    host, port = server.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)
    kwargs = {"prompt": "a red cube on a table", "width": 64, "height": 64, "seed": 7, "cfg_scale": 4.0}
    result = api.txt2img(negative_prompt="blurry", **kwargs)
    assert result.image.size == (64, 64)
    assert result.info["seed"] == 7 and result.info["negative_prompt"] == "blurry"
    again = api.txt2img(negative_prompt="blurry", **kwargs)
    assert np.array_equal(np.asarray(again.image), np.asarray(result.image)), "same seed, same image"
    other = api.txt2img(negative_prompt="a blue sphere, cartoon", **kwargs)
    assert not np.array_equal(np.asarray(other.image), np.asarray(result.image)), "the negative prompt is used"


def test_the_familys_defaults_apply_when_a_request_leaves_them_out(server: str) -> None:
    response = httpx.post(f"{server}/sdapi/v1/txt2img", json={"prompt": "a fox", "width": 64, "height": 64},
                          timeout=300)
    assert response.status_code == 200, response.text
    info = json.loads(response.json()["info"])
    assert info["steps"] == info["steps_done"] == 50 and info["cfg_scale"] == 4.0, info
    assert "Steps: 50," in info["infotexts"][0] and "CFG scale: 4," in info["infotexts"][0]


def test_img2img_runs_and_inpainting_and_other_samplers_are_refused(server: str) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    url = f"{server}/sdapi/v1/img2img"
    body = {"prompt": "a red barn", "init_images": [image], "width": 64, "height": 64, "steps": 4,
            "denoising_strength": 0.6, "sampler_name": "Euler"}
    done = httpx.post(url, json=body, timeout=120)
    assert done.status_code == 200, done.text
    assert _png(done.json()["images"][0]).size == (64, 64)
    refused = httpx.post(url, json={**body, "mask": image}, timeout=120)
    assert refused.status_code in (400, 422), refused.text
    assert "inpaint" in refused.text and "qwen-image" in refused.text
    sampler = httpx.post(f"{server}/sdapi/v1/txt2img", json={"prompt": "a fox", "width": 64, "height": 64,
                                                             "steps": 4, "sampler_name": "DDIM"}, timeout=60)
    assert sampler.status_code == 422, sampler.text
    assert sampler.json()["detail"][0]["loc"] == ["body", "sampler_name"]
