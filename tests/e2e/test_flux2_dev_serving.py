"""FLUX.2 [dev] served by a real `sdserve serve` (dev profile, CPU) from its tiny faithful build (a Mistral3 text
encoder under the pipeline's system message, the guidance embedded in the transformer): booted through the same
self-test as every family, through the official openai SDK (POST /v1/images/generations) and the A1111 route
(/sdapi/v1/txt2img) with the family's defaults from the registry (50 steps, guidance 4.0, diffusers'
``Flux2Pipeline``'s) when a request leaves them out, and Forge's ``distilled_cfg_scale`` setting the embedded
guidance; the build has its VAE encoder, so the boot runs the family's edit canary and the openai client's
images.edit with one image and with a list of two, no mask, is an instruction edit depending on them (up to [dev]'s
6 images, one more a 400 naming ``image`` and the limit). Sessions run on ONNX Runtime's CPU provider
(onnxruntime/core/providers/cpu)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def server(dit_build: Builder) -> Iterator[str]:
    process = ServerProcess("--profile", "dev", "--model", str(dit_build("flux2-dev")[0]))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def test_through_the_openai_sdk(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a sign that says HELLO", size="64x64", n=2,
                                                   response_format="b64_json")
    assert raw.headers["x-sdserve-provider"] == "CPUExecutionProvider"
    first, second = (_png(d.b64_json or "") for d in raw.parse().data or [])
    assert first.shape == second.shape == (64, 64, 3)
    assert np.abs(first - second).max() > 0, "two seeds, two images"
    caps = httpx.get(f"{server}/capabilities", timeout=30).json()
    assert caps["family"]["family"] == "flux2-dev" and caps["family"]["prediction_type"] == "flow"
    assert caps["family"]["modes"] == "txt2img,img2img,instruct" and caps["family"]["native_size"] == 64


def test_a1111_txt2img_with_the_familys_defaults(server: str) -> None:
    """Steps and guidance left out: the registry's (50, 4.0); the same seed repeats the image, another prompt
    changes it; ``distilled_cfg_scale`` changes the embedded guidance; a non-multiple of 16 is refused naming the
    field."""
    url = f"{server}/sdapi/v1/txt2img"
    body = {"prompt": "a red cube on a table", "width": 64, "height": 48, "seed": 7}
    done = httpx.post(url, json=body, timeout=300)
    assert done.status_code == 200, done.text
    info = json.loads(done.json()["info"])
    assert info["steps"] == info["steps_done"] == 50 and info["seed"] == 7, info
    image = _png(done.json()["images"][0])
    assert image.shape == (48, 64, 3)
    short = {**body, "steps": 4}
    at_4 = _png(httpx.post(url, json=short, timeout=120).json()["images"][0])
    assert np.array_equal(_png(httpx.post(url, json={**short, "distilled_cfg_scale": 4.0}, timeout=120)
                               .json()["images"][0]), at_4), "guidance 4.0 is the default"
    other = _png(httpx.post(url, json={**short, "prompt": "a blue sphere in the grass"}, timeout=120)
                 .json()["images"][0])
    assert not np.array_equal(other, at_4), "the prompt is used"
    guided = _png(httpx.post(url, json={**short, "distilled_cfg_scale": 8.0}, timeout=120).json()["images"][0])
    assert not np.array_equal(guided, at_4), "the embedded guidance is used"
    odd = httpx.post(url, json={**body, "width": 72}, timeout=60)
    assert odd.status_code in (400, 422), odd.text
    assert "width" in odd.text


def _upload(k: int, width: int = 83, height: int = 70) -> tuple[str, bytes, str]:
    """A patterned PNG upload; an odd ``k`` gives its negative (the most different input of the same size)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([127 + 120 * np.sin(x / 4.0), 127 + 120 * np.cos(y / 3.0), (x + y) % 256],
                      axis=-1).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(255 - pixels if k % 2 else pixels).save(buffer, format="PNG")
    return f"{k}.png", buffer.getvalue(), "image/png"


def test_openai_edits_with_one_and_two_images_depend_on_them(server: str) -> None:
    """Flux2Pipeline's ``image=``: the output at the first image's size floored to 16 (83x70 -> 80x64), bit-identical
    for the same seed and prompt unless the input images' tokens reach the sequence; 7 images refused by name."""
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", max_retries=0, timeout=120)

    def edit(image: Any) -> tuple[np.ndarray, str]:
        raw = client.images.with_raw_response.edit(image=image, prompt="make it blue", response_format="b64_json",
                                                   extra_body={"steps": 2, "seed": 11})
        data = raw.parse().data
        assert data and data[0].b64_json
        return _png(data[0].b64_json), raw.headers["x-sdserve-mode"]

    (one, mode), (other, _) = edit(_upload(0)), edit(_upload(1))
    two, mode_two = edit([_upload(0), _upload(1, 64, 96)])
    assert mode == mode_two == "instruct"
    assert one.shape == other.shape == two.shape == (64, 80, 3)
    assert not np.array_equal(one, other) and not np.array_equal(one, two)
    with pytest.raises(openai.BadRequestError) as seven:
        client.images.edit(image=[_upload(k, 64, 64) for k in range(7)], prompt="x")
    assert seven.value.param == "image" and "at most 6 input images" in str(seven.value)
