"""FLUX.2 [klein] served by a real `sdserve serve` (dev profile, CPU) from the tiny faithful build of the distilled
checkpoint: booted through the same self-test as every family, through the official openai SDK (POST
/v1/images/generations) and the A1111 route (/sdapi/v1/txt2img), with the family's defaults from the registry (4
steps, guidance 1) when a request leaves them out; img2img (not served: the klein pipeline takes images as
references) and inpainting refused naming the field. Sessions run on ONNX Runtime's CPU provider
(onnxruntime/core/providers/cpu)."""

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
    process = ServerProcess("--profile", "dev", "--model", str(dit_build("flux2-klein")[0]))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_through_the_openai_sdk(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="not-needed", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a sign that says HELLO", size="64x64", n=2,
                                                   response_format="b64_json")
    assert raw.headers["x-sdserve-provider"] == "CPUExecutionProvider"
    images = [_png(d.b64_json or "") for d in raw.parse().data or []]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    first, second = (np.asarray(im.convert("RGB"), dtype=np.int16) for im in images)
    assert np.abs(first - second).max() > 0, "two seeds, two images"
    caps = httpx.get(f"{server}/capabilities", timeout=30).json()
    assert caps["family"]["family"] == "flux2-klein" and caps["family"]["prediction_type"] == "flow"
    assert caps["family"]["modes"] == "txt2img,img2img,instruct" and caps["family"]["native_size"] == 64


def test_a1111_txt2img_with_the_familys_defaults(server: str) -> None:
    """Steps and guidance left out: the registry's (4, 1.0); the same seed repeats the image, another prompt
    changes it; a non-multiple of 16 is refused naming the field."""
    url = f"{server}/sdapi/v1/txt2img"
    body = {"prompt": "a red cube on a table", "width": 64, "height": 48, "seed": 7}
    done = httpx.post(url, json=body, timeout=120)
    assert done.status_code == 200, done.text
    info = json.loads(done.json()["info"])
    assert info["steps"] == info["steps_done"] == 4 and info["cfg_scale"] == 1.0 and info["seed"] == 7, info
    image = np.asarray(_png(done.json()["images"][0]).convert("RGB"))
    assert image.shape == (48, 64, 3)
    again = httpx.post(url, json=body, timeout=120).json()
    assert np.array_equal(np.asarray(_png(again["images"][0]).convert("RGB")), image), "same seed, same image"
    other = httpx.post(url, json={**body, "prompt": "a blue sphere in the grass"}, timeout=120).json()
    assert not np.array_equal(np.asarray(_png(other["images"][0]).convert("RGB")), image), "the prompt is used"
    odd = httpx.post(url, json={**body, "width": 72}, timeout=60)
    assert odd.status_code in (400, 422), odd.text
    assert "width" in odd.text


def test_a1111_img2img_is_a_reference_edit_and_a_mask_is_refused_naming_the_field(server: str) -> None:
    """The tiny build has its VAE encoder (engines/build/flux2_refs.py): an A1111 img2img's init image is a reference
    image (Flux2KleinPipeline's ``image=``), answered at the asked size; a mask (inpainting, not served for FLUX.2)
    is refused naming ``mask``."""
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    body = {"prompt": "a red barn", "init_images": [image], "width": 64, "height": 48, "steps": 2}
    edited = httpx.post(f"{server}/sdapi/v1/img2img", json=body, timeout=300)
    assert edited.status_code == 200, edited.text
    assert np.asarray(_png(edited.json()["images"][0]).convert("RGB")).shape == (48, 64, 3)
    masked = httpx.post(f"{server}/sdapi/v1/img2img", json={**body, "mask": image}, timeout=60)
    assert masked.status_code in (400, 422), masked.text
    assert "mask" in masked.text
