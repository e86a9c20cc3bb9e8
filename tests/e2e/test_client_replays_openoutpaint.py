"""openOutpaint (zero01101/openOutpaint, commit 32f38d9) replayed from its source against a real `sdserve serve`
with a ControlNet folder and a LoRA library (issues 56 and 57): its ControlNet panel (js/extensions.js discovery,
js/ui/tool/dream.js ``addControlNetToAlwaysOnScripts``) and its LoRA picker (js/index.js ``getLoras`` and
``loraAutoComplete``). Each body is built as the client's source builds it; the reply is read as the client reads it
(dream.js ``_generate``: ``images`` and ``JSON.parse(info).all_seeds``). ``lean`` and ``defaults`` as in
tests/e2e/test_client_replays.py: lean (in ``make test``) shrinks only the image sizes to 64 px; ``defaults``
(marker ``client_defaults``) sends the client's own 512x512.

openOutpaint's ControlNet panel is an in/outpainting panel only: its model picker keeps the models whose name holds
"inpaint", its module picker the modules holding "inpaint" plus ``inpaint_global_harmonious``, and the optional
reference unit a ``reference*`` module with model "None". sdserve serves the inpaint modules (``inpaint``, labelled
``inpaint_global_harmonious``, and ``inpaint_only`` where img2img inpainting blends: server/controlnet.py): the
Dream tool's unit (the canvas and its mask, on txt2img) and the Img2Img tool's unit (no image: img2img's init image
and mask) are served, their infotext naming the unit; the reference modules are attention hooks sdserve does not
serve, refused by name (422 naming the unit's ``module``).

The second client replayed is the Photoshop plugin's ControlNet tab (AbdullahAlfaraj/Auto-Photoshop-StableDiffusion-
Plugin): its units take any model and module, and are served.

The library holds the tiny SD 1.x ControlNet of `sdserve engines tiny --controlnet` twice: as ``edges`` and under the
name of the ControlNet an openOutpaint user installs for the panel (``control_v11p_sd15_inpaint``), so its
inpaint-only model filter has something to pick. The UNet's residual variant and the ControlNet run on ONNX
Runtime's CPU provider (onnxruntime/python/onnxruntime_inference_collection.py InferenceSession).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from engines.build.controlnet import build_tiny_controlnet
from tests import lora_files as lf
from tests.e2e.conftest import ServerProcess, dev_config
from tests.e2e.test_client_replays import OPENOUTPAINT, PHOTOSHOP, sized

pytestmark = pytest.mark.slow
SDAPI = "/sdapi/v1"
INPAINT_NET = "control_v11p_sd15_inpaint"
LORA = "style"
BODY = {**OPENOUTPAINT, "alwayson_scripts": {}}
"""stableDiffusionData with the sliders' defaults (tests/e2e/test_client_replays.py OPENOUTPAINT) and, at commit
32f38d9, ``alwayson_scripts: {}`` on every request: extensions.js ``checkForSoftInpainting`` sets ``alwaysOnScripts``
unconditionally, so dream.js ``buildAlwaysOnScripts`` starts each request with an empty object."""


@pytest.fixture(params=["lean", pytest.param("defaults", marks=pytest.mark.client_defaults)])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny SD 1.x model under the dev profile with ``--controlnet-dir`` (``edges`` and ``INPAINT_NET``) and
    ``--lora-dir`` (one UNet LoRA, ``style``). The model is a copy of the session's tiny model with the tiny
    ControlNet and the UNet's residual variant added as `sdserve engines tiny --controlnet` adds them
    (engines/build/controlnet.py build_tiny_controlnet, after the same build_tiny), so the tiny model is not
    built twice. ``request_timeout_s`` is raised from the dev profile's 120 s: openOutpaint's fetch waits without a
    limit (as A1111 has no deadline), and its default dream (4 images of 512x512, 30 steps) can take longer than
    that on 2 busy CPU cores (a 504 after 27 of 30 steps, seen)."""
    root = tmp_path_factory.mktemp("openoutpaint")
    model, library, loras = root / "model", root / "controlnets", root / "loras"
    shutil.copytree(tiny_model, model)
    build_tiny_controlnet(library / "edges", model)
    shutil.copytree(library / "edges", library / INPAINT_NET)
    loras.mkdir()
    lf.write_safetensors(loras / f"{LORA}.safetensors", lf.numpy_lora(model, scale=0.2, seed=3))
    config = dev_config(root, replace={"request_timeout_s = 120": "request_timeout_s = 1200"})
    process = ServerProcess("--config", str(config), "--model", str(model), "--controlnet-dir", str(library),
                            "--lora-dir", str(loras))
    try:
        yield process.wait_ready(timeout=300)
    finally:
        assert process.stop() == 0, process.log


