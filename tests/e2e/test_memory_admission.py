"""The issue's reproducer (issue 43, item 2): a 1024x1792 OpenAI request on an SD 1.x model, served through Hires
fix (``[serving] openai_sizes_hires``), grew the server past 20 GB until the kernel killed it (a 500 under a 13 GB
limit). Now its memory is estimated before anything runs and it is refused with a 4xx naming the budget; the server
stays up and serves what fits. The tiny model is SD 1.x; the budget (300 MiB) is set so its 1024x1792 estimate (tens
of GiB: the VAE's mid-block attention over 28,672 latent pixels, the UNet's over 7,168) cannot fit, nor one 512x512
image's decode (379 MiB), while 256x256 (95 MiB) does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ServerProcess, dev_config

GEN, A1111 = "/v1/images/generations", "/sdapi/v1/txt2img"


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    profile = dev_config(tmp_path_factory.mktemp("memory"), replace={
        "openai_sizes = false": "openai_sizes = false\nopenai_sizes_hires = true",
        "memory_budget_mb = 0 ": "memory_budget_mb = 300 "})
    process = ServerProcess("--config", str(profile), "--model", str(tiny_model))
    try:
        yield process.wait_ready(timeout=300)
        assert "memory budget per batch: 0.29 GiB ([limits] memory_budget_mb)" in process.log
    finally:
        assert process.stop() == 0, process.log


def test_1024x1792_on_sd1_is_refused_before_any_compute_naming_the_budget(server: str) -> None:
    start = time.monotonic()
    refused = httpx.post(f"{server}{GEN}", json={"prompt": "a lighthouse", "size": "1024x1792"}, timeout=120)
    assert time.monotonic() - start < 10, "the refusal came after computing"
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "size" and error["type"] == "invalid_request_error"
    message = error["message"]
    assert "estimated peak memory" in message and "at 1024x1792" in message and "Hires fix" in message
    assert "exceeds this server's memory budget 0.29 GiB ([limits] memory_budget_mb)" in message
    assert httpx.get(f"{server}/health").status_code == 200
    metrics = httpx.get(f"{server}/metrics").text
    assert 'sdserve_requests_refused_total{reason="over_memory"}' in metrics


def test_what_fits_is_served_and_a_hires_target_over_the_budget_is_422(server: str) -> None:
    fits = httpx.post(f"{server}{GEN}", json={"prompt": "a", "size": "256x256", "steps": 2}, timeout=300)
    assert fits.status_code == 200, fits.text
    body = {"prompt": "a", "width": 256, "height": 256, "steps": 2, "enable_hr": True, "hr_scale": 2,
            "denoising_strength": 0.5}
    refused = httpx.post(f"{server}{A1111}", json=body, timeout=120)
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"][-1] == "hr_scale" and "Hires fix second pass of 1 image(s) at 512x512" in detail["msg"]
    small = httpx.post(f"{server}{A1111}", json={**body, "width": 64, "height": 64}, timeout=300)
    assert small.status_code == 200, small.text  # the same request at a target that fits: both passes run
