"""FLUX.2 [klein] reference-image edits end to end on the tiny klein model with its VAE encoder
(engines/build/flux2_refs.py): a real `sdserve serve` (dev profile, CPU, provenance required) answers the official
openai client's images.edit with one image and with a list of two (the client sends repeated ``image[]`` parts), no
mask, as instruction edits whose output depends on the input images, at the first image's size when no size is
given (diffusers' rule: 83x70 is encoded, and answered, as 80x64); five images are a 400 naming ``image`` and the
limit, a mask a 400 naming ``mask``; the signed manifest lists both inputs as C2PA ingredients. Sessions run on ONNX
Runtime's CPU provider (onnxruntime/core/providers/cpu)."""

from __future__ import annotations

import base64
import hashlib
import io
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from server.provenance_verify import verify_bytes
from tests.e2e.conftest import ServerProcess
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
SETTINGS = {"steps": 2, "seed": 11}


@pytest.fixture(scope="module")
def client(credential: SigningCredential, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    from engines.build.flux2_refs import build_tiny_flux2_refs

    model = build_tiny_flux2_refs(tmp_path_factory.mktemp("flux2_refs") / "onnx")
    env = credential.require_env(tmp_path_factory.mktemp("secret"))
    server = ServerProcess("--profile", "dev", "--model", str(model), env=env)
    try:
        url = server.wait_ready(timeout=300)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0, timeout=120)
    finally:
        assert server.stop() == 0, server.log


def _png(seed: int, width: int = 83, height: int = 70) -> bytes:
    """A patterned image; an odd seed gives its negative (the most different input of the same size)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([127 + 120 * np.sin(x / 4.0), 127 + 120 * np.cos(y / 3.0), (x + y) % 256],
                      axis=-1).clip(0, 255).astype(np.uint8)
    pixels = 255 - pixels if seed % 2 else pixels
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _edit(client: openai.OpenAI, image: Any) -> tuple[np.ndarray, bytes, str]:
    raw = client.images.with_raw_response.edit(image=image, prompt="make it blue", response_format="b64_json",
                                               extra_body=SETTINGS)
    data = raw.parse().data
    assert data and data[0].b64_json
    png = base64.b64decode(data[0].b64_json)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16), png, raw.headers[
        "x-sdserve-mode"]


def test_one_and_two_images_are_instruction_edits_that_depend_on_them(client: openai.OpenAI,
                                                                      credential: SigningCredential) -> None:
    first, negative, second = _png(0), _png(1), _png(1, 64, 96)
    one, _, mode = _edit(client, ("a.png", first, "image/png"))
    other, _, _ = _edit(client, ("a.png", negative, "image/png"))
    two, signed, mode_two = _edit(client, [("a.png", first, "image/png"), ("b.png", second, "image/png")])
    assert mode == mode_two == "instruct"
    assert one.shape == other.shape == two.shape == (64, 80, 3)  # the first image's size, floored to 16
    print(f"\nflux2 e2e, same seed and prompt: an image vs its negative {np.abs(one - other).max()}/255, one image vs "
          f"two {np.abs(one - two).max()}/255")
    # the tiny transformer moves the pixels little (its latents: tests/integration/test_flux2_refs_parity.py), but
    # the same seed and prompt give bit-identical images unless the input images' tokens reach the sequence
    assert not np.array_equal(one, other) and not np.array_equal(one, two)
    verified = verify_bytes(signed, credential.ca_pem.decode())
    assert verified.verdict == "trusted", verified.problems
    assert [(i["relationship"], i["sha256"]) for i in verified.ingredients] == [
        ("parentOf", hashlib.sha256(first).hexdigest()), ("componentOf", hashlib.sha256(second).hexdigest())]
    assert verified.generation is not None and verified.generation["mode"] == "instruct"


def test_too_many_images_and_a_mask_are_refused_by_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as five:
        client.images.edit(image=[(f"{k}.png", _png(k), "image/png") for k in range(5)], prompt="x")
    assert five.value.param == "image" and "at most 4 input images" in str(five.value)
    with pytest.raises(openai.BadRequestError) as masked:
        client.images.edit(image=("a.png", _png(0), "image/png"), mask=("m.png", _png(1), "image/png"), prompt="x")
    assert masked.value.param == "mask" and "cannot inpaint" in str(masked.value)
