"""Instruction edits end to end on the tiny FLUX.1 Kontext [dev] model (engines/build/kontext.py): a real `sdserve
serve` (dev profile, CPU, provenance required) answers the official openai client's images.edit with one image and
no mask as an instruction edit whose output depends on the input image; a list of two images is a 400 naming
``image`` and the model's limit (Kontext takes one), a mask a 400 naming ``mask`` (Kontext does not inpaint); the
signed manifest records the input as the ``parentOf`` C2PA ingredient with the SHA-256 of the bytes sent."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from PIL import Image

from server.provenance_verify import verify_bytes
from tests.e2e.conftest import ServerProcess
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(credential: SigningCredential, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from engines.build.kontext import build_tiny_kontext

    model = build_tiny_kontext(tmp_path_factory.mktemp("kontext") / "onnx")
    env = credential.require_env(tmp_path_factory.mktemp("secret"))
    server = ServerProcess("--profile", "dev", "--model", str(model), env=env)
    try:
        url = server.wait_ready(timeout=300)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=120)
    finally:
        assert server.stop() == 0, server.log


def _png(seed: int) -> bytes:
    """A patterned image; an odd seed gives its negative (the most different input of the same size)."""
    y, x = np.mgrid[0:48, 0:64].astype(np.float32)
    pixels = np.stack([127 + 120 * np.sin(x / 4.0), 127 + 120 * np.cos(y / 3.0), (x + y) % 256],
                      axis=-1).clip(0, 255).astype(np.uint8)
    pixels = 255 - pixels if seed % 2 else pixels
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _edit(client: openai.OpenAI, image: bytes) -> tuple[np.ndarray, bytes, str]:
    raw = client.images.with_raw_response.edit(image=("in.png", image, "image/png"), prompt="make it blue",
                                               size="64x48", response_format="b64_json",
                                               extra_body={"steps": 3, "seed": 11, "guidance_scale": 3.5})
    data = raw.parse().data
    assert data and data[0].b64_json
    png = base64.b64decode(data[0].b64_json)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), png, raw.headers["x-sdserve-mode"]


def test_one_image_is_an_instruction_edit_that_depends_on_it(client: openai.OpenAI,
                                                             credential: SigningCredential) -> None:
    first = _png(0)
    a, signed, mode = _edit(client, first)
    b, _, _ = _edit(client, _png(1))
    plain = client.images.generate(prompt="make it blue", size="64x48", response_format="b64_json",
                                   extra_body={"steps": 3, "seed": 11, "guidance_scale": 3.5}).data
    assert plain and plain[0].b64_json
    generated = np.asarray(Image.open(io.BytesIO(base64.b64decode(plain[0].b64_json))).convert("RGB"))
    assert mode == "instruct" and a.shape == generated.shape == (48, 64, 3)
    negative = np.abs(a.astype(np.int16) - b.astype(np.int16))
    print(f"\nkontext e2e, same seed and prompt: edit vs generation max |diff| "
          f"{np.abs(a.astype(np.int16) - generated).max()}/255; an image vs its negative {negative.max()}/255")
    assert np.abs(a.astype(np.int16) - generated).max() > 8  # the input image's tokens entered the sequence
    verified = verify_bytes(signed, credential.ca_pem.decode())
    assert verified.verdict == "trusted", verified.problems
    assert verified.ingredients == [{"title": "image", "format": "image/png", "relationship": "parentOf",
                                     "sha256": hashlib.sha256(first).hexdigest()}]
    assert verified.generation is not None and verified.generation["mode"] == "instruct"


def test_two_images_and_a_mask_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as two:
        client.images.edit(image=[("a.png", _png(0), "image/png"), ("b.png", _png(1), "image/png")], prompt="x",
                           size="64x48")
    assert two.value.param == "image" and "at most 1 input images" in str(two.value)
    with pytest.raises(openai.BadRequestError) as masked:
        client.images.edit(image=("a.png", _png(0), "image/png"), mask=("m.png", _png(1), "image/png"),
                           prompt="x", size="64x48")
    assert masked.value.param == "mask" and "cannot inpaint" in str(masked.value)
