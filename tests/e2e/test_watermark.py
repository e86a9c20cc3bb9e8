"""The invisible watermark end to end: a real `sdserve serve` (require mode, [provenance] watermark on) marks a
256x256 image before signing it: the payload in x-sdserve-watermark is the request's (payload_for(x-request-id, n)),
the signed manifest records it, `sdserve verify` reads it and says it is the manifest's (exit 0), and after the
manifest is stripped (the pixels re-saved without metadata) verify still reads it (exit 43, VERIFY_WATERMARK_ONLY).
A 64x64 image is served unmarked and says so in the header, the manifest and the metric."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from server.exitcodes import ExitCode
from server.provenance_verify import verify_bytes
from server.watermark import payload_for
from tests.e2e.conftest import ServerProcess, dev_config
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def marking_server(tiny_model: Path, credential: SigningCredential,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("watermark")
    env = credential.require_env(tmp)
    config = dev_config(tmp, replace={"\nwatermark = false": "\nwatermark = true"})
    server = ServerProcess("--config", str(config), "--model", str(tiny_model), env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


def _verify(tmp_path: Path, image: bytes, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"image-{len(list(tmp_path.iterdir()))}.png"
    path.write_bytes(image)
    return subprocess.run([sys.executable, "-m", "server.cli", "verify", str(path), *args], capture_output=True,
                          text=True, timeout=120)


def test_a_served_image_carries_its_request_s_mark_past_a_stripped_manifest(
        marking_server: ServerProcess, credential: SigningCredential, tmp_path: Path) -> None:
    response = httpx.post(f"{marking_server.url}{GEN}", json={"prompt": "a lighthouse", "steps": 2, "seed": 5,
                                                              "size": "256x256"}, timeout=120)
    assert response.status_code == 200, response.text
    image = base64.b64decode(response.json()["data"][0]["b64_json"])
    payload = payload_for(response.headers["x-request-id"], 0).hex()
    assert response.headers["x-sdserve-watermark"] == payload
    assert "watermark;dur=" in response.headers["server-timing"]
    result = verify_bytes(image, credential.ca_pem.decode())
    assert result.verdict == "trusted", result.problems  # the signature covers the marked pixels
    assert (result.generation or {})["watermark"] == {"scheme": "dwtDct", "image": 0, "payload": payload,
                                                      "bits": 64}
    assert result.watermark is not None and result.watermark["matches_manifest"] is True

    ca = tmp_path / "ca.pem"
    ca.write_bytes(credential.ca_pem)
    (tmp_path / "images").mkdir()
    done = _verify(tmp_path / "images", image, "--trust", str(ca))
    assert done.returncode == ExitCode.OK, done.stdout + done.stderr
    assert f"watermark: dwtDct {payload}" in done.stdout and "the payload the manifest records" in done.stdout

    stripped = io.BytesIO()
    with Image.open(io.BytesIO(image)) as opened:
        opened.convert("RGB").save(stripped, format="PNG")  # the pixels, no metadata: the manifest is gone
    done = _verify(tmp_path / "images", stripped.getvalue())
    assert done.returncode == ExitCode.VERIFY_WATERMARK_ONLY, done.stdout + done.stderr
    assert "WATERMARK ONLY" in done.stdout and f"watermark: dwtDct {payload}" in done.stdout


def test_a_small_image_is_served_unmarked_and_says_so(marking_server: ServerProcess,
                                                      credential: SigningCredential) -> None:
    response = httpx.post(f"{marking_server.url}{GEN}", json={"prompt": "a lighthouse", "steps": 2, "seed": 5,
                                                              "n": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["x-sdserve-watermark"] == "skipped:too_small,skipped:too_small"
    image = base64.b64decode(response.json()["data"][1]["b64_json"])
    result = verify_bytes(image, credential.ca_pem.decode())
    assert result.verdict == "trusted", result.problems
    assert (result.generation or {})["watermark"] == {"scheme": "dwtDct", "image": 1, "skipped": "too_small"}
    assert result.watermark is not None and result.watermark["payload"] is None
    metrics = httpx.get(f"{marking_server.url}/metrics").text
    skipped = [line for line in metrics.splitlines()
               if line.startswith('sdserve_watermark_images_total{outcome="skipped",reason="too_small"}')]
    assert skipped and float(skipped[0].split()[-1]) >= 2
    caps = httpx.get(f"{marking_server.url}/capabilities").json()["provenance"]
    assert caps["watermark"] == {"scheme": "dwtDct", "payload_bits": 64, "min_pixels": 65536}
