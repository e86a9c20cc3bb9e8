"""Clients, fifth pass (issue 57), replayed from their source against a real `sdserve serve`: aiyabot's /upscale and
/identify, AI Render's sampler list and upscale, webuiapi's txt2img and extras over a socket, SillyTavern with its
ADetailer box ticked and Home Assistant's image service. Each body is built as the client's source builds it
(repository, file and commit named per test); the response is read as the client reads it. ``lean`` and
``defaults`` as in tests/e2e/test_client_replays.py: lean (in ``make test``) shrinks only the image sizes (64 px,
the tiny model's native size); ``defaults`` (marker ``client_defaults``) sends the clients' own sizes.

The upscaler folder holds the tiny RRDBNet of engines/build/esrgan.py exported as ``ESRGAN_4x.onnx``: the name
aiyabot offers and AI Render picks by default, served with ``sdserve serve --upscaler-dir DIR`` (docs/api.md,
"extras"); ONNX Runtime's CPU provider (onnxruntime/core/providers/cpu) runs it tile by tile.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import webuiapi
from PIL import Image

from engines.build.esrgan import export_rrdbnet, tiny_rrdbnet
from tests.e2e.conftest import ServerProcess
from tests.e2e.test_client_replays import sized, xl_server

SDAPI = "/sdapi/v1"
UPSCALER = "ESRGAN_4x"
__all__ = ["xl_server"]
"""xl_server (the tiny SDXL with [serving] openai_sizes) is shared with the third pass's replays."""


@pytest.fixture(params=["lean", pytest.param("defaults", marks=pytest.mark.client_defaults)])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def side(mode: str) -> int:
    """The clients' image side: 512 (their default), 64 in lean mode."""
    return 512 if mode == "defaults" else 64


