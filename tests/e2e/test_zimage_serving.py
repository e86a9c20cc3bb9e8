"""Z-Image served by a real `sdserve serve` (dev profile, CPU) from the tiny faithful build (engines/build/zimage.py):
booted through the same self-test as every family (its canary table: CFG 5.0), through the official openai SDK and
the A1111 route with a negative prompt, with the family's defaults from the registry (50 steps, guidance 5) when a
request leaves them out. Parity with diffusers is tests/integration/test_zimage_parity.py's."""

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
from PIL import Image

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def server(dit_build: Builder) -> Iterator[str]:
    process = ServerProcess("--profile", "dev", "--model", str(dit_build("z-image")[0]))
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
    assert caps["family"]["family"] == "z-image" and caps["family"]["prediction_type"] == "flow"


def test_the_a1111_route_uses_the_negative_prompt_and_repeats_a_seed(server: str) -> None:
    def run(negative: str) -> tuple[np.ndarray, dict]:
        body = {"prompt": "a red cube on a table", "negative_prompt": negative, "width": 64, "height": 64,
                "steps": 4, "cfg_scale": 4.0, "seed": 7}
        response = httpx.post(f"{server}/sdapi/v1/txt2img", json=body, timeout=300)
        assert response.status_code == 200, response.text
        image = np.asarray(_png(response.json()["images"][0]).convert("RGB"))
        return image, json.loads(response.json()["info"])

    image, info = run("blurry")
    assert info["seed"] == 7 and info["negative_prompt"] == "blurry"
    assert np.array_equal(run("blurry")[0], image), "same seed, same image"
    assert not np.array_equal(run("a blue sphere, cartoon")[0], image), "the negative prompt is the CFG row"


def test_the_familys_defaults_apply_when_a_request_leaves_them_out(server: str) -> None:
    response = httpx.post(f"{server}/sdapi/v1/txt2img", json={"prompt": "a fox", "width": 64, "height": 64},
                          timeout=300)
    assert response.status_code == 200, response.text
    info = json.loads(response.json()["info"])
    assert info["steps"] == info["steps_done"] == 50 and info["cfg_scale"] == 5.0, info
