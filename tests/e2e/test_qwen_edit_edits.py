"""Instruction edits end to end on the tiny Qwen-Image-Edit-Plus 2509 model (engines/build/qwen_edit.py): a real
`sdserve serve` (dev profile, CPU) answers the official openai client's images.edit with one image and with a list of
two (sent as repeated ``image[]`` parts), no mask, as instruction edits whose output depends on the input images
(engines/pipelines/qwen_edit.py: each image's vision tokens in the prompt and its latents after the noisy ones);
more images than the model takes is a 400 naming ``image`` and the limit, a mask a 400 naming ``mask``
(server/edits.py). The reference latents are encoded at diffusers' 1024² area, as the released model does."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from engines.pipelines.qwen_edit import REFERENCES
from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
BODY = {"steps": 2, "seed": 5, "guidance_scale": 1.0}
"""Two steps and no true-CFG row: the edit's own tokens are what the test is about, and the run stays short."""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from engines.build.qwen_edit import build_tiny_qwen_edit

    model = build_tiny_qwen_edit(tmp_path_factory.mktemp("qwen_edit") / "onnx")
    server = ServerProcess("--profile", "dev", "--model", str(model))
    try:
        url = server.wait_ready(timeout=300)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=180)
    finally:
        assert server.stop() == 0, server.log


def _png(seed: int, width: int = 48, height: int = 32) -> tuple[str, bytes, str]:
    """A patterned image; an odd seed gives its negative (the most different input of the same size)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([127 + 120 * np.sin(x / 4.0), 127 + 120 * np.cos(y / 3.0), (x + y) % 256],
                      axis=-1).clip(0, 255).astype(np.uint8)
    pixels = 255 - pixels if seed % 2 else pixels
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return f"in{seed}.png", buffer.getvalue(), "image/png"


def _edit(client: openai.OpenAI, image: tuple[str, bytes, str] | list[tuple[str, bytes, str]]) -> np.ndarray:
    raw = client.images.with_raw_response.edit(image=image, prompt="put them side by side", size="64x48",
                                               response_format="b64_json", extra_body=BODY)
    assert raw.headers["x-sdserve-mode"] == "instruct"
    data = raw.parse().data
    assert data and data[0].b64_json
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data[0].b64_json))).convert("RGB"), dtype=np.int16)


def test_one_image_and_a_list_of_two_are_edits_that_depend_on_the_images(client: openai.OpenAI) -> None:
    one, negative = _edit(client, _png(0)), _edit(client, _png(1))
    two = _edit(client, [_png(0), _png(1, 32, 48)])
    assert one.shape == negative.shape == two.shape == (48, 64, 3)
    figures = {"image vs its negative": np.abs(one - negative).max(), "one vs two": np.abs(one - two).max()}
    print("\nqwen-image-edit e2e, same seed and prompt, max |diff| /255:", figures)
    # the tiny model's images move little with their inputs (1 to 2/255 at 2 steps), but they move, while the
    # same input and seed repeats the same image exactly: the difference is the input's, not noise
    assert all(value > 0 for value in figures.values()), figures
    assert np.array_equal(_edit(client, _png(0)), one)


def test_more_images_than_the_model_takes_and_a_mask_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as many:
        client.images.edit(image=[_png(k) for k in range(REFERENCES + 1)], prompt="x", size="64x48")
    assert many.value.param == "image" and f"at most {REFERENCES} input images" in str(many.value)
    with pytest.raises(openai.BadRequestError) as masked:
        client.images.edit(image=_png(0), mask=_png(1), prompt="x", size="64x48")
    assert masked.value.param == "mask" and "cannot inpaint" in str(masked.value)