@pytest.fixture(scope="module")
def upscale_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny SD 1.x model under the dev profile with an upscaler folder holding ``ESRGAN_4x.onnx``."""
    folder = tmp_path_factory.mktemp("upscalers")
    export_rrdbnet(tiny_rrdbnet(), folder / f"{UPSCALER}.onnx")
    server = ServerProcess("--profile", "dev", "--model", str(tiny_model), "--upscaler-dir", str(folder))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


def _picture(size: int) -> bytes:
    buffer = io.BytesIO()
    Image.effect_mandelbrot((size, size), (-2, -1, 1, 1), 40).convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64.removeprefix("data:image/png;base64,"))))


# aiyabot (Kilvoctu/aiyabot): /upscale and /identify.

def test_aiyabot_upscale(mode: str, upscale_server: str) -> None:
    """core/upscalecog.py (commit 0ecf48a) ``dream``: the attachment as a data URL, ``resize`` (default 2.0), the
    picked upscaler_1, upscaler_2 "None" at its default strength 0.5 (upscaler_2 defaults to the string, so the
    pair is always sent), gfpgan and codeformer 0.0, upscale_first False; POST extra-single-image through a
    requests session (after POST /login), then response.json()['image'] is base64-decoded and opened by PIL."""
    size = side(mode)
    payload = {"upscaling_resize": 2.0, "upscaler_1": UPSCALER, "image": _data_url(_picture(size)),
               "gfpgan_visibility": 0.0, "codeformer_visibility": 0.0, "upscale_first": False,
               "upscaler_2": "None", "extras_upscaler_2_visibility": 0.5}
    with httpx.Client(base_url=upscale_server, timeout=1200) as session:
        session.post("/login")  # aiyabot's login without gradio auth; its answer is not read
        answer = session.post(f"{SDAPI}/extra-single-image", json=payload)
    assert answer.status_code == 200, answer.text
    assert _decoded(answer.json()["image"]).size == (2 * size, 2 * size)


@pytest.mark.parametrize("choice", ["LDSR", "SwinIR_4x", "ScuNET GAN"])
def test_aiyabot_upscaler_choices_sdserve_lacks_are_422_naming_them(upscale_server: str, choice: str) -> None:
    """The bot's fixed choices include A1111's model upscalers: one this server lacks is a 422 naming the field and
    the upscaler (aiyabot posts the exception text in its "txt2img failed" embed)."""
    payload = {"upscaling_resize": 2.0, "upscaler_1": choice, "image": _data_url(_picture(64)),
               "gfpgan_visibility": 0.0, "codeformer_visibility": 0.0, "upscale_first": False,
               "upscaler_2": "None", "extras_upscaler_2_visibility": 0.5}
    answer = httpx.post(f"{upscale_server}{SDAPI}/extra-single-image", json=payload, timeout=60)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", "upscaler_1"] and choice in detail["msg"]


@pytest.mark.parametrize(("phrasing", "named"), [("clip", "CLIP interrogator"), ("deepdanbooru", "DeepDanbooru")])
def test_aiyabot_identify_is_a_501_naming_the_missing_model(upscale_server: str, phrasing: str,
                                                            named: str) -> None:
    """core/identifycog.py (commit 0e9a0cc) ``dream``: phrasing Normal -> model "clip", Tags -> "deepdanbooru";
    POST interrogate with the image as a data URL, then response.json().get('caption'). sdserve has no
    interrogator: a 501 (not a bare 404) whose detail names the model the operator would add."""
    payload = {"image": _data_url(_picture(64)), "model": phrasing}
    answer = httpx.post(f"{upscale_server}{SDAPI}/interrogate", json=payload, timeout=60)
    assert answer.status_code == 501, answer.text
    assert answer.json().get("caption") is None and named in answer.json()["detail"]


# AI Render (benrugg/AI-Render): its sampler list on img2img, then its upscale.

AI_RENDER_SAMPLERS = ["Euler", "Euler a", "Heun", "DPM2", "DPM2 a", "LMS", "DPM fast", "DPM adaptive",
                      "DPM++ 2S a Karras", "DPM++ 2M Karras", "DPM++ SDE Karras", "DPM++ 2S a", "DPM++ 2M",
                      "DPM++ SDE", "PLMS", "DDIM"]
"""sd_backends/automatic1111_api.py (commit 6356599) get_samplers(); default_sampler() is "LMS"."""


def _ai_render_img2img(base: str, size: int, sampler: str, steps: int) -> httpx.Response:
    """``generate``: map_params (denoising_strength = round(1 - image_similarity, 2), sampler_index = sampler) and
    the render as a data URL in init_images, posted with its Blender headers; handle_success reads images[0]."""
    params = {"prompt": "a stone bridge over a river", "negative_prompt": "", "width": size, "height": size,
              "seed": 42, "cfg_scale": 7, "steps": steps, "sampler": sampler, "image_similarity": 0.4}
    params |= {"denoising_strength": round(1 - params["image_similarity"], 2), "sampler_index": sampler,
               "init_images": [_data_url(_picture(size))]}
    headers = {"User-Agent": "Blender/4.2.0", "Accept": "*/*", "Accept-Encoding": "gzip, deflate, br"}
    return httpx.post(f"{base}{SDAPI}/img2img", json=params, headers=headers, timeout=1200)


def test_ai_render_default_sampler_img2img(mode: str, upscale_server: str) -> None:
    """The add-on's default sampler (LMS) at its 512x512 default render size (lean: 64) on img2img, the only route
    it calls: served (LMS's plan takes the edit's start step as diffusers' img2img runs it, its history empty there),
    labelled LMS in the infotext, and the image depends on the sampler (Euler a gives another)."""
    size = side(mode)
    steps = 20 if mode == "defaults" else 4
    answer = _ai_render_img2img(upscale_server, size, "LMS", steps)
    assert answer.status_code == 200, answer.text
    assert "Sampler: LMS," in json.loads(answer.json()["info"])["infotexts"][0]
    image = _decoded(answer.json()["images"][0])
    assert image.size == (size, size)
    other = _ai_render_img2img(upscale_server, size, "Euler a", steps)
    assert other.status_code == 200, other.text
    assert _decoded(other.json()["images"][0]).tobytes() != image.tobytes()


def test_ai_render_sampler_list(upscale_server: str) -> None:
    """Every sampler of the add-on's list on SD 1.x img2img (the only route it calls): served and labelled in the
    infotext, or a 422 naming sampler_name that lists the samplers img2img runs, each of which is then served.
    Every sampler GET /sdapi/v1/samplers lists runs on img2img too (LMS, Heun and PLMS included); the add-on's
    others (DPM2, DPM fast, DPM adaptive, the 2S a and SDE ones) are not listed and refused by name."""
    offered = {s["name"] for s in httpx.get(f"{upscale_server}{SDAPI}/samplers").json()}
    served, refused, runs = [], {}, set()
    for sampler in AI_RENDER_SAMPLERS:
        answer = _ai_render_img2img(upscale_server, 64, sampler, 2)
        if answer.status_code == 200:
            served.append(sampler)
            infotext = json.loads(answer.json()["info"])["infotexts"][0]
            assert f"Sampler: {sampler.removesuffix(' Karras')}," in infotext, (sampler, infotext)
            continue
        assert answer.status_code == 422, (sampler, answer.text)
        detail = answer.json()["detail"][0]
        assert detail["loc"] == ["body", "sampler_name"] and "available: [" in detail["msg"], detail
        refused[sampler] = detail["msg"]
        runs |= set(json.loads(detail["msg"].rsplit("available: ", 1)[1].replace("'", '"')))
    assert {"Euler", "Euler a", "DPM++ 2M", "DPM++ 2M Karras", "DDIM"} <= set(served), refused
    assert {s for s in AI_RENDER_SAMPLERS if s in runs} <= set(served), refused
    assert set(served) == {s for s in AI_RENDER_SAMPLERS if s in offered or s.removesuffix(" Karras") in offered}
    assert {"LMS", "Heun", "PLMS"} <= set(served), refused
    print(f"AI Render's {len(AI_RENDER_SAMPLERS)} samplers on SD 1.x img2img: {len(served)} served, "
          f"{len(refused)} refused ({sorted(refused)}; listed by GET samplers: {sorted(set(refused) & offered)})")


def test_ai_render_upscale(mode: str, upscale_server: str) -> None:
    """``load_upscaler_models``: GET upscalers, the names but "None"; the default model ESRGAN_4x is among them.
    ``upscale``: resize_mode 0 with upscale_factor (default 2.0), upscaling_resize_w/h from the sanitized upscaled
    size, upscaling_crop, upscale_first True, show_extras_results and codeformer_weight; handle_success reads
    response.get("images", [False])[0] or response.get("image")."""
    names = [u["name"] for u in httpx.get(f"{upscale_server}{SDAPI}/upscalers", timeout=10).json()
             if u["name"] != "None"]
    assert UPSCALER in names and {"Lanczos", "Nearest"} <= set(names)
    size = side(mode)
    data = {"resize_mode": 0, "show_extras_results": True, "gfpgan_visibility": 0, "codeformer_visibility": 0,
            "codeformer_weight": 0, "upscaling_resize": 2.0, "upscaling_resize_w": 2 * size,
            "upscaling_resize_h": 2 * size, "upscaling_crop": True, "upscaler_1": UPSCALER, "upscaler_2": "None",
            "extras_upscaler_2_visibility": 0, "upscale_first": True, "image": _data_url(_picture(size))}
    answer = httpx.post(f"{upscale_server}{SDAPI}/extra-single-image", json=data, timeout=1200,
                        headers={"User-Agent": "Blender/4.2.0"})
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    image = reply.get("images", [False])[0] or reply.get("image")
    assert _decoded(image).size == (2 * size, 2 * size)


# webuiapi (mix1009/sdwebuiapi, the installed package): its own methods over a socket.

def _webui(base: str) -> webuiapi.WebUIApi:
    """WebUIApi(host, port) with the constructor's defaults: sampler "Euler a", steps 20."""
    host, port = base.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port))


