"""Clients, fourth pass, replayed from their source against a real `sdserve serve` (issue 43): Dify's Stable
Diffusion tool, aiyabot's Hires fix, Open WebUI's A1111 engine with a Forge user's Flux parameters, n8n's image edit
and openOutpaint's Hires fix over the size limit. Each body is built as the client's source builds it (repository,
file and commit named per test); the response is read as the client reads it. ``lean`` and ``defaults`` as in
tests/e2e/test_client_replays.py (only the size shrunk in lean mode)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.conftest import ServerProcess, dev_config
from tests.e2e.test_client_replays import OPENOUTPAINT, sized, xl_server

SDAPI = "/sdapi/v1"
__all__ = ["xl_server"]
"""xl_server (the tiny SDXL with [serving] openai_sizes) is shared with the third pass's replays."""


@pytest.fixture(params=["lean", pytest.param("defaults", marks=pytest.mark.client_defaults)])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def a1111_server(mode: str, request: pytest.FixtureRequest) -> str:
    """Where Dify's 1024x1024 requests go: the dev server (lean), the tiny SDXL with openai_sizes (defaults)."""
    return str(request.getfixturevalue("xl_server" if mode == "defaults" else "dev_server"))


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


DIFY = {
    # langgenius/dify-official-plugins tools/stablediffusion/tools/stable_diffusion.py (commit 16a7a7e)
    # DRAW_TEXT_OPTIONS updated with the tool's parameters at their tools/stable_diffusion.yaml defaults (model '',
    # lora '', steps 10, width/height 1024, the default negative prompt); text2img then sets
    # override_settings.sd_model_checkpoint to the tool parameter model: "" unless one is picked in the form.
    "prompt": "a cat", "negative_prompt": "bad art, ugly, deformed, watermark, duplicated, discontinuous lines",
    "seed": -1, "subseed": -1, "subseed_strength": 0, "seed_resize_from_h": -1, "seed_resize_from_w": -1,
    "sampler_name": "DPM++ 2M", "batch_size": 1, "n_iter": 1, "steps": 10, "cfg_scale": 7, "width": 1024,
    "height": 1024, "do_not_save_samples": False, "do_not_save_grid": False,
    "override_settings": {"sd_model_checkpoint": ""}, "override_settings_restore_afterwards": True,
    "refiner_checkpoint": "", "refiner_switch_at": 0, "disable_extra_networks": False, "enable_hr": False,
    "firstphase_width": 0, "firstphase_height": 0, "hr_scale": 2, "hr_second_pass_steps": 0, "hr_resize_x": 0,
    "hr_resize_y": 0, "hr_prompt": "", "hr_negative_prompt": "", "script_args": [], "send_images": True,
    "save_images": False, "alwayson_scripts": {}, "model": "", "lora": ""}


def test_dify_stable_diffusion_tool(mode: str, a1111_server: str) -> None:
    """_invoke: POST /sdapi/v1/options with requests' data=json.dumps({"sd_model_checkpoint": <the provider's
    model, one of /sdapi/v1/sd-models' model_name>}) (no Content-Type), then text2img: POST /sdapi/v1/txt2img with
    data=json.dumps(draw_options), again no Content-Type; response.json()["images"][0] is base64-decoded."""
    models = [m["model_name"] for m in httpx.get(f"{a1111_server}{SDAPI}/sd-models").json()]  # get_sd_models
    set_model = httpx.post(f"{a1111_server}{SDAPI}/options", content=json.dumps({"sd_model_checkpoint": models[0]}))
    assert set_model.status_code == 200, set_model.text
    body = sized(mode, DIFY)
    answer = httpx.post(f"{a1111_server}{SDAPI}/txt2img", content=json.dumps(body), timeout=1200)
    assert "content-type" not in answer.request.headers
    assert answer.status_code == 200, answer.text
    assert _image(answer.json()["images"][0]).size == (body["width"], body["height"])
    ignored = answer.headers["x-sdserve-ignored-fields"].split(",")
    assert {"override_settings.sd_model_checkpoint", "model", "lora"} <= set(ignored)


AIYABOT = {
    # Kilvoctu/aiyabot core/stablecog.py (commit eb8ff68) dream_handler payload with core/settings.py's channel
    # defaults (steps 30, 512x512, guidance_scale "7.0", sampler "Euler a", style "None", strength "0.75", batch
    # "1,1", clip_skip 1), the seed it drew for -1, and the highres_payload of a Hires fix pick ("Latent"):
    # hr_scale 1, hr_second_pass_steps int(steps) / 2, a float.
    "prompt": "a castle on a hill", "negative_prompt": "", "steps": 30, "width": 512, "height": 512,
    "cfg_scale": "7.0", "sampler_index": "Euler a", "seed": 1234567, "seed_resize_from_h": -1,
    "seed_resize_from_w": -1, "n_iter": 1, "batch_size": 1, "styles": ["None"], "enable_hr": True,
    "hr_upscaler": "Latent", "hr_scale": 1, "hr_second_pass_steps": 30 / 2, "denoising_strength": "0.75",
    "override_settings": {"CLIP_stop_at_last_layers": 1}}


def test_aiyabot_with_hires_fix(mode: str, dev_server: str) -> None:
    """Then, per image, POST /sdapi/v1/png-info with "data:image/png;base64," + the image; .get("info") is saved as
    the file's parameters."""
    body = sized(mode, AIYABOT)
    assert isinstance(body["hr_second_pass_steps"], float)
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    image = answer.json()["images"][0]
    read = httpx.post(f"{dev_server}{SDAPI}/png-info", json={"image": "data:image/png;base64," + image}, timeout=60)
    assert read.status_code == 200, read.text
    info = read.json().get("info")
    assert "Seed: 1234567," in info and "Hires steps: 15" in info and "Hires upscaler: Latent" in info


