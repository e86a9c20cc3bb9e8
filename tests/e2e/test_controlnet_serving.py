"""ControlNet served by a real `sdserve serve --profile dev --controlnet-dir` (issue 56): the tiny SD 1.x model and its
tiny ControlNet built by `sdserve engines tiny --controlnet`, sd-webui-controlnet's routes (its ``scripts/api.py``),
``alwayson_scripts.controlnet`` units on txt2img and img2img as A1111 clients send them (webuiapi's
``ControlNetUnit.to_dict`` replayed through webuiapi itself), weight 0 giving the plain image, bad units refused with
A1111's 422 naming the field, and a ControlNet folder that does not fit the model refused by name without stopping
the boot. The residual UNet and the ControlNet run on ONNX Runtime's CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

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
import webuiapi
from PIL import Image

from tests.e2e.conftest import ServerProcess, controlnet_copy

pytestmark = pytest.mark.slow
TXT2IMG = "/sdapi/v1/txt2img"
BASE = {"prompt": "a lighthouse at dusk", "steps": 4, "seed": 21, "width": 64, "height": 64,
        "sampler_name": "Euler", "cfg_scale": 7.0}


@pytest.fixture(scope="module")
def built(controlnet_tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(model with unet_controlnet/, ControlNet library) from the CLI (this module's copy of the session's build:
    tests/e2e/conftest.py); the library also holds a folder that does not fit the model (a config for another base:
    refused by name at load)."""
    model, library = controlnet_copy(controlnet_tiny, tmp_path_factory.mktemp("controlnet-e2e"))
    odd = library / "other_base"
    shutil.copytree(library / "edges", odd)
    config = json.loads((odd / "config.json").read_text())
    config["cross_attention_dim"] = int(config.get("cross_attention_dim", 32)) * 2 + 8  # SDXL-like text width
    (odd / "config.json").write_text(json.dumps(config))
    return model, library


@pytest.fixture(scope="module")
def server(built: tuple[Path, Path]) -> Iterator[ServerProcess]:
    model, library = built
    process = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library))
    try:
        process.wait_ready(timeout=300)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _pattern(moved: bool = False) -> str:
    """A control image with edges: a bright square on black (``moved``: a smaller one in a corner, and a vertical
    band), 64x64 PNG as base64."""
    image = np.zeros((64, 64, 3), np.uint8)
    if moved:
        image[4:24, 40:60] = 255
        image[:, 8:14] = 128
    else:
        image[16:48, 16:48] = 255
        image[28:36, :] = 128
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(np.int16)


def _unit(model: str, **extra: Any) -> dict[str, Any]:
    return {"enabled": True, "image": _pattern(), "module": "canny", "model": model, "weight": 1.0,
            "resize_mode": "Crop and Resize", "threshold_a": 100, "threshold_b": 200, **extra}


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + TXT2IMG, json=body, timeout=120)


def _edges_title(url: str) -> str:
    listed = httpx.get(f"{url}/controlnet/model_list").json()["model_list"]
    found = [t for t in listed if t.startswith("edges [")]
    assert len(found) == 1, listed
    return found[0]


def test_routes_list_the_folder_and_the_preprocessors(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    title = _edges_title(url)
    assert len(title) == len("edges [") + 8 + 1  # name [hash8], as sd-webui-controlnet lists it
    modules = httpx.get(f"{url}/controlnet/module_list").json()
    assert "canny" in modules["module_list"] and "sliders" in modules["module_detail"]["canny"]
    assert httpx.get(f"{url}/controlnet/version").json() == {"version": 2}
    # the folder for another base is refused by name in the log; the server booted and serves the fitting one,
    # and lists only that one (a refused file is not offered to clients)
    assert "other_base" in server.log and "refused" in server.log
    assert httpx.get(f"{url}/controlnet/model_list").json() == {"model_list": [title]}
    scripts = httpx.get(f"{url}/sdapi/v1/scripts").json()
    assert "controlnet" in scripts["txt2img"] and "controlnet" in scripts["img2img"]
    info = httpx.get(f"{url}/sdapi/v1/script-info").json()
    assert {(s["name"], s["is_alwayson"], s["is_img2img"]) for s in info} == {("controlnet", True, False),
                                                                             ("controlnet", True, True)}
    assert all(len(s["args"]) == 3 for s in info)  # one per unit (control_net_unit_count)


def test_units_change_the_image_and_weight_zero_gives_the_plain_one(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    title = _edges_title(url)
    plain = _post(url, BASE)
    assert plain.status_code == 200, plain.text
    controlled = _post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": [_unit(title)]}}})
    assert controlled.status_code == 200, controlled.text
    zero = _post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": [_unit(title, weight=0.0)]}}})
    assert zero.status_code == 200, zero.text
    base_px, ctrl_px, zero_px = (_pixels(r.json()["images"][0]) for r in (plain, controlled, zero))
    assert np.abs(ctrl_px - base_px).mean() > 2.0  # the control has teeth
    assert np.abs(zero_px - base_px).max() <= 1  # weight 0: the plain image (within one 8-bit level)
    first, moved = (_post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": [
        _unit(title, module="none", image=_pattern(shifted))]}}}) for shifted in (False, True))
    assert first.status_code == moved.status_code == 200, (first.text, moved.text)
    first_px, moved_px = _pixels(first.json()["images"][0]), _pixels(moved.json()["images"][0])
    steered, moved_by = np.abs(moved_px - first_px).mean(), np.abs(moved_px - base_px).mean()
    print(f"\ncontrol image moved: {steered:.2f} mean levels from the first one's image ({moved_by:.2f} from the "
          "plain one)")
    assert steered > 1.0  # the image follows its control image, not just the presence of a unit
    info = json.loads(controlled.json()["info"])["infotexts"][0]
    assert f'ControlNet 0: "Module: canny, Model: {title}, Weight: 1' in info
    assert "ControlNet 0" not in json.loads(plain.json()["info"])["infotexts"][0]