def test_webuiapi_txt2img_with_its_default_euler_a(mode: str, upscale_server: str) -> None:
    """api.txt2img(prompt=...) with the package's defaults (Euler a, 20 steps, 512x512, cfg 7, seed -1); its
    WebUIApiResult's image, info and parameters."""
    size = side(mode)
    result = _webui(upscale_server).txt2img(prompt="a red fox in snow", width=size, height=size,
                                            steps=20 if mode == "defaults" else 4)
    assert result.image.size == (size, size)
    assert result.info["sampler_name"] == "Euler a" and result.parameters["sampler_name"] == "Euler a"


def test_webuiapi_extras(mode: str, upscale_server: str) -> None:
    """api.extra_single_image and api.extra_batch_images (PIL images in, raw_b64 images out) with the ONNX
    upscaler, and api.interrogate, whose non-200 the package raises as RuntimeError(status, text)."""
    api, size = _webui(upscale_server), side(mode)
    source = Image.open(io.BytesIO(_picture(size)))
    single = api.extra_single_image(image=source, upscaler_1=UPSCALER, upscaling_resize=2)
    assert single.image.size == (2 * size, 2 * size)
    batch = api.extra_batch_images(images=[source, source.transpose(Image.Transpose.FLIP_LEFT_RIGHT)],
                                   upscaler_1="Lanczos", upscaling_resize=2)
    assert [i.size for i in batch.images] == [(2 * size, 2 * size)] * 2
    with pytest.raises(RuntimeError) as raised:
        api.interrogate(source)
    status, text = raised.value.args
    assert status == 501 and "CLIP interrogator" in text


