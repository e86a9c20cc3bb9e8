"""Provenance end to end: a real `sdserve serve` in require mode, its key and chain from the environment (as a
Kubernetes Secret gives them), a CA made in the test. Every image of the OpenAI and A1111 routes (PNG, JPEG,
WebP) carries a signed C2PA manifest that validates against the CA and is untrusted without it; the manifest's
facts are the ones /capabilities and the same response's headers state; the key is never logged nor shown; and
require without a key exits 13 before the port opens."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import hashes
from PIL import Image

from server.exitcodes import ExitCode
from server.provenance_verify import Verification, verify_bytes
from tests.e2e.conftest import ServerProcess
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
GEN = "/v1/images/generations"


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


def _checked(image: bytes, response: httpx.Response, credential: SigningCredential) -> Verification:
    """The image validates against the CA, is untrusted without it, and its facts match the response headers."""
    assert response.headers["x-sdserve-provenance"] == "c2pa"
    assert "sign;dur=" in response.headers["server-timing"]
    result = verify_bytes(image, credential.ca_pem.decode())
    assert result.verdict == "trusted", result.problems
    assert verify_bytes(image).verdict == "untrusted"
    facts = result.generation
    assert facts is not None
    assert facts["request_id"] == response.headers["x-request-id"]
    assert facts["provider"] == response.headers["x-sdserve-provider"]
    assert facts["model_served"] == response.headers["x-sdserve-model"]
    assert str(facts["seed"]) in response.headers["x-sdserve-seeds"].split(",")
    assert facts["readiness"] == "ready" and "prompt" not in facts  # prompts only when the profile opts in
    made = result.actions[1] if result.ingredients else result.actions[0]  # an edit: opened, then edited
    assert made["action"] == ("c2pa.edited" if result.ingredients else "c2pa.created")
    assert made["digitalSourceType"].endswith("/trainedAlgorithmicMedia")
    return result


def _matches_capabilities(facts: dict[str, Any], caps: dict[str, Any]) -> None:
    assert facts["providers"] == {name: s["providers_used"][0] for name, s in caps["sessions"].items()}
    assert facts["versions"]["onnxruntime"] == caps["observations"]["onnxruntime"]
    assert facts["model"]["family"] == caps["family"]["family"] and facts["device"] == caps["device"]
    assert facts["accelerated"] == caps["accelerated"]
    assert facts["model"]["verification"] == caps["artifacts"]["model_manifest"]


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_openai_images_are_signed_in_every_format(signing_server: ServerProcess, credential: SigningCredential,
                                                  fmt: str) -> None:
    url = signing_server.url
    response = httpx.post(f"{url}{GEN}", json={"prompt": "a lighthouse", "steps": 2, "seed": 7, "n": 2,
                                               "output_format": fmt}, timeout=60)
    assert response.status_code == 200, response.text
    images = [base64.b64decode(d["b64_json"]) for d in response.json()["data"]]
    results = [_checked(image, response, credential) for image in images]
    assert [r.generation["seed"] for r in results if r.generation] == \
        [int(s) for s in response.headers["x-sdserve-seeds"].split(",")]
    assert results[0].media_type == f"image/{fmt}"
    caps = httpx.get(f"{url}/capabilities").json()
    _matches_capabilities(results[0].generation or {}, caps)


def test_a1111_images_are_signed_over_their_infotext(signing_server: ServerProcess,
                                                     credential: SigningCredential) -> None:
    response = httpx.post(f"{signing_server.url}/sdapi/v1/txt2img",
                          json={"prompt": "a lighthouse", "steps": 2, "seed": 11, "batch_size": 2}, timeout=60)
    assert response.status_code == 200, response.text
    images = [base64.b64decode(i) for i in response.json()["images"]]
    for image in images:
        facts = _checked(image, response, credential).generation or {}
        assert facts["steps"] == 2 and facts["mode"] == "txt2img"


def test_inpainting_is_signed_after_its_paste_back(signing_server: ServerProcess,
                                                  credential: SigningCredential) -> None:
    """A1111 inpainting at full resolution re-encodes the image after the batch (the paste-back): the signature
    covers those final bytes, and the manifest says the mode and strength."""
    init, mask = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (64, 64), (200, 120, 40)).save(init, format="PNG")
    canvas = Image.new("L", (64, 64), 0)
    canvas.paste(255, (16, 16, 48, 48))
    canvas.save(mask, format="PNG")
    body = {"prompt": "a lighthouse", "steps": 2, "seed": 3, "denoising_strength": 0.6, "inpaint_full_res": True,
            "init_images": [base64.b64encode(init.getvalue()).decode()],
            "mask": base64.b64encode(mask.getvalue()).decode()}
    response = httpx.post(f"{signing_server.url}/sdapi/v1/img2img", json=body, timeout=60)
    assert response.status_code == 200, response.text
    facts = _checked(base64.b64decode(response.json()["images"][0]), response, credential).generation or {}
    assert facts["mode"] == "inpaint" and facts["strength"] == 0.6


def test_the_key_is_never_logged_nor_shown(signing_server: ServerProcess, credential: SigningCredential) -> None:
    caps = httpx.get(f"{signing_server.url}/capabilities").text
    metrics = httpx.get(f"{signing_server.url}/metrics").text
    key_lines = [line for line in credential.key_pem.decode().splitlines() if "PRIVATE KEY" not in line]
    for shown in (caps, metrics, signing_server.log):
        assert "PRIVATE KEY" not in shown and not any(line in shown for line in key_lines)
    provenance = httpx.get(f"{signing_server.url}/capabilities").json()["provenance"]
    assert provenance["mode"] == "require" and provenance["signing"] is True
    assert provenance["certificate"]["sha256_fingerprint"] == credential.leaf.fingerprint(hashes.SHA256()).hex()
    signed = [line for line in metrics.splitlines()
              if line.startswith('sdserve_provenance_images_total{outcome="signed"')]
    assert signed and float(signed[0].split()[-1]) > 0


def test_require_without_a_key_exits_13_before_the_port_opens(tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDSERVE_PROVENANCE_")}
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--profile", "dev", "--model",
                           str(tiny_model), "--port", "0"], capture_output=True, text=True, timeout=120,
                          env={**env, "SDSERVE_PROVENANCE_MODE": "require"})
    assert done.returncode == ExitCode.PROVENANCE_KEY_INVALID == 13, done.stderr[-2000:]
    assert "PROVENANCE_KEY_INVALID" in done.stderr and "listening on" not in done.stderr
