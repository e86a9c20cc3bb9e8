"""The flow-matching DiT families served by a real `sdserve serve` (dev profile, CPU): a tiny Flux (dev-like,
guidance embedded) and a tiny SD 3.5 (three encoders, CFG with a negative prompt), each through the official openai
SDK and webuiapi, each booted through the same self-test as the UNet families; the family's own defaults (steps,
guidance) apply when a request leaves them out; what a DiT does not serve (inpainting, samplers other than Euler)
is refused naming the field."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import webuiapi
from PIL import Image

from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def servers(dit_build: Builder) -> Iterator[dict[str, str]]:
    """One dev server per family, booted side by side."""
    processes = {family: ServerProcess("--profile", "dev", "--model", str(dit_build(family)[0]))
                 for family in ("flux", "sd35")}
    try:
        yield {family: process.wait_ready(timeout=300) for family, process in processes.items()}
    finally:
        for process in processes.values():
            assert process.stop() == 0, process.log


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@pytest.mark.parametrize("family", ["flux", "sd35"])
def test_each_family_through_the_openai_sdk(servers: dict[str, str], family: str) -> None:
    client = openai.OpenAI(base_url=f"{servers[family]}/v1", api_key="not-needed", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a lighthouse at dusk", size="64x64", n=2,
                                                   response_format="b64_json")
    assert raw.headers["x-sdserve-provider"] == "CPUExecutionProvider"
    result = raw.parse()
    images = [_png(d.b64_json or "") for d in result.data or []]
    assert [im.size for im in images] == [(64, 64), (64, 64)]
    first, second = (np.asarray(im.convert("RGB"), dtype=np.int16) for im in images)
    assert np.abs(first - second).max() > 0, "two seeds, two images"
    models = {m.id: m for m in client.models.list().data}
    assert models, "the served model is listed"
    caps = httpx.get(f"{servers[family]}/capabilities", timeout=30).json()
    assert caps["family"]["family"] == family and caps["family"]["prediction_type"] == "flow"
    assert caps["family"]["modes"] == "txt2img,img2img" and caps["family"]["native_size"] == 64


@pytest.mark.parametrize("family", ["flux", "sd35"])
def test_each_family_through_webuiapi_with_a_negative_prompt(servers: dict[str, str], family: str) -> None:
    """SD 3.5 uses the negative prompt (CFG); Flux accepts it and, as diffusers without true_cfg_scale, ignores it:
    either way the infotext carries it and the same seed gives the same image."""
    host, port = servers[family].removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)
    result = api.txt2img(prompt="a red cube on a table", negative_prompt="blurry", width=64, height=64, seed=7,
                         cfg_scale=4.5)
    assert result.image.size == (64, 64)
    assert result.info["seed"] == 7 and result.info["negative_prompt"] == "blurry"
    again = api.txt2img(prompt="a red cube on a table", negative_prompt="blurry", width=64, height=64, seed=7,
                        cfg_scale=4.5)
    assert np.array_equal(np.asarray(result.image), np.asarray(again.image)), "same seed, same image"


@pytest.mark.parametrize(("family", "steps", "guidance"), [("flux", 28, 3.5), ("sd35", 28, 4.5)])
def test_the_familys_defaults_apply_when_a_request_leaves_them_out(servers: dict[str, str], family: str,
                                                                    steps: int, guidance: float) -> None:
    response = httpx.post(f"{servers[family]}/sdapi/v1/txt2img", json={"prompt": "a fox", "width": 64,
                                                                        "height": 64}, timeout=120)
    assert response.status_code == 200, response.text
    info = response.json()["info"]
    # Flux dev's guidance is embedded: its infotext says it as Forge does (no true CFG, Distilled CFG Scale)
    cfg = f"CFG scale: 1, Distilled CFG Scale: {guidance}," if family == "flux" else f"CFG scale: {guidance},"
    assert f"Steps: {steps}," in info and cfg in info, info


def test_flux_img2img_runs_and_inpainting_is_refused_by_name(servers: dict[str, str]) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    url = f"{servers['flux']}/sdapi/v1/img2img"
    body = {"prompt": "a red barn", "init_images": [image], "width": 64, "height": 64, "steps": 4,
            "denoising_strength": 0.6, "sampler_name": "Euler"}
    done = httpx.post(url, json=body, timeout=120)
    assert done.status_code == 200, done.text
    assert _png(done.json()["images"][0]).size == (64, 64)
    refused = httpx.post(url, json={**body, "mask": image}, timeout=120)
    assert refused.status_code in (400, 422), refused.text
    assert "inpaint" in refused.text and "flux" in refused.text


def test_a_sampler_without_a_flow_formulation_is_refused_naming_it(servers: dict[str, str]) -> None:
    response = httpx.post(f"{servers['sd35']}/sdapi/v1/txt2img", json={
        "prompt": "a fox", "width": 64, "height": 64, "steps": 4, "sampler_name": "DDIM"}, timeout=60)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]  # the field the client set, the A1111 names that run (issue 43)
    assert detail["loc"] == ["body", "sampler_name"] and "['Euler', 'Euler a', 'DPM++ 2M', 'UniPC']" in detail["msg"]


@pytest.mark.plugin_ep
def test_flux_on_openvino_from_ep_context_artifacts(dit_build: Builder, tmp_path: Path) -> None:
    """The accelerator proof on a DiT: `sdserve engines build --profile openvino` compiles every Flux network to an
    EP-context model, the openvino profile (CPU provider refused, placement audit on) boots from them, and every
    node of every session, the flow-step graphs included, runs on OpenVINO."""
    from tests.plugin_ep import EP, build_artifacts, profile

    model = build_artifacts(dit_build("flux")[0], tmp_path / "flux")
    built = sorted(p.name for p in (model / "ep" / EP / "64x64").glob("*_ctx.onnx"))
    assert built == ["text_encoder_2_ctx.onnx", "text_encoder_ctx.onnx", "transformer_ctx.onnx",
                     "vae_decoder_ctx.onnx", "vae_encoder_ctx.onnx"]
    process = ServerProcess("--config", str(profile(tmp_path)), "--model", str(model))
    try:
        url = process.wait_ready(timeout=300)
        answer = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a lighthouse", "size": "64x64",
                                                                 "steps": 4}, timeout=120)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sdserve-provider"] == EP
        caps = httpx.get(f"{url}/capabilities", timeout=30).json()
        assert caps["accelerated"] is True and caps["family"]["family"] == "flux"
        placement = caps["placement_summary"]
        assert {"transformer@64x64", "text_encoder_2@64x64", "flow_step@64x64"} <= set(placement)
        assert all(set(p["nodes_by_provider"]) == {EP} and p["ok"] for p in placement.values()), placement
    finally:
        assert process.stop() == 0, process.log
