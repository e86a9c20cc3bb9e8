"""Each client's first image, replayed from its source against a real `sdserve serve`: LibreChat's three image
tools, LobeChat, SillyTavern with a fresh install's defaults, text-generation-webui's sd_api_pictures and chaiNNer.

Every request below is built as the client's source builds it (file and commit named per test; the repositories
are danny-avila/LibreChat, lobehub/lobe-chat, SillyTavern/SillyTavern, oobabooga/text-generation-webui and
chaiNNer-org/chaiNNer), then the response is read as the client reads it. Two modes:

* ``lean`` (in ``make test``): the client's bodies with only the image size shrunk to 64x64, the tiny model's
  native size, so the suite stays fast on 2 CPU cores (512x512 takes ~25 s there); everything else as sent.
* ``defaults`` (marker ``client_defaults``, ``pytest -m client_defaults tests/e2e/test_client_replays.py``): the
  bodies exactly as the clients send them, sizes included. LibreChat's tools always ask 1024x1024, which only a
  family trained at 1024 serves without resizing: those run against the tiny SDXL model with
  ``[serving] openai_sizes = true``.
"""

from __future__ import annotations

import base64
import io
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from engines.build.tiny import build_tiny
from tests.e2e.conftest import ServerProcess, dev_config

SDAPI = "/sdapi/v1"


@pytest.fixture(params=["lean", pytest.param("defaults", marks=pytest.mark.client_defaults)])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def sized(mode: str, body: dict[str, Any]) -> dict[str, Any]:
    """The client's body; in lean mode only its size fields shrunk to 64x64 (nothing else changes)."""
    if mode == "defaults":
        return body
    lean = dict(body)
    if "width" in lean:
        lean |= {"width": 64, "height": 64}
    if lean.get("size") not in (None, "auto"):
        lean["size"] = "64x64"
    return lean


def _image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


