"""Edit provenance end to end: a real `sdserve serve` on the tiny SD model in require mode. The official openai
client's images.edit with a list of two images is refused on SD (not an instruction-edit model) with a 400 naming
``image``; with one image the signed manifest records it as one C2PA ingredient, ``parentOf``, with the SHA-256 of
the bytes sent, and `sdserve verify --json` lists it; A1111 img2img records each init image as the parent of the
images it made and the mask as an input."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from server.provenance_verify import verify_bytes
from tests.e2e.conftest import ServerProcess
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def signing_server(tiny_model: Path, credential: SigningCredential,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = credential.require_env(tmp_path_factory.mktemp("secret"))
    server = ServerProcess("--profile", "dev", "--model", str(tiny_model), env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_openai_edit_records_its_image_and_refuses_two_on_sd(signing_server: ServerProcess,
                                                              credential: SigningCredential, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{signing_server.url}/v1", api_key="not-needed", max_retries=0)
    first, second = _png((200, 30, 30)), _png((30, 30, 200))
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=[("a.png", first, "image/png"), ("b.png", second, "image/png")], prompt="merge",
                           size="64x64", response_format="b64_json")
    assert refused.value.status_code == 400 and refused.value.param == "image"
    assert "got 2" in str(refused.value)
    result = client.images.edit(image=("a.png", first, "image/png"), prompt="a hat", size="64x64",
                                response_format="b64_json", extra_body={"steps": 2, "seed": 5})
    assert result.data and result.data[0].b64_json
    signed = base64.b64decode(result.data[0].b64_json)
    verified = verify_bytes(signed, credential.ca_pem.decode())
    assert verified.verdict == "trusted", verified.problems
    want = {"title": "image", "format": "image/png", "relationship": "parentOf",
            "sha256": hashlib.sha256(first).hexdigest()}
    assert verified.ingredients == [want]
    assert [a["action"] for a in verified.actions] == ["c2pa.opened", "c2pa.edited"]
    (tmp_path / "out.png").write_bytes(signed)
    (tmp_path / "ca.pem").write_bytes(credential.ca_pem)
    shown = subprocess.run([sys.executable, "-m", "server.cli.main", "verify", "--json", "--trust",
                            str(tmp_path / "ca.pem"), str(tmp_path / "out.png")],
                           capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["ingredients"] == [want]
    text = subprocess.run([sys.executable, "-m", "server.cli.main", "verify", "--trust", str(tmp_path / "ca.pem"),
                           str(tmp_path / "out.png")], capture_output=True, text=True, timeout=60, check=False)
    assert f"ingredient: image parentOf sha256 {want['sha256']}" in text.stdout, text.stdout


def test_a1111_img2img_records_each_init_image_as_its_images_parent(signing_server: ServerProcess,
                                                                     credential: SigningCredential) -> None:
    inits = [_png((10, 120, 10)), _png((120, 10, 120))]
    mask = _png((255, 255, 255))
    body = {"prompt": "a lighthouse", "steps": 2, "seed": 3, "batch_size": 2, "width": 64, "height": 64,
            "denoising_strength": 0.6, "inpaint_full_res": False, "mask": base64.b64encode(mask).decode(),
            "init_images": [base64.b64encode(i).decode() for i in inits]}
    response = httpx.post(f"{signing_server.url}/sdapi/v1/img2img", json=body, timeout=60)
    assert response.status_code == 200, response.text
    for k, image in enumerate(response.json()["images"]):
        verified = verify_bytes(base64.b64decode(image), credential.ca_pem.decode())
        assert verified.verdict == "trusted", verified.problems
        assert verified.ingredients == [
            {"title": f"init_images.{k}", "format": "image/png", "relationship": "parentOf",
             "sha256": hashlib.sha256(inits[k]).hexdigest()},
            {"title": "mask", "format": "image/png", "relationship": "inputTo",
             "sha256": hashlib.sha256(mask).hexdigest()}]
