"""A real `sdserve serve --lora-dir` over a library of hostile files (issue 43): the boot succeeds and lists each
bad file with its reason (before, a symlink loop, a header nested 200k deep or a 4,400-digit integer failed the
boot); a refresh that meets new bad files answers 200 (before, a 500 until the file went); a NaN LoRA is a 422,
not a 500 after the generation; aiyabot's ``<lora:filmGrainV2:0.85>`` names a file by its alias; a CJK-named
LoRA serves; a flood of concurrent refreshes is answered while generations run."""

from __future__ import annotations

import asyncio
import base64
import io
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
TXT2IMG = {"width": 64, "height": 64, "steps": 3, "seed": 9, "sampler_name": "Euler"}


@pytest.fixture(scope="module")
def folder(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile-library")
    factors = lf.numpy_lora(tiny_model, ("unet", "text_encoder"), rank=4, seed=5, scale=0.3)
    lf.write_safetensors(root / "film_grain_v2.safetensors", factors, {"ss_output_name": "filmGrainV2"})
    lf.write_safetensors(root / "水彩画.safetensors", {k: -v for k, v in factors.items()})
    os.symlink("loop.safetensors", root / "loop.safetensors")
    lf.raw_safetensors(root / "deep.safetensors", b"[" * 200_000 + b"]" * 200_000)
    lf.raw_safetensors(root / "bigint.safetensors", b'{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, '
                       + b"9" * 4400 + b"]}}")
    poisoned = dict(factors)
    key = sorted(poisoned)[0]
    poisoned[key] = poisoned[key].copy()
    poisoned[key].flat[0] = np.nan
    lf.write_safetensors(root / "nan.safetensors", poisoned)
    lf.write_safetensors(root / "bad\rname.safetensors", factors)
    return root


@pytest.fixture(scope="module")
def server(tiny_model: Path, folder: Path) -> Iterator[str]:
    process = ServerProcess("--profile", "dev", "--model", str(tiny_model), "--lora-dir", str(folder))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _txt2img(url: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{url}/sdapi/v1/txt2img", json={**TXT2IMG, "prompt": prompt}, timeout=120)


def _pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    image = Image.open(io.BytesIO(base64.b64decode(response.json()["images"][0])))
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_the_server_boots_over_hostile_files_and_lists_each_reason(server: str) -> None:
    listed = {i["name"]: i for i in httpx.get(f"{server}/sdapi/v1/loras", timeout=30).json()}
    assert "symlink loop" in listed["loop"]["problem"]
    assert "nests too deep" in listed["deep"]["problem"]
    assert "not JSON" in listed["bigint"]["problem"]
    assert "NaN" in listed["nan"]["problem"]
    assert "U+000D" in listed["bad\\u000dname"]["problem"]
    assert listed["film_grain_v2"]["alias"] == "filmGrainV2" and listed["film_grain_v2"]["problem"] is None
    assert listed["水彩画"]["problem"] is None


def test_a_refresh_meeting_new_bad_files_answers_and_lists_them(server: str, folder: Path) -> None:
    os.symlink("pong.safetensors", folder / "ping.safetensors")
    os.symlink("ping.safetensors", folder / "pong.safetensors")
    os.mkfifo(folder / "fifo.safetensors")
    try:
        response = httpx.post(f"{server}/sdapi/v1/refresh-loras", timeout=60)
        assert response.status_code == 200, response.text
        listed = {i["name"]: i for i in response.json()}
        assert "symlink loop" in listed["ping"]["problem"] and "not a regular file" in listed["fifo"]["problem"]
    finally:
        for name in ("ping", "pong", "fifo"):
            (folder / f"{name}.safetensors").unlink()
        assert httpx.post(f"{server}/sdapi/v1/refresh-loras", timeout=60).status_code == 200


def test_a_nan_lora_is_refused_by_field_not_a_500(server: str) -> None:
    response = _txt2img(server, "a lighthouse <lora:nan:1>")
    assert response.status_code == 422, response.text
    assert "NaN" in response.text and "prompt" in response.text


def test_aiyabot_names_a_lora_by_its_alias(server: str) -> None:
    """aiyabot writes the alias (ss_output_name) into the tag, as A1111 lists it; the same file, the same image."""
    by_alias = _pixels(_txt2img(server, "a lighthouse <lora:filmGrainV2:0.85>"))
    by_name = _pixels(_txt2img(server, "a lighthouse <lora:film_grain_v2:0.85>"))
    plain = _pixels(_txt2img(server, "a lighthouse"))
    assert np.array_equal(by_alias, by_name)
    assert (np.abs(by_alias - plain) > 2).mean() > 0.05


def test_a_cjk_named_lora_serves(server: str) -> None:
    styled = _pixels(_txt2img(server, "a lighthouse <lora:水彩画:1>"))
    plain = _pixels(_txt2img(server, "a lighthouse"))
    assert (np.abs(styled - plain) > 2).mean() > 0.05


def test_a_flood_of_refreshes_is_answered_while_generations_run(server: str) -> None:
    """Forty concurrent refreshes share scans (unchanged files are not read again); a generation and the health
    probe beside them are answered."""
    async def flood() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as client:
            refreshes = [client.post("/sdapi/v1/refresh-loras") for _ in range(40)]
            generation = client.post("/sdapi/v1/txt2img", json={**TXT2IMG, "prompt": "a cat <lora:水彩画:0.5>"})
            health = client.get("/health")
            *done, generated, probed = await asyncio.gather(*refreshes, generation, health)
            return done, generated, probed

    done, generated, probed = asyncio.run(flood())
    assert all(r.status_code == 200 for r in done), [r.status_code for r in done]
    assert len({r.content for r in done}) == 1  # one library, listed identically to every caller
    assert generated.status_code == 200, generated.text
    assert probed.status_code == 200
