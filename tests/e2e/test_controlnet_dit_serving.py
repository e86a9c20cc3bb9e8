"""FLUX.1 ControlNet served by a real `sdserve serve --profile dev --controlnet-dir` (issue 56, the DiT ControlNet):
the tiny FLUX.1 [dev] model with its residual transformer (``transformer_controlnet/``) and a tiny FluxControlNetModel
built by `sdserve engines tiny --family flux --controlnet` (engines/build/controlnet_dit.py); an
``alwayson_scripts.controlnet`` txt2img unit changes the image, the same unit at weight 0 gives the plain one, and a
ControlNet for another base (the tiny SD 1.x one) is refused by name at load and per request. The ControlNet and the
residual transformer run on ONNX Runtime's CPU provider (onnxruntime/python/onnxruntime_inference_collection.py
InferenceSession)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.conftest import ServerProcess
from tests.e2e.test_controlnet_serving import _pattern, _pixels

pytestmark = pytest.mark.slow
TXT2IMG = "/sdapi/v1/txt2img"
BASE = {"prompt": "a lighthouse at dusk", "steps": 4, "seed": 23, "width": 64, "height": 64,
        "sampler_name": "Euler", "cfg_scale": 3.5}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from engines.build.controlnet import export_controlnet, make_tiny_controlnet

    root = tmp_path_factory.mktemp("controlnet-dit-e2e")
    model, library = root / "model", root / "controlnets"
    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "tiny", "--family", "flux", "--out",
                           str(model), "--controlnet", str(library / "flux_edges")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (model / "transformer_controlnet" / "model.onnx").is_file()
    export_controlnet(make_tiny_controlnet(0, "sd1"), library / "sd15_edges", {"kind": "tiny", "seed": 0})
    process = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library))
    try:
        process.wait_ready(timeout=300)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _post(url: str, units: list[dict[str, Any]] | None = None) -> httpx.Response:
    body = {**BASE, **({"alwayson_scripts": {"controlnet": {"args": units}}} if units is not None else {})}
    return httpx.post(url + TXT2IMG, json=body, timeout=300)


def _unit(model: str, **extra: Any) -> dict[str, Any]:
    return {"enabled": True, "image": _pattern(), "module": "canny", "model": model, "weight": 1.0,
            "resize_mode": "Crop and Resize", "threshold_a": 100, "threshold_b": 200, **extra}


def test_flux_units_change_the_image_and_weight_zero_gives_the_plain_one(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    listed = httpx.get(f"{url}/controlnet/model_list").json()["model_list"]
    assert [t.split(" [")[0] for t in listed] == ["flux_edges"], listed  # the SD 1.x file is not offered
    assert "ControlNet sd15_edges refused" in server.log, server.log[-3000:]
    plain, controlled, zero = _post(url), _post(url, [_unit(listed[0])]), _post(url, [_unit(listed[0], weight=0.0)])
    for answer in (plain, controlled, zero):
        assert answer.status_code == 200, answer.text
    base_px, ctrl_px, zero_px = (_pixels(r.json()["images"][0]) for r in (plain, controlled, zero))
    assert np.abs(ctrl_px - base_px).mean() > 2.0, np.abs(ctrl_px - base_px).mean()  # the control has teeth
    assert np.abs(zero_px - base_px).max() <= 1  # weight 0: the plain image (within one 8-bit level)
    assert f'ControlNet 0: "Module: canny, Model: {listed[0]}' in json.loads(controlled.json()["info"])["infotexts"][0]
    first, moved = (_post(url, [_unit(listed[0], module="none", image=_pattern(shifted))]) for shifted in (False, True))
    assert first.status_code == moved.status_code == 200, (first.text, moved.text)
    steered = np.abs(_pixels(moved.json()["images"][0]) - _pixels(first.json()["images"][0])).mean()
    print(f"\nFLUX.1 control image moved: {steered:.2f} mean levels")
    assert steered > 1.0  # the image follows its control image, not just the presence of a unit


def test_an_sd1_controlnet_on_flux_is_422_naming_the_model(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    answer = _post(url, [_unit("sd15_edges")])
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert "sd15_edges" in detail["msg"] and ".".join(detail["loc"][1:]).endswith(
        "alwayson_scripts.controlnet.args[0].model"), detail
