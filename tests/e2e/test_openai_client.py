"""The official `openai` client against a real `sdserve serve` process."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import ServerProcess


@pytest.fixture(scope="module")
def client(dev_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dev_server}/v1", api_key="not-needed", max_retries=0)


def test_images_generate_returns_pngs_of_the_requested_size_and_count(client: openai.OpenAI) -> None:
    result = client.images.generate(model="dall-e-2", prompt="a watercolor fox", n=2, size="64x64",  # type: ignore[arg-type]
                                    response_format="b64_json")
    assert len(result.data) == 2
    for item in result.data:
        assert item.b64_json is not None
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert image.format == "PNG" and image.size == (64, 64) and image.mode == "RGB"


def test_non_square_size(client: openai.OpenAI) -> None:
    result = client.images.generate(prompt="a tall tower", size="48x80", response_format="b64_json",  # type: ignore[arg-type]
                                    extra_body={"steps": 4})
    assert result.data[0].b64_json is not None
    assert Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).size == (48, 80)


def test_same_seed_same_bytes_different_seed_different_bytes(client: openai.OpenAI) -> None:
    def png(seed: int) -> str:
        out = client.images.generate(prompt="a lighthouse", size="64x64", response_format="b64_json",  # type: ignore[arg-type]
                                     extra_body={"seed": seed, "steps": 8, "scheduler": "euler_a"})
        assert out.data[0].b64_json is not None
        return out.data[0].b64_json

    first, second, other = png(123), png(123), png(124)
    assert first == second
    assert first != other


def test_bad_input_raises_bad_request_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x", size="100x100", response_format="b64_json")  # type: ignore[arg-type]
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "size"


def test_dev_boot_warns_loudly(dev_process: ServerProcess) -> None:
    assert "NOT accelerated" in dev_process.log

def test_capabilities_say_not_accelerated(dev_server: str) -> None:
    caps = httpx.get(f"{dev_server}/capabilities").json()
    assert caps["accelerated"] is False
    assert "NOT ACCELERATED" in caps["warning"] and "CPU allowed by the profile" in caps["warning"]
    assert caps["sessions"]["unet"]["providers_used"][0] == "CPUExecutionProvider"
    assert caps["verdict"]["status"] == "cpu-dev"
    assert caps["server"]["state"] == "ready"