def test_openoutpaint_hires_fix_over_the_limit_names_the_limit(dev_server: str) -> None:
    """zero01101/openOutpaint js/ui/tool/dream.js (commit e5f2802) with HRfix ticked at the client's default 512
    reticle and hr_scale 2: hr_resize_x/y 1024, over the dev profile's 512 limit. The 422 names the field and
    the setting that refused it ([limits] max_width), not an OpenAI-route option."""
    body = {**OPENOUTPAINT, "enable_hr": True, "hr_resize_x": 1024, "hr_resize_y": 1024, "denoising_strength": 0.7}
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=120)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", "hr_resize_x"] and "[limits] max_width" in detail["msg"]
    assert "openai_sizes" not in detail["msg"]


@pytest.fixture(scope="module")
def flux_server(dit_build: Any) -> Iterator[str]:
    """The tiny FLUX.1 dev-like model (guidance embedded) under the dev profile."""
    server = ServerProcess("--profile", "dev", "--model", str(dit_build("flux")[0]))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.slow
def test_open_webui_a1111_engine_with_forge_flux_params(flux_server: str) -> None:
    """open-webui/open-webui backend/open_webui/routers/images.py (commit 02530d5) image_generations, engine
    automatic1111: {prompt, batch_size: n, width, height} (+ steps when IMAGE_STEPS is set) merged with the admin's
    AUTOMATIC1111_PARAMS, here a Forge user's Flux setting {"cfg_scale": 1, "distilled_cfg_scale": 3.5}; each of
    res["images"] is base64-decoded. The image is the one Flux dev makes at guidance 3.5, not at guidance 1."""
    data = {"prompt": "a red cube on a table", "batch_size": 1, "width": 64, "height": 64, "steps": 4,
            "cfg_scale": 1, "distilled_cfg_scale": 3.5}
    answer = httpx.post(f"{flux_server}{SDAPI}/txt2img", json=data, timeout=300)
    assert answer.status_code == 200, answer.text
    assert "distilled_cfg_scale" not in answer.headers.get("x-sdserve-ignored-fields", "")
    seed = json.loads(answer.json()["info"])["seed"]
    image = np.asarray(_image(answer.json()["images"][0]).convert("RGB"), dtype=np.int16)
    same = {"prompt": data["prompt"], "size": "64x64", "steps": 4, "seed": seed, "guidance_scale": 3.5}
    reference = httpx.post(f"{flux_server}/v1/images/generations", json=same, timeout=300)
    assert reference.status_code == 200, reference.text
    at_35 = np.asarray(_image(reference.json()["data"][0]["b64_json"]).convert("RGB"), dtype=np.int16)
    assert np.array_equal(image, at_35), "cfg_scale 1 + distilled_cfg_scale 3.5 is guidance 3.5"
    at_1 = httpx.post(f"{flux_server}/v1/images/generations", json={**same, "guidance_scale": 1.0}, timeout=300)
    assert np.abs(np.asarray(_image(at_1.json()["data"][0]["b64_json"]).convert("RGB"), dtype=np.int16)
                  - image).max() > 0, "guidance 1 is another image"
    samplers = [s["name"] for s in httpx.get(f"{flux_server}{SDAPI}/samplers").json()]
    assert samplers == ["Euler", "Euler a", "DPM++ 2M", "UniPC"]
    refused = httpx.post(f"{flux_server}{SDAPI}/txt2img", json={**data, "sampler_name": "DDIM"}, timeout=60)
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "sampler_name"]


@pytest.fixture(scope="module")
def hires_edit_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny SD 1.x model with [serving] openai_sizes_hires on."""
    tmp = tmp_path_factory.mktemp("hires-edit")
    profile = dev_config(tmp, replace={"openai_sizes = false": "openai_sizes = false\nopenai_sizes_hires = true",
                                       "request_timeout_s = 120": "request_timeout_s = 1200"})
    server = ServerProcess("--config", str(profile), "--model", str(tiny_model))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.client_defaults
def test_n8n_openai_image_edit_at_1024(hires_edit_server: str) -> None:
    """n8n-io/n8n packages/@n8n/nodes-langchain/nodes/vendors/OpenAi/v2/actions/image/edit.operation.ts (commit
    2475cbe) with the node's defaults: model gpt-image-1, one image as image[], prompt, n "1", size 1024x1024,
    quality auto, multipart through form-data; reads data[].b64_json. On SD 1.x with openai_sizes_hires it is
    served through Hires fix (the second pass at 1024x1024 takes ~40 s on 2 CPU cores, hence client_defaults; the
    unit test runs the same path on the fake engine)."""
    picture = io.BytesIO()
    Image.effect_mandelbrot((512, 512), (-2, -1, 1, 1), 40).convert("RGB").save(picture, format="PNG")
    fields = {"prompt": "a watercolor version", "model": "gpt-image-1", "n": "1", "size": "1024x1024",
              "quality": "auto"}
    answer = httpx.post(f"{hires_edit_server}/v1/images/edits", data=fields, timeout=1200,
                        files=[("image[]", ("data.png", picture.getvalue(), "image/png"))])
    assert answer.status_code == 200, answer.text
    assert _image(answer.json()["data"][0]["b64_json"]).size == (1024, 1024)
    assert "through Hires fix" in answer.headers["x-sdserve-warnings"]