@pytest.fixture(scope="module")
def xl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny SDXL model under the dev profile with the OpenAI sizes served (what LibreChat's tools ask)."""
    tmp = tmp_path_factory.mktemp("xl")
    model = build_tiny(tmp / "tiny-sdxl", family="sdxl")
    profile = dev_config(tmp, replace={"openai_sizes = false": "openai_sizes = true",
                                       "request_timeout_s = 120": "request_timeout_s = 1200"})
    server = ServerProcess("--config", str(profile), "--model", str(model))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


@pytest.fixture
def openai_server(mode: str, request: pytest.FixtureRequest) -> str:
    """Where LibreChat's 1024x1024 requests go: the dev server (lean), the SDXL one (defaults)."""
    return str(request.getfixturevalue("xl_server" if mode == "defaults" else "dev_server"))


def test_librechat_dalle3_tool(mode: str, openai_server: str) -> None:
    """danny-avila/LibreChat api/app/clients/tools/structured/DALLE3.js (commit 37d31ec): openai.images.generate
    with model dall-e-3 and the tool's defaults (quality standard, style vivid, size 1024x1024, n 1), no
    response_format; then theImageUrl = resp.data[0].url, which processFileURL downloads."""
    body = sized(mode, {"model": "dall-e-3", "quality": "standard", "style": "vivid", "size": "1024x1024",
                        "prompt": "a lighthouse at dusk", "n": 1})
    with openai.OpenAI(base_url=f"{openai_server}/v1", api_key="librechat", max_retries=0, timeout=1200) as client:
        raw = client.images.with_raw_response.generate(**body)
    assert raw.headers["x-sdserve-ignored-fields"] == "style" and raw.headers["x-sdserve-model"] != "dall-e-3"
    url = raw.parse().data[0].url
    assert url is not None and url.startswith(f"{openai_server}/v1/images/files/")  # absolute, as OpenAI's
    fetched = httpx.get(url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/png"
    side = 1024 if mode == "defaults" else 64
    assert _image(fetched.content).size == (side, side)


def test_librechat_gpt_image_tool(mode: str, dev_server: str) -> None:
    """LibreChat api/app/clients/tools/structured/OpenAIImageTools.js (commit 8731432), image_gen_oai with the
    tool's defaults: model gpt-image-1 (IMAGE_GEN_OAI_MODEL unset), n 1, background auto, output_format png (the
    default imageOutputType), output_compression left out for png, quality auto, size auto; reads
    resp.data[0].b64_json."""
    body = sized(mode, {"model": "gpt-image-1", "prompt": "a lighthouse at dusk", "n": 1, "background": "auto",
                        "output_format": "png", "quality": "auto", "size": "auto"})
    with openai.OpenAI(base_url=f"{dev_server}/v1", api_key="librechat", max_retries=0) as client:
        result = client.images.generate(**body)
    b64 = result.data[0].b64_json
    assert b64 is not None and _image(base64.b64decode(b64)).size == (64, 64)  # auto: the native size
    assert result.output_format == "png"


def test_librechat_stable_diffusion_tool(mode: str, openai_server: str) -> None:
    """LibreChat api/app/clients/tools/structured/StableDiffusion.js (commit 7cacd8a): POST /sdapi/v1/txt2img with
    sampler_index DPM++ 2M Karras, cfg_scale 4.5, steps 22, 1024x1024; then images[0], JSON.parse(info),
    info.infotexts[0] (saved as the PNG's parameters), info.infotexts[0].split('\\n').pop(), info.seed,
    info.width and info.height."""
    body = sized(mode, {"prompt": "photo of a man in black clothes, half body, coastline",
                        "negative_prompt": "semi-realistic, cgi, 3d, render", "sampler_index": "DPM++ 2M Karras",
                        "cfg_scale": 4.5, "steps": 22, "width": 1024, "height": 1024})
    answer = httpx.post(f"{openai_server}{SDAPI}/txt2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    info = json.loads(answer.json()["info"])
    image = _image(base64.b64decode(answer.json()["images"][0].split(",", 1)[0]))
    assert image.size == (info["width"], info["height"]) == (body["width"], body["height"])
    generation = info["infotexts"][0].split("\n").pop()
    assert generation.startswith("Steps: 22, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 4.5, Seed: ")
    assert f"Seed: {info['seed']}," in generation and isinstance(info["seed"], int)


def test_lobechat_default_image_model(mode: str, dev_server: str) -> None:
    """lobehub/lobe-chat packages/model-runtime/src/core/openaiCompatibleFactory/createImage.ts (commit d05cf92),
    generateByImageMode for its default image model gpt-image-1 (packages/model-bank/src/aiModels/openai.ts,
    commit 01c4dcc: params prompt, size 'auto', imageUrls []): size auto and an empty image list are deleted, so
    the body is {model, n: 1, prompt}; it reads data[0].b64_json (as data:image/png) or data[0].url."""
    body = sized(mode, {"model": "gpt-image-1", "n": 1, "prompt": "a paper boat"})
    dalle = {"model": "dall-e-3", "n": 1, "response_format": "b64_json", "prompt": "a paper boat",
             "quality": "standard"}  # its DALL·E 3 defaults, at the served size (1024x1024 needs SDXL)
    with openai.OpenAI(base_url=f"{dev_server}/v1", api_key="lobe", max_retries=0) as client:
        item = client.images.generate(**body).data[0]
        assert client.images.generate(**dalle, size="64x64").data[0].b64_json is not None
    assert item.b64_json is not None and _image(base64.b64decode(item.b64_json)).format == "PNG"


def test_sillytavern_fresh_install_defaults(mode: str, dev_server: str) -> None:
    """SillyTavern/SillyTavern public/scripts/extensions/stable-diffusion/index.js (commit ba6f7b7): defaultSettings
    (sampler DDIM, scheduler 'normal', steps 20, scale 7, 512x512, clip_skip 1, seed -1 -> left out, hires off)
    through generateAutoImage, whose body src/endpoints/stable-diffusion.js /generate forwards as it is to
    /sdapi/v1/txt2img (url and auth included); it reads images[0]."""
    body = sized(mode, {
        "url": dev_server, "auth": "", "prompt": "best quality, absurdres, aesthetic, a castle",
        "negative_prompt": "lowres, bad anatomy, bad hands, text, error, cropped, worst quality, low quality",
        "sampler_name": "DDIM", "scheduler": "normal", "steps": 20, "cfg_scale": 7, "width": 512, "height": 512,
        "restore_faces": False, "enable_hr": False, "hr_upscaler": "Latent", "hr_scale": 2.0,
        "denoising_strength": 0.7, "hr_second_pass_steps": 0,
        "override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": True,
        "clip_skip": 1, "save_images": True, "send_images": True, "do_not_save_grid": False,
        "do_not_save_samples": False})
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert _image(base64.b64decode(answer.json()["images"][0])).size == (body["width"], body["height"])
    warnings = json.loads(answer.json()["info"])["warnings"]
    assert any("scheduler 'normal' ignored for DDIM" in w for w in warnings)  # as A1111: DDIM takes no schedule
    assert "save_images" in answer.headers["x-sdserve-ignored-fields"].split(",")


def test_sillytavern_with_hires_fix_ticked(dev_server: str) -> None:
    """The same defaultSettings with SillyTavern's "Hires. Fix" ticked: enable_hr with its hr_upscaler "Latent"
    (A1111's default latent upscale), hr_scale 2.0, denoising_strength 0.7, hr_second_pass_steps 0 (the first
    pass's steps). The second pass runs at 128x128 here (1024x1024 at the client's 512, over the dev limits)."""
    body = sized("lean", {
        "prompt": "a castle", "negative_prompt": "lowres", "sampler_name": "Euler", "steps": 6, "cfg_scale": 7,
        "width": 512, "height": 512, "seed": 3, "restore_faces": False, "enable_hr": True, "hr_upscaler": "Latent",
        "hr_scale": 2.0, "denoising_strength": 0.7, "hr_second_pass_steps": 0, "clip_skip": 1})
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert _image(base64.b64decode(answer.json()["images"][0])).size == (128, 128)
    info = json.loads(answer.json()["info"])
    assert (info["width"], info["hires"], info["denoising_strength"]) == (64, [128, 128], 0.7)
    assert "Hires upscale: 2, Hires upscaler: Latent" in info["infotexts"][0]


def test_text_generation_webui_sd_api_pictures(mode: str, dev_server: str) -> None:
    """oobabooga/text-generation-webui extensions/sd_api_pictures/script.py (commit 1dcde41): SD_api_address_update
    (GET sd-models), get_checkpoints (sd-models, options), get_samplers, then with manage_VRAM on
    give_VRAM_priority('set') (POST unload-checkpoint, json=''), and per picture: reload-checkpoint, txt2img with
    its params (DPM++ 2M, 32 steps, 512x512, hr_scale '1.0', denoising_strength 0.61, ...), unload-checkpoint;
    every call raise_for_status(), then images are decoded."""
    with httpx.Client(base_url=dev_server, timeout=600) as c:
        c.get(f"{SDAPI}/sd-models").raise_for_status()
        titles = [m["title"] for m in c.get(f"{SDAPI}/sd-models").json()]
        assert c.get(f"{SDAPI}/options").json()["sd_model_checkpoint"] in titles
        assert "DPM++ 2M" in [s["name"] for s in c.get(f"{SDAPI}/samplers").raise_for_status().json()]
        c.post(f"{SDAPI}/unload-checkpoint", json="").raise_for_status()
        c.post(f"{SDAPI}/reload-checkpoint", json="").raise_for_status()
        payload = sized(mode, {
            "prompt": "(Masterpiece:1.1), detailed, intricate, colorful(a cat in a garden:1)", "seed": -1,
            "sampler_name": "DPM++ 2M", "enable_hr": False, "hr_scale": "1.0", "hr_upscaler": "ESRGAN_4x",
            "denoising_strength": 0.61, "steps": 32, "cfg_scale": 7, "width": 512, "height": 512,
            "restore_faces": False, "override_settings_restore_afterwards": True,
            "negative_prompt": "(worst quality, low quality:1.3)"})
        answer = c.post(f"{SDAPI}/txt2img", json=payload)
        answer.raise_for_status()
        unloaded = c.post(f"{SDAPI}/unload-checkpoint", json="")
        unloaded.raise_for_status()
    image = _image(base64.b64decode(answer.json()["images"][0].split(",", 1)[0]))
    assert image.size == (payload["width"], payload["height"])
    assert unloaded.json()["resident"] is True  # nothing was freed, and the answer says so


def _chainner_find(port: int) -> str:
    """chaiNNer backend/src/packages/chaiNNer_external/web_ui.py (commit 874b878) get_verified_api: GET
    /sdapi/v1/options with a 1 s timeout on every protocol x port of ApiConfig.from_env (https, then http; ports
    7860, 7861 unless STABLE_DIFFUSION_PORT is set: here the test server's free port), first success wins."""
    for protocol in ("https", "http"):
        base = f"{protocol}://127.0.0.1:{port}"
        try:
            if httpx.get(f"{base}{SDAPI}/options", timeout=1).status_code == 200:
                return base
        except httpx.HTTPError:
            continue
    raise AssertionError("chaiNNer would find no stable diffusion API")


def test_chainner_text_to_image_node(mode: str, dev_server: str) -> None:
    """chaiNNer .../external_stable_diffusion/automatic1111/text_to_image.py (commit 874b878) with the node's
    defaults: steps 20, sampler Euler, CFG 7, 512x512 (nearest_valid_size: multiples of 8), Seamless Edges off ->
    tiling false, seed as u32; it asserts the returned image has the requested size. chaiNNer only looks on
    7860/7861: serve it with `make run PORT=7860` (here a free port stands in, as STABLE_DIFFUSION_PORT allows)."""
    base = _chainner_find(int(dev_server.rsplit(":", 1)[1]))
    request_data = sized(mode, {"prompt": "a lighthouse", "negative_prompt": "", "seed": random.getrandbits(32),
                                "steps": 20, "sampler_name": "Euler", "cfg_scale": 7, "width": 512, "height": 512,
                                "tiling": False})
    answer = httpx.post(f"{base}{SDAPI}/txt2img", json=request_data, timeout=600)
    assert answer.status_code == 200, answer.text
    image = _image(base64.b64decode(answer.json()["images"][0]))
    assert image.size == (request_data["width"], request_data["height"])


@pytest.mark.parametrize(("change", "loc", "fragment"), [
    ({"width": 520}, "size", "width 520 is not a multiple of 16; served sizes: WIDTHxHEIGHT with each side a "
                             "multiple of 16 up to 512x512; the model's native size is 64x64"),
    ({"steps": 60}, "steps", "at most 50 (this server's limits.max_steps), got 60"),
    ({"tiling": True}, "tiling", "no seamless tiling"),
])
def test_chainner_settings_sdserve_cannot_serve_are_422_naming_why(dev_server: str, change: dict[str, Any],
                                                                   loc: str, fragment: str) -> None:
    """chaiNNer's sliders allow steps up to 150, widths in steps of 8 and Seamless Edges: each refused, named."""
    body = {"prompt": "a", "negative_prompt": "", "seed": 1, "steps": 20, "sampler_name": "Euler", "cfg_scale": 7,
            "width": 64, "height": 64, "tiling": False, **change}
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=60)
    assert answer.status_code == 422
    detail = answer.json()["detail"][0]
    assert detail["loc"][-1] == loc and fragment in detail["msg"], detail


# openOutpaint and the Photoshop plugin (clients, third pass): numbers as strings, outpainting with latent noise,
# image_cfg_scale, Hires fix, and the png-info read-back.

OPENOUTPAINT = {
    # zero01101/openOutpaint js/index.js (commit 006aa60) stableDiffusionData, with the sliders' defaults (CFG 7.0,
    # batch size 2, iterations 2, steps 30; makeSlider writes each into it, hr_denoising_strength 0.7 and
    # hr_fix_lock_px 0 included) and changeSeed(): the seed field's .value, the string "-1".
    "prompt": "a cabin in the woods", "negative_prompt": "", "seed": "-1", "cfg_scale": 7.0, "sampler_index": "DDIM",
    "steps": 30, "denoising_strength": 1, "mask_blur": 0, "batch_size": 2, "width": 512, "height": 512,
    "n_iter": 2, "mask": "", "init_images": [], "inpaint_full_res": False, "inpainting_fill": 1,
    "outpainting_fill": 2, "enable_hr": False, "restore_faces": False, "hr_scale": 2.0, "hr_upscaler": "None",
    "hr_second_pass_steps": 0, "hr_resize_x": 0, "hr_resize_y": 0, "hr_square_aspect": False, "styles": [],
    "hr_denoising_strength": 0.7, "hr_fix_lock_px": 0}


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _canvas(size: int) -> tuple[Image.Image, Image.Image]:
    """openOutpaint's outpaint inputs for a reticle half over a picture: the init image (the canvas over black,
    initCtx.fillRect) and the mask (white where the canvas is empty, black over the picture)."""
    init = Image.new("RGB", (size, size), (0, 0, 0))
    init.paste(Image.effect_mandelbrot((size // 2, size), (-2, -1, 1, 1), 40).convert("RGB"), (0, 0))
    mask = Image.new("RGB", (size, size), (0, 0, 0))
    mask.paste((255, 255, 255), (size // 2, 0, size, size))
    return init, mask


def test_openoutpaint_dream_on_an_empty_canvas(mode: str, dev_server: str) -> None:
    """js/ui/tool/dream.js (commit e5f2802) dream_generate_callback on a blank canvas: the whole
    stableDiffusionData to /sdapi/v1/txt2img, denoising_strength 1 (HRfix off); _generate reads images and
    info.all_seeds."""
    body = sized(mode, OPENOUTPAINT)
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    images, info = answer.json()["images"], json.loads(answer.json()["info"])
    assert len(images) == len(info["all_seeds"]) == 4  # batch_size 2 x n_iter 2
    assert {_image(base64.b64decode(i)).size for i in images} == {(body["width"], body["height"])}
    assert {"outpainting_fill", "hr_square_aspect"} <= set(answer.headers["x-sdserve-ignored-fields"].split(","))


def test_openoutpaint_outpaint_with_latent_noise(mode: str, dev_server: str) -> None:
    """dream.js dream_generate_callback over a half-filled canvas: img2img with the canvas and mask as data URLs,
    inpainting_fill = outpainting_fill (2, "latent noise (suggested)") and image_cfg_scale from its slider."""
    size = 64 if mode == "lean" else 512
    init, mask = _canvas(size)
    body = {**sized(mode, OPENOUTPAINT), "init_images": [_data_url(init)], "mask": _data_url(mask),
            "inpainting_fill": 2, "image_cfg_scale": 0.7, "steps": 12}
    answer = httpx.post(f"{dev_server}{SDAPI}/img2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    assert "image_cfg_scale" in answer.headers["x-sdserve-ignored-fields"].split(",")
    out = _image(base64.b64decode(answer.json()["images"][0])).convert("RGB")
    assert out.size == (size, size)
    kept = out.crop((0, 0, size // 2 - 8, size))  # outside the mask (and its blur) the canvas comes back as it was
    assert kept.tobytes() == init.crop((0, 0, size // 2 - 8, size)).tobytes()
    painted = out.crop((size // 2 + 8, 0, size, size))
    assert painted.getextrema() != ((0, 0), (0, 0), (0, 0))  # the empty half was painted, not left black
    assert "Masked content: latent noise" in json.loads(answer.json()["info"])["infotexts"][0]


def test_openoutpaint_img2img_tool(mode: str, dev_server: str) -> None:
    """dream.js img2img_generate_callback: the selection as init image, its mask, inpainting_fill from
    stableDiffusionData (1, original), the tool's denoising strength, image_cfg_scale 0.5, inpaint_full_res from
    the tool's full-resolution box (off)."""
    size = 64 if mode == "lean" else 512
    init, _ = _canvas(size)
    mask = Image.new("RGB", (size, size), (255, 255, 255))
    body = {**sized(mode, OPENOUTPAINT), "init_images": [_data_url(init)], "mask": _data_url(mask),
            "denoising_strength": 0.7, "image_cfg_scale": 0.5, "inpaint_full_res": False, "steps": 12}
    answer = httpx.post(f"{dev_server}{SDAPI}/img2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["images"]) == 4
    assert json.loads(answer.json()["info"])["denoising_strength"] == 0.7


def test_openoutpaint_dream_with_hrfix(dev_server: str) -> None:
    """dream.js with HRfix ticked (new HRfix path, lock px 0, not the liar): width/height stay the reticle's,
    hr_resize_x/y = reticle x hr_scale, denoising_strength = hr_denoising_strength (0.7), hr_upscaler "None".
    The second pass runs at 128x128 here (1024x1024 at the client's size, over the dev profile's limits)."""
    body = {**sized("lean", OPENOUTPAINT), "enable_hr": True, "hr_resize_x": 128, "hr_resize_y": 128,
            "denoising_strength": 0.7, "batch_size": 1, "n_iter": 1, "seed": "7"}
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert _image(base64.b64decode(answer.json()["images"][0])).size == (128, 128)
    info = json.loads(answer.json()["info"])
    assert (info["width"], info["seed"], info["hires"]) == (64, 7, [128, 128])
    assert "Hires resize: 128x128" in info["infotexts"][0] and "Hires upscaler: None" in info["infotexts"][0]


PHOTOSHOP = {
    # AbdullahAlfaraj/Auto-Photoshop-StableDiffusion-Plugin index.js (commit e0aecb1) getSettings(): input
    # fields' .value strings for steps, cfg_scale and seed, the plugin's bookkeeping fields, forwarded as they are by
    # utility/sdapi/python_replacement.js txt2ImgRequest / img2ImgRequest.
    "prompt": "a red fox", "negative_prompt": "blurry", "original_prompt": "a red fox",
    "original_negative_prompt": "blurry", "steps": "20", "sampler_index": "Euler a", "width": 512,
    "height": 512, "denoising_strength": 0.7, "batch_size": 1, "cfg_scale": "7", "seed": "-1", "mask_blur": 8,
    "use_sharp_mask": False, "use_prompt_shortcut": False, "prompt_shortcut_ui_dict": {},
    "uniqueDocumentId": "a24a6ea4-ce75-4665-a070-57453082c256", "mode": "txt2img", "restore_faces": False,
    "selection_info": {"left": 0, "top": 0, "width": 512, "height": 512}}


def _png_info(base: str, image: str) -> dict[str, Any]:
    """The plugin keeps each image's A1111 metadata (auto_metadata) read back through /sdapi/v1/png-info."""
    answer = httpx.post(f"{base}{SDAPI}/png-info", json={"image": image}, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_photoshop_plugin_txt2img_and_its_metadata(mode: str, dev_server: str) -> None:
    body = sized(mode, PHOTOSHOP)
    answer = httpx.post(f"{dev_server}{SDAPI}/txt2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    info = json.loads(answer.json()["info"])
    read = _png_info(dev_server, answer.json()["images"][0])
    assert read["info"] == info["infotexts"][0]  # the PNG round-trips to the same infotext
    assert read["parameters"]["Seed"] == str(info["seed"]) and read["parameters"]["Steps"] == "20"
    assert read["parameters"]["Size-1"] == str(body["width"]) and read["parameters"]["Prompt"] == "a red fox"


@pytest.mark.parametrize("fill", [1, 2])
def test_photoshop_plugin_img2img_and_inpaint(mode: str, dev_server: str, fill: int) -> None:
    """getSettings in img2img mode (init_images, denoising_strength) and inpaint/outpaint mode (mask as bare
    base64, inpaint_full_res from its checkbox, padding slider x 4, inpainting_fill from getMaskContent,
    mask_expansion and init_image_mask_name bookkeeping)."""
    size = 64 if mode == "lean" else 512
    init, mask = _canvas(size)
    body = {**sized(mode, PHOTOSHOP), "mode": "inpaint", "init_images": [_data_url(init).split(",", 1)[1]],
            "init_image_name": "init.png", "mask": _data_url(mask).split(",", 1)[1], "inpaint_full_res": False,
            "inpaint_full_res_padding": 32, "init_image_mask_name": "mask.png", "inpainting_fill": fill,
            "mask_expansion": 0}
    answer = httpx.post(f"{dev_server}{SDAPI}/img2img", json=body, timeout=1200)
    assert answer.status_code == 200, answer.text
    assert _image(base64.b64decode(answer.json()["images"][0])).size == (size, size)
    assert _png_info(dev_server, answer.json()["images"][0])["parameters"]["Denoising strength"] == "0.7"
    plain = {k: v for k, v in body.items() if k not in ("mask", "inpainting_fill", "init_image_mask_name")}
    again = httpx.post(f"{dev_server}{SDAPI}/img2img", json={**plain, "mode": "img2img"}, timeout=1200)
    assert again.status_code == 200, again.text


@pytest.fixture(scope="module")
def hires_openai_server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny SD 1.x model with [serving] openai_sizes_hires on: OpenAI's 1024 sizes through Hires fix."""
    tmp = tmp_path_factory.mktemp("hires")
    profile = dev_config(tmp, replace={"openai_sizes = false": "openai_sizes = false\nopenai_sizes_hires = true"})
    server = ServerProcess("--config", str(profile), "--model", str(tiny_model))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


@pytest.mark.client_defaults
def test_openai_1024_on_sd1_answers_through_hires_fix_under_the_option(hires_openai_server: str) -> None:
    """A client that can only ask 1024x1024 (the openai SDK, as a home-automation integration's schema allows):
    200 through Hires fix on the tiny SD 1.x model with the option. Under ``client_defaults``: the tiny VAE's
    mid-block attention at 1024x1024 takes ~40 s on 2 CPU cores (the unit test
    tests/unit/test_a1111_compat.py runs the same path on the fake engine in make test)."""
    client = openai.OpenAI(base_url=f"{hires_openai_server}/v1", api_key="x", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a lighthouse", size="1024x1024",
                                                   extra_body={"steps": 1})
    image = _image(base64.b64decode(raw.parse().data[0].b64_json or ""))
    assert image.size == (1024, 1024) and "through Hires fix" in raw.headers["x-sdserve-warnings"]
    assert image.info["parameters"].startswith("a lighthouse\nSteps: 1") and "Hires resize: 1024x1024" in \
        image.info["parameters"]


def test_openai_1024_on_sd1_is_400_naming_the_option_without_it(dev_server: str) -> None:
    """The same request on the dev profile (option off): a 400 that names the option."""
    without = openai.OpenAI(base_url=f"{dev_server}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        without.images.generate(prompt="a lighthouse", size="1024x1024")
    assert "openai_sizes_hires" in str(refused.value) and refused.value.status_code == 400