# SillyTavern (SillyTavern/SillyTavern) with "ADetailer (face)" ticked.

def test_sillytavern_adetailer_refusal_names_the_script(mode: str, upscale_server: str) -> None:
    """public/scripts/extensions/stable-diffusion/index.js (the ``adetailer_face`` block of generateAutoImage)
    adds alwayson_scripts.ADetailer {args: [true, true, {ad_model: "face_yolov8n.pt"}]}; src/endpoints/
    stable-diffusion.js (its /generate handler) first GETs options (Forge test:
    ``forge_preset``), forwards the body to txt2img, and on a non-OK reply throws with the reply's text as the
    error's cause (its server log) and answers its own UI a bare 500: SillyTavern shows "Internal Server Error"
    whatever the backend says. sdserve's side: the text it logs is a 422 naming the script, as A1111 refuses a
    script it lacks, and the same body without the box is served."""
    options = httpx.get(f"{upscale_server}{SDAPI}/options", timeout=10)
    assert options.status_code == 200 and "forge_preset" not in options.json()
    body = sized(mode, {
        "url": upscale_server, "auth": "", "prompt": "a knight, portrait", "negative_prompt": "lowres",
        "sampler_name": "DDIM", "scheduler": "normal", "steps": 20, "cfg_scale": 7, "width": 512, "height": 512,
        "restore_faces": False, "enable_hr": False, "clip_skip": 1, "save_images": True, "send_images": True,
        "override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": True,
        "alwayson_scripts": {"ADetailer": {"args": [True, True, {"ad_model": "face_yolov8n.pt"}]}}})
    refused = httpx.post(f"{upscale_server}{SDAPI}/txt2img", json=body, timeout=60)
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"][0]
    assert detail["loc"] == ["body", "alwayson_scripts", "ADetailer"] or \
        detail["loc"] == ["body", "alwayson_scripts.ADetailer"], detail
    assert "ADetailer is not installed on this server" in detail["msg"]
    without = {k: v for k, v in body.items() if k != "alwayson_scripts"}
    served = httpx.post(f"{upscale_server}{SDAPI}/txt2img", json=without, timeout=1200)
    assert served.status_code == 200, served.text


