"""A Qwen-Image transformer LoRA served by a real `sdserve serve --lora-dir` (dev profile, CPU, the tiny faithful
build): A1111's ``<lora:name:mult>`` through webuiapi changes the image and names the file in the infotext, the
library lists the transformer modules it adapts, and a file that also adapts the Qwen2.5-VL text encoder is listed
refused with the reason and answered with a 4xx naming the field and the reason when asked for."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import webuiapi

from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]
PROMPT = "a red cube on a table"


@pytest.fixture(scope="module")
def server(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import diffusers

    onnx_dir, diffusers_dir = dit_build("qwen-image")
    transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, lf.QWEN_TARGETS, 4, seed=8, scale=3.0)
    folder = tmp_path_factory.mktemp("qwen-lora-library")
    lf.save_safetensors(folder / "qwen_style.safetensors", {f"diffusion_model.{k}": v for k, v in factors.items()})
    lf.peft_file(folder / "qwen_te.safetensors", {
        "transformer": factors,
        "text_encoder": {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 32), 0.1),
                         "model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((32, 4), 0.1)}})
    process = ServerProcess("--profile", "dev", "--model", str(onnx_dir), "--lora-dir", str(folder))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def test_a1111_lora_tag_on_the_qwen_transformer(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)
    kwargs = {"negative_prompt": "blurry", "width": 64, "height": 64, "seed": 5, "cfg_scale": 4.0}
    plain = api.txt2img(prompt=PROMPT, **kwargs)
    styled = api.txt2img(prompt=f"{PROMPT} <lora:qwen_style:0.8>", **kwargs)
    a, b = (np.asarray(r.image.convert("RGB"), dtype=np.int16) for r in (plain, styled))
    assert (np.abs(a - b) > 2).mean() > 0.1, "the LoRA changed the image"
    assert 'Lora hashes: "qwen_style: ' in styled.info["infotexts"][0]
    again = api.txt2img(prompt=f"<lora:qwen_style:0.8> {PROMPT}", **kwargs)  # the merged set, from the cache
    assert np.array_equal(np.asarray(again.image), np.asarray(styled.image))


def test_the_library_lists_transformer_modules_and_refuses_text_encoder_keys(server: str) -> None:
    listed = {item["name"]: item for item in httpx.get(f"{server}/sdapi/v1/loras", timeout=30).json()}
    assert listed["qwen_style"]["problem"] is None
    # 2 tiny blocks x 14 Linears, less the last block's 3 pruned text-stream modules
    assert listed["qwen_style"]["components"] == {"transformer": 25}
    problem = listed["qwen_te"]["problem"] or ""
    assert "text_encoder" in problem and "QwenImageLoraLoaderMixin" in problem
    response = httpx.post(f"{server}/sdapi/v1/txt2img", timeout=120, json={
        "prompt": f"{PROMPT} <lora:qwen_te:1>", "width": 64, "height": 64, "steps": 2})
    assert response.status_code in (400, 422), response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "prompt"]  # the tag's field
    assert "qwen_te" in detail["msg"] and "QwenImageLoraLoaderMixin" in detail["msg"]
