"""LoRA and ControlNet in one request on a real `sdserve serve --profile dev --controlnet-dir --lora-dir` (issue 56):
the tiny SD 1.x model and its ControlNet from the CLI, a UNet LoRA in the library. The LoRA adapts the UNet and its
residual variant (the same merged weights: engines/lora/residual.py), never the ControlNet, as diffusers'
``load_lora_weights`` + ``fuse_lora`` on StableDiffusionControlNetPipeline (parity:
tests/integration/test_controlnet_lora.py); the variants run on ONNX Runtime's CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess, controlnet_copy
from tests.e2e.test_controlnet_serving import _pattern, _pixels

pytestmark = pytest.mark.slow
TXT2IMG = "/sdapi/v1/txt2img"
BASE = {"prompt": "a lighthouse at dusk", "steps": 4, "seed": 21, "width": 64, "height": 64,
        "sampler_name": "Euler", "cfg_scale": 7.0}


@pytest.fixture(scope="module")
def server(controlnet_tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("controlnet-lora-e2e")
    model, library = controlnet_copy(controlnet_tiny, root)  # the session's `engines tiny --controlnet` build
    loras = root / "loras"
    loras.mkdir()
    lf.write_safetensors(loras / "style.safetensors", lf.numpy_lora(model, scale=0.2, seed=3))
    process = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library),
                            "--lora-dir", str(loras))
    try:
        process.wait_ready(timeout=300)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _post(url: str, prompt: str, unit: bool, base: dict[str, object] = BASE) -> np.ndarray:
    """One A1111 txt2img of ``base`` with ``prompt``, with or without one canny unit of the listed ControlNet."""
    listed = httpx.get(f"{url}/controlnet/model_list").json()["model_list"]
    units = [{"enabled": True, "image": _pattern(), "module": "canny", "model": listed[0], "weight": 1.0,
              "threshold_a": 100, "threshold_b": 200}]
    body = {**base, "prompt": prompt, **({"alwayson_scripts": {"controlnet": {"args": units}}} if unit else {})}
    answer = httpx.post(url + TXT2IMG, json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return _pixels(answer.json()["images"][0])


def test_a_lora_and_a_unit_in_one_request_both_change_the_image(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    plain, lora = _post(url, BASE["prompt"], False), _post(url, BASE["prompt"] + " <lora:style:1>", False)
    controlled, both = _post(url, BASE["prompt"], True), _post(url, BASE["prompt"] + " <lora:style:1>", True)
    assert np.abs(lora - plain).mean() > 1.0, "the LoRA changes the plain image"
    assert np.abs(controlled - plain).mean() > 1.0, "the unit changes the plain image"
    assert np.abs(both - controlled).mean() > 1.0, "the LoRA changes the controlled image"
    assert np.abs(both - lora).mean() > 1.0, "the unit changes the LoRA image"
    assert np.array_equal(_post(url, BASE["prompt"], True), controlled), "a unit without LoRA: the base graphs"
