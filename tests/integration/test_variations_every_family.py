"""Issue 57 point 1: variations and empty-prompt img2img on every family. ``/v1/images/variations`` sends the
pipeline an empty prompt (server/routes/edits.py), which the flow pipeline refused for every mode ("prompt must not
be empty", a field that route does not have), and A1111 img2img with ``prompt: ""`` was a 422 on the flow families
while SD 1.x accepted it. Now an empty prompt is refused for txt2img only, as engines/pipelines/unet.py does, and
both routes answer an image on Flux.1, SD3, Qwen-Image and Z-Image-Turbo as on SD 1.x (FLUX.2 [klein] takes input
images as references, not as an img2img start: its variations are an instruction edit, not this path). The app
runs in this process on the real tiny builds over ONNX Runtime's CPU provider (onnxruntime/core/providers/cpu);
the empty prompt goes through each family's real tokenizer and text encoder."""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.engine import OrtEngine
from server.app import create_app
from server.settings import load_settings

Builder = Callable[[str], tuple[Path, Path]]
FAMILIES = ["sd1", "flux", "sd3", "qwen-image", "z-image-turbo", "flux2-klein"]


def _png() -> bytes:
    pixels = np.indices((64, 64)).sum(axis=0).astype(np.uint8) * 2
    buffer = io.BytesIO()
    Image.fromarray(np.stack([pixels, 255 - pixels, pixels // 2], axis=-1)).save(buffer, "PNG")
    return buffer.getvalue()


def _decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_variations_and_empty_prompt_img2img(family: str, tiny_model: Path, dit_build: Builder) -> None:
    folder = tiny_model if family == "sd1" else dit_build(family)[0]
    settings = load_settings("dev")
    engine = OrtEngine(folder, settings.runtime)
    with TestClient(create_app(engine, settings), base_url="http://localhost") as client:
        deadline = time.monotonic() + 240
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.05)
        assert family == "sd1" or engine.info.family == family
        variation = client.post("/v1/images/variations", files={"image": ("in.png", _png(), "image/png")},
                                data={"size": "64x64", "n": "1", "seed": "3"})
        assert variation.status_code == 200, variation.text
        assert _decoded(variation.json()["data"][0]["b64_json"]).size == (64, 64)
        a1111 = client.post("/sdapi/v1/img2img", json={
            "prompt": "", "init_images": [base64.b64encode(_png()).decode()], "width": 64, "height": 64,
            "steps": 2, "seed": 3, "denoising_strength": 0.6})
        assert a1111.status_code == 200, a1111.text
        assert _decoded(a1111.json()["images"][0]).size == (64, 64)
        refused = client.post("/sdapi/v1/txt2img", json={"prompt": "", "width": 64, "height": 64, "steps": 2})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "prompt"], refused.text
