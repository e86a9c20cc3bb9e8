"""LoRA and a FLUX.1 ControlNet unit in one request on a real `sdserve serve --profile dev --controlnet-dir
--lora-dir` (issue 56): the tiny FLUX.1 [dev] model and its ControlNet from the CLI, a transformer LoRA in the
library. The LoRA adapts the transformer and its residual variant (the same merged weights: engines/lora/residual.py),
never the ControlNet, as diffusers' ``load_lora_weights`` + ``fuse_lora`` on FluxControlNetPipeline (parity:
tests/integration/test_controlnet_dit_lora.py); the variants run on ONNX Runtime's CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_controlnet_lora_serving import _post as _post_units

pytestmark = pytest.mark.slow
TXT2IMG = "/sdapi/v1/txt2img"
PROMPT = "a lighthouse at dusk"
BASE = {"prompt": PROMPT, "steps": 4, "seed": 23, "width": 64, "height": 64,
        "sampler_name": "Euler", "cfg_scale": 3.5}


@pytest.fixture(scope="module")
def server(dit_build: Callable[[str], tuple[Path, Path]],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The session's tiny FLUX.1 [dev] build (tests/conftest.py dit_build, shared with the parity tests) copied, given
    a tiny ControlNet and the residual transformer as `sdserve engines tiny --family flux --controlnet` writes them
    (engines/build/controlnet.py build_tiny_controlnet), and a random PEFT LoRA on the transformer."""
    from engines.build.controlnet import build_tiny_controlnet

    root = tmp_path_factory.mktemp("controlnet-dit-lora-e2e")
    model, library, loras = root / "model", root / "controlnets", root / "loras"
    shutil.copytree(dit_build("flux")[0], model)
    build_tiny_controlnet(library / "flux_edges", model)
    assert (model / "transformer_controlnet" / "model.onnx").is_file()
    loras.mkdir()
    lf.write_safetensors(loras / "style.safetensors", lf.numpy_lora(model, ("transformer",), scale=0.2, seed=3))
    process = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library),
                            "--lora-dir", str(loras))
    try:
        process.wait_ready(timeout=300)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _post(url: str, prompt: str, unit: bool) -> np.ndarray:
    return _post_units(url, prompt, unit, BASE)


def test_a_lora_and_a_flux_unit_in_one_request_both_change_the_image(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    plain, lora = _post(url, PROMPT, False), _post(url, PROMPT + " <lora:style:1>", False)
    controlled, both = _post(url, PROMPT, True), _post(url, PROMPT + " <lora:style:1>", True)
    assert np.abs(lora - plain).mean() > 1.0, "the LoRA changes the plain image"
    assert np.abs(controlled - plain).mean() > 1.0, "the unit changes the plain image"
    assert np.abs(both - controlled).mean() > 1.0, "the LoRA changes the controlled image"
    assert np.abs(both - lora).mean() > 1.0, "the unit changes the LoRA image"
    assert np.array_equal(_post(url, PROMPT, True), controlled), "a unit without LoRA: the base graphs"