def _data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _canvas(size: int) -> tuple[Image.Image, Image.Image]:
    """The Dream tool's inputs for a reticle half over a picture: the init canvas (the picture over black) and the
    mask canvas (white where the canvas is empty, black over the picture)."""
    init = Image.new("RGB", (size, size), (0, 0, 0))
    init.paste(Image.effect_mandelbrot((size // 2, size), (-2, -1, 1, 1), 40).convert("RGB"), (0, 0))
    mask = Image.new("RGB", (size, size), (0, 0, 0))
    mask.paste((255, 255, 255), (size // 2, 0, size, size))
    return init, mask


def _read(answer: httpx.Response, size: int, count: int) -> list[np.ndarray]:
    """What ``_generate`` reads: ``images`` (base64 PNGs it draws) and ``JSON.parse(info).all_seeds``."""
    assert answer.status_code == 200, answer.text
    data = answer.json()
    seeds = json.loads(data["info"])["all_seeds"]
    assert len(data["images"]) == len(seeds) == count
    images = [Image.open(io.BytesIO(base64.b64decode(i))) for i in data["images"]]
    assert {i.size for i in images} == {(size, size)}
    return [np.asarray(i.convert("RGB")).astype(np.int16) for i in images]


def _panel(base: str) -> dict[str, Any]:
    """extensions.js ``getExtensions`` -> ``checkForControlNet`` -> ``getModels``/``getModules``: what the panel's
    three pickers offer, and the settings value it reads."""
    scripts = httpx.get(f"{base}{SDAPI}/scripts", timeout=10).json()
    found = [s for s in scripts["img2img"] if "controlnet" in s.lower()]
    version = httpx.get(f"{base}/controlnet/version", timeout=10).json()["version"]
    settings = httpx.get(f"{base}/controlnet/settings", timeout=10).json()
    models = httpx.get(f"{base}/controlnet/model_list", timeout=10).json()["model_list"]
    modules = httpx.get(f"{base}/controlnet/module_list", timeout=10).json()["module_list"]
    return {"scripts": found, "version": version, "settings": settings,
            "models": [m for m in models if "inpaint" in m],
            "modules": [m for m in modules if "inpaint" in m] + ["inpaint_global_harmonious"],
            "references": [m for m in modules if "reference" in m]}


def test_openoutpaint_controlnet_panel_discovery(server: str) -> None:
    """The panel is enabled: ``controlnet`` among GET scripts' img2img entries and ``version > 0``. Its model picker
    shows only the inpaint ControlNet (``name [hash8]``), its module picker sdserve's inpaint modules (``inpaint``,
    ``inpaint_only``) and the pushed ``inpaint_global_harmonious``, its reference picker nothing. It reads
    ``control_net_max_models_num`` from /controlnet/settings, the key sd-webui-controlnet renamed to
    ``control_net_unit_count`` in 2023 (commit 1d54023, scripts/api.py): absent on current A1111 and on sdserve
    alike, so ``undefined < 2`` is false and the reference box stays enabled in both."""
    panel = _panel(server)
    assert panel["scripts"] == ["controlnet"] and panel["version"] > 0
    assert panel["settings"] == {"control_net_unit_count": 3}
    assert len(panel["models"]) == 1 and panel["models"][0].startswith(f"{INPAINT_NET} [")
    assert panel["modules"] == ["inpaint", "inpaint_only", "inpaint_global_harmonious"]
    assert panel["references"] == []


def _unit(panel: dict[str, Any], image: str | None, mask: str | None) -> dict[str, Any]:
    """dream.js ``addControlNetToAlwaysOnScripts``: the picked module and model, the mode and resize selects'
    first options ("Balanced", "Just Resize"), processor_res 64, and the canvases as data URLs (the Dream tool) or
    no image at all (the Img2Img tool passes null canvases: the extension then takes img2img's init image)."""
    unit: dict[str, Any] = {"enabled": True, "module": panel["modules"][0], "model": panel["models"][0],
                            "control_mode": "Balanced", "processor_res": 64, "resize_mode": "Just Resize"}
    if image is not None:
        unit |= {"image": image, "mask": mask}
    return unit


def _refused_naming_module(answer: httpx.Response, index: int = 0) -> str:
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert ".".join(str(p) for p in detail["loc"]).endswith(f"alwayson_scripts.controlnet.args[{index}].module"), \
        detail
    assert "canny" in detail["msg"], detail  # the modules this server has, listed
    return str(detail["msg"])


def _controlled(answer: httpx.Response, size: int, count: int, model: str) -> list[np.ndarray]:
    """What ``_generate`` draws, and the infotext line of the unit (module as sdserve names it, the model picked)."""
    images = _read(answer, size, count)
    infotext = json.loads(answer.json()["info"])["infotexts"][0]
    assert f'ControlNet 0: "Module: inpaint, Model: {model}' in infotext and "ControlNet 1" not in infotext
    return images


def test_openoutpaint_dream_with_controlnet_inpainting(mode: str, server: str) -> None:
    """The Dream tool with "Toggle ControlNet In/Outpainting" ticked over a half-filled canvas: txt2img (dream.js
    sends ControlNet dreams to txt2img, after sd-webui-controlnet discussion 1464) with the canvas and its mask in the
    unit, module ``inpaint`` (inpaint_global_harmonious). Served: every image drawn, the infotext names the unit, and
    the images follow the control (they differ from the same dream without the unit; the tiny ControlNet's residuals
    do not depend on its hint, so this shows the ControlNet ran, tests/integration/test_controlnet_inpaint_parity.py
    shows the masked hint)."""
    panel = _panel(server)
    size = 64 if mode == "lean" else 512
    init, mask = _canvas(size)
    plain_body = {**sized(mode, BODY), "denoising_strength": 1, "seed": 4321}
    unit = _unit(panel, _data_url(init), _data_url(mask))
    body = {**plain_body, "alwayson_scripts": {"controlnet": {"args": [unit]}}}
    count = int(body["batch_size"]) * int(body["n_iter"])
    controlled = _controlled(httpx.post(f"{server}{SDAPI}/txt2img", json=body, timeout=1200), size, count,
                             panel["models"][0])
    plain = _read(httpx.post(f"{server}{SDAPI}/txt2img", json=plain_body, timeout=1200), size, count)
    assert min(float(np.abs(c - p).mean()) for c, p in zip(controlled, plain, strict=True)) > 1.0


def test_openoutpaint_controlnet_reference_unit(server: str) -> None:
    """"Reference as 1st CN Unit" ticked: dream.js unshifts ``{module: <reference module>, model: "None",
    threshold_a: fidelity 0.5, threshold_b: 64, image}`` before the inpaint unit. The reference picker is empty on
    sdserve, so the module is null in the client's JSON: refused naming ``args[0].module`` like any unknown module.
    A user who types A1111's ``reference_only`` gets the reason: an attention hook sdserve does not serve."""
    panel = _panel(server)
    init, mask = _canvas(64)
    reference = {"enabled": True, "module": panel["references"][0] if panel["references"] else None,
                 "model": "None", "control_mode": "Balanced", "image": _data_url(init), "processor_res": 64,
                 "threshold_a": 0.5, "threshold_b": 64, "resize_mode": "Just Resize"}
    units = [reference, _unit(panel, _data_url(init), _data_url(mask))]
    body = {**sized("lean", BODY), "alwayson_scripts": {"controlnet": {"args": units}}}
    _refused_naming_module(httpx.post(f"{server}{SDAPI}/txt2img", json=body, timeout=120))
    units[0]["module"] = "reference_only"
    msg = _refused_naming_module(httpx.post(f"{server}{SDAPI}/txt2img", json=body, timeout=120))
    assert "attention hook" in msg and "unknown" not in msg


def test_openoutpaint_img2img_tool_with_controlnet(server: str) -> None:
    """The Img2Img tool with the panel ticked: dream.js ``addControlNetToAlwaysOnScripts(state, null, null)``, a
    unit with no image or mask: sd-webui-controlnet's ``choose_input_image`` then uses img2img's init image and, for
    an inpaint unit, its mask; sdserve does the same. Served: the images drawn, the infotext names the unit, the
    images differ from the same img2img without it; outside the mask the init image comes back (A1111's overlay)."""
    panel = _panel(server)
    init, mask = _canvas(64)
    plain_body = {**sized("lean", BODY), "init_images": [_data_url(init)], "mask": _data_url(mask),
                  "denoising_strength": 0.7, "image_cfg_scale": 0.5, "steps": 12, "seed": 99}
    body = {**plain_body, "alwayson_scripts": {"controlnet": {"args": [_unit(panel, None, None)]}}}
    count = int(body["batch_size"]) * int(body["n_iter"])
    controlled = _controlled(httpx.post(f"{server}{SDAPI}/img2img", json=body, timeout=1200), 64, count,
                             panel["models"][0])
    plain = _read(httpx.post(f"{server}{SDAPI}/img2img", json=plain_body, timeout=1200), 64, count)
    assert min(float(np.abs(c - p)[:, 40:].mean()) for c, p in zip(controlled, plain, strict=True)) > 1.0
    kept = np.asarray(init).astype(np.int16)[:, :28]  # left of the mask (mask_blur 0): the init image
    assert all(float(np.abs(c[:, :28] - kept).mean()) < 2.0 for c in controlled)


def test_openoutpaint_lora_picker(mode: str, server: str) -> None:
    """index.js ``getLoras``: GET /sdapi/v1/loras, each entry's ``name`` as the picker's option; picking one appends
    ``"  <lora:" + value + ":1>"`` to the prompt box. The Dream tool on an empty canvas then posts the whole
    stableDiffusionData to txt2img (with its empty ``alwayson_scripts``) and draws every image; the seed typed into
    the seed box (a string) makes the LoRA's effect visible against the same dream without it."""
    entries = httpx.get(f"{server}{SDAPI}/loras", timeout=10).json()
    options = [entry["name"] for entry in entries]
    assert options == [LORA]
    body = {**sized(mode, BODY), "seed": "1234"}
    size = body["width"]
    plain = _read(httpx.post(f"{server}{SDAPI}/txt2img", json=body, timeout=1200), size, 4)
    picked = {**body, "prompt": body["prompt"] + "  <lora:" + options[0] + ":1>"}
    answer = httpx.post(f"{server}{SDAPI}/txt2img", json=picked, timeout=1200)
    adapted = _read(answer, size, 4)
    assert json.loads(answer.json()["info"])["all_seeds"][0] == 1234
    assert "Lora hashes" in json.loads(answer.json()["info"])["infotexts"][0]
    assert min(float(np.abs(a - p).mean()) for a, p in zip(adapted, plain, strict=True)) > 1.0


# The second client whose ControlNet requests are replayed here: the Photoshop plugin's ControlNet tab
# (AbdullahAlfaraj/Auto-Photoshop-StableDiffusion-Plugin, commit 6f6d490), whose units any model and module take.

def test_photoshop_plugin_controlnet_tab_txt2img(mode: str, server: str) -> None:
    """typescripts/controlnet/entry.ts ``initializeControlNetTab`` (GET version, settings read as
    ``control_net_unit_count || control_net_max_models_num``, model_list, module_list?alias_names=true) and
    ``mapPluginSettingsToControlNet``: one unit per ``maxControlNet``, unit 0 enabled with the picked module and
    model, the rest disabled and empty; each with the legacy ``input_image`` (raw base64), ``mask: ''`` (txt2img is
    a maskless mode), ``resize_mode`` "Crop and Resize", ``lowvram``, store.ts defaults (processor_res 512,
    thresholds 0: picking a module moves no slider), and, as the API version is above 1, ``control_mode`` and
    ``pixel_perfect`` (true); the payload keeps the legacy top-level ``controlnet_units`` beside
    ``alwayson_scripts.controlnet.args``, ``subseed -1`` and empty ``override_settings``. The settings are the
    plugin's getSettings() (tests/e2e/test_client_replays.py PHOTOSHOP). Served: the image follows the control and
    the infotext names the unit."""
    assert httpx.get(f"{server}/controlnet/version", timeout=10).json()["version"] > 1
    settings = httpx.get(f"{server}/controlnet/settings", timeout=10).json()
    units_count = settings.get("control_net_unit_count") or settings.get("control_net_max_models_num") or 0
    assert units_count == 3
    models = httpx.get(f"{server}/controlnet/model_list", timeout=10).json()["model_list"]
    modules = httpx.get(f"{server}/controlnet/module_list", params={"alias_names": "true"}, timeout=10).json()
    assert "canny" in modules["module_list"] and "canny" in modules["module_detail"]
    model = next(m for m in models if m.startswith("edges ["))
    size = 64 if mode == "lean" else 512
    init, _ = _canvas(size)
    picture = _data_url(init).removeprefix("data:image/png;base64,")
    idle = {"enabled": False, "input_image": "", "mask": "", "module": "", "model": "", "weight": 1.0}
    units = [{"enabled": True, "input_image": picture, "mask": "", "module": "canny", "model": model,
              "weight": 1.0}] + [dict(idle) for _ in range(units_count - 1)]
    for unit in units:
        unit |= {"resize_mode": "Crop and Resize", "lowvram": True, "processor_res": 512, "threshold_a": 0,
                 "threshold_b": 0, "guidance_start": 0, "guidance_end": 1, "control_mode": "Balanced",
                 "pixel_perfect": True}
    settings_body = {**sized(mode, PHOTOSHOP), "seed": "77", "steps": "20" if mode == "defaults" else "4"}
    payload = {**settings_body, "controlnet_units": units, "subseed": -1, "override_settings": {},
               "override_settings_restore_afterwards": True, "alwayson_scripts": {"controlnet": {"args": units}}}
    answer = httpx.post(f"{server}{SDAPI}/txt2img", json=payload, timeout=1200)
    controlled = _read(answer, size, 1)[0]
    infotext = json.loads(answer.json()["info"])["infotexts"][0]
    assert f'ControlNet 0: "Module: canny, Model: {model}' in infotext and "ControlNet 1" not in infotext
    assert "Pixel Perfect: True" in infotext
    plain = _read(httpx.post(f"{server}{SDAPI}/txt2img", json=settings_body, timeout=1200), size, 1)[0]
    assert float(np.abs(controlled - plain).mean()) > 1.0