# Home Assistant (home-assistant/core): the openai_conversation.generate_image service.

@pytest.fixture
def openai_base(mode: str, request: pytest.FixtureRequest) -> str:
    """Where Home Assistant's 1024 sizes go: the dev server (lean), the tiny SDXL with openai_sizes (defaults)."""
    return str(request.getfixturevalue("xl_server" if mode == "defaults" else "dev_server"))


@pytest.mark.parametrize("size", ["1024x1024", "1024x1792"])
def test_home_assistant_generate_image_service(mode: str, openai_base: str, size: str) -> None:
    """homeassistant/components/openai_conversation/__init__.py (commit 004090e): async_setup_entry lists models
    through AsyncOpenAI (10 s timeout), then render_image calls images.generate(model dall-e-3, prompt, size (its
    schema: 1024x1024, 1024x1792, 1792x1024), quality standard, style vivid, response_format url, n 1) and returns
    data[0].model_dump(exclude={"b64_json"}): the url the automation then fetches."""
    import asyncio

    body = sized(mode, {"model": "dall-e-3", "prompt": "a cosy living room at night", "size": size,
                        "quality": "standard", "style": "vivid", "response_format": "url", "n": 1})

    async def service() -> dict[str, Any]:
        client = openai.AsyncOpenAI(base_url=f"{openai_base}/v1", api_key="ha", max_retries=0, timeout=1200)
        async with client:
            await client.with_options(timeout=10.0).models.list()
            response = await client.images.generate(**body)
        return response.data[0].model_dump(exclude={"b64_json"})

    data = asyncio.run(service())
    assert data["url"].startswith(f"{openai_base}/v1/images/files/")
    fetched = httpx.get(data["url"], timeout=60)
    assert fetched.status_code == 200
    width, height = (int(v) for v in body["size"].split("x"))
    assert Image.open(io.BytesIO(fetched.content)).size == (width, height)


# The samplers these clients send by default, on a flow-matching model (FLUX.1 dev-like, guidance embedded).

@pytest.fixture(scope="module")
def flux_server(dit_build: Any) -> Iterator[str]:
    """The tiny FLUX.1 dev-like model under the dev profile."""
    server = ServerProcess("--profile", "dev", "--model", str(dit_build("flux")[0]))
    try:
        yield server.wait_ready(timeout=300)
    finally:
        assert server.stop() == 0, server.log


def test_aiyabot_and_webuiapi_euler_a_on_flux(mode: str, flux_server: str) -> None:
    """aiyabot core/stablecog.py (commit eb8ff68) dream_handler with its channel defaults (sampler "Euler a", steps
    30, cfg_scale "7.0" as a string, 512x512, styles ["None"], clip skip 1 as an override) and webuiapi's txt2img
    with the package's defaults (Euler a, 20 steps): both served on FLUX.1 with the flow formulation of Euler a
    (diffusers' FlowMatchEulerDiscreteScheduler with stochastic sampling), labelled "Euler a" in the infotext."""
    size = side(mode)
    dream = sized(mode, {"prompt": "a castle on a hill", "negative_prompt": "", "steps": 30, "width": 512,
                         "height": 512, "cfg_scale": "7.0", "sampler_index": "Euler a", "seed": 1234567,
                         "n_iter": 1, "batch_size": 1, "styles": ["None"],
                         "override_settings": {"CLIP_stop_at_last_layers": 1}})
    answer = httpx.post(f"{flux_server}{SDAPI}/txt2img", json=dream, timeout=1200)
    assert answer.status_code == 200, answer.text
    info = json.loads(answer.json()["info"])
    assert "Sampler: Euler a," in info["infotexts"][0] and info["seed"] == 1234567
    assert _decoded(answer.json()["images"][0]).size == (size, size)
    result = _webui(flux_server).txt2img(prompt="a red fox in snow", width=size, height=size)
    assert result.image.size == (size, size) and result.info["sampler_name"] == "Euler a"