def test_webuiapi_controlnet_unit_replayed(server: ServerProcess) -> None:
    """webuiapi 0.9's ``txt2img(controlnet_units=[ControlNetUnit(...)])``: ``alwayson_scripts.ControlNet`` (capital
    C), ``mask: None``, ``resize_mode`` by name, ``control_mode`` as a name, ``low_vram`` and ``hr_option`` sent."""
    url = server.url
    assert url is not None
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)
    assert _edges_title(url) in api.controlnet_model_list()
    assert "canny" in api.controlnet_module_list()
    image = Image.open(io.BytesIO(base64.b64decode(_pattern())))
    unit = webuiapi.ControlNetUnit(image=image, module="canny", model=_edges_title(url), weight=1.0,
                                   threshold_a=100, threshold_b=200)
    # a fresh alwayson_scripts: webuiapi's default is one dict shared by every call, which txt2img writes the units
    # into, so every later webuiapi request of this process would carry them (to servers without ControlNet too)
    result = api.txt2img(prompt=BASE["prompt"], seed=21, width=64, height=64, cfg_scale=7.0,
                         controlnet_units=[unit], alwayson_scripts={})
    controlled = _post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": [_unit(
        _edges_title(url), resize_mode="Resize and Fill")]}}})
    mine = _pixels(controlled.json()["images"][0])
    assert np.abs(np.asarray(result.image.convert("RGB")).astype(np.int16) - mine).max() <= 1
    assert 'ControlNet 0: "Module: canny' in result.info["infotexts"][0]


def test_img2img_takes_units(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    body = {**BASE, "init_images": [_pattern()], "denoising_strength": 0.75}
    plain = httpx.post(f"{url}/sdapi/v1/img2img", json=body, timeout=120)
    controlled = httpx.post(f"{url}/sdapi/v1/img2img", json={
        **body, "alwayson_scripts": {"controlnet": {"args": [_unit(_edges_title(url))]}}}, timeout=120)
    assert plain.status_code == 200 and controlled.status_code == 200, controlled.text
    assert np.abs(_pixels(controlled.json()["images"][0]) - _pixels(plain.json()["images"][0])).mean() > 1.0
    assert "ControlNet 0" in json.loads(controlled.json()["info"])["infotexts"][0]


@pytest.mark.parametrize(("unit", "field", "fragment"), [
    ({"model": "missing"}, "alwayson_scripts.controlnet.args[0].model", "edges ["),
    ({"module": "depth_midas"}, "alwayson_scripts.controlnet.args[0].module", "canny"),
    # refused by the engine at load: not listed, so unknown by name like any other
    ({"model": "other_base"}, "alwayson_scripts.controlnet.args[0].model", "edges ["),
])
def test_bad_units_are_422_naming_the_field(server: ServerProcess, unit: dict[str, Any], field: str,
                                            fragment: str) -> None:
    url = server.url
    assert url is not None
    answer = _post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": [_unit(_edges_title(url)) | unit]}}})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert fragment in detail["msg"] and ".".join(detail["loc"][1:]).endswith(field), detail
    four = [_unit(_edges_title(url))] * 4  # over control_net_unit_count (3)
    over = _post(url, {**BASE, "alwayson_scripts": {"controlnet": {"args": four}}})
    assert over.status_code == 422 and "control_net_unit_count" in over.text
