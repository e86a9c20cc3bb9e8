"""``alwayson_scripts.controlnet`` units parsed as sd-webui-controlnet's external_code.py to_processing_unit does,
the ControlNet library's names, the preprocessors (canny through OpenCV's cv2.Canny) and the /controlnet routes
(server/controlnet.py, server/routes/controlnet.py)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from engines.errors import InvalidRequestError
from server import errors
from server.controlnet import ControlNetLibrary, parse_units, preprocess
from server.routes import controlnet as routes

W = H = 64
MAX_PIXELS = 1 << 20


def _b64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _square(size: int = 64) -> np.ndarray:
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = 255
    return image


@pytest.fixture
def library(tmp_path: Path) -> ControlNetLibrary:
    for name, body in (("canny_tiny", b"onnx-a"), ("depth_tiny", b"onnx-b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(body)
        (tmp_path / name / "config.json").write_text(json.dumps({"_class_name": "ControlNetModel"}))
    (tmp_path / "no_config").mkdir()
    (tmp_path / "no_config" / "model.onnx").write_bytes(b"x")
    return ControlNetLibrary(tmp_path, unit_count=2)


def test_library_lists_name_and_hash8(library: ControlNetLibrary) -> None:
    titles = library.titles()
    assert [t.split(" [")[0] for t in titles] == ["canny_tiny", "depth_tiny"]
    assert all(len(t.split(" [")[1]) == 9 for t in titles)  # 8 hex digits and the bracket
    assert library.resolve(titles[0], "m").name == "canny_tiny"
    assert library.resolve("depth_tiny", "m").name == "depth_tiny"
    with pytest.raises(InvalidRequestError, match="canny_tiny") as raised:
        library.resolve("canny_tiny [00000000]", "f.model")
    assert raised.value.param == "f.model"


def test_units_parse_with_legacy_keys_names_and_numbers(library: ControlNetLibrary) -> None:
    args = [{"input_image": _b64(_square(32)), "module": "invert", "model": library.titles()[1], "weight": 0.5,
             "resize_mode": 0, "guidance": 0.6, "control_mode": "Balanced"},
            {"enabled": False, "image": _b64(_square()), "model": "nothing"},
            {"image": _b64(_square()), "module": "canny", "model": "canny_tiny", "resize_mode": "Crop and Resize",
             "threshold_a": 50, "threshold_b": 150, "guidance_start": 0.1, "pixel_perfect": True}]
    units = parse_units({"args": args}, library, W, H, MAX_PIXELS)
    assert len(units) == 2  # the disabled unit is left out
    first, second = units[0].unit, units[1].unit
    assert (first.model, first.weight, first.guidance_end) == ("depth_tiny", 0.5, 0.6)
    assert first.image.shape == (H, W, 3) and first.image[0, 0].tolist() == [255, 255, 255]  # inverted, resized
    assert second.guidance_start == 0.1 and set(np.unique(second.image)) <= {0, 255}  # canny edges
    assert 0 < (second.image > 0).mean() < 0.2
    assert units[0].infotext.startswith('ControlNet 0: "Module: invert, Model: depth_tiny [')
    assert "Resize Mode: Crop and Resize" in units[1].infotext and "Pixel Perfect: True" in units[1].infotext


@pytest.mark.parametrize(("unit", "field", "words"), [
    ({"module": "lineart"}, "[0].module", "lineart"),
    ({"model": "openpose"}, "[0].model", "canny_tiny"),
    ({"control_mode": 2}, "[0].control_mode", "ControlNet is more important"),
    ({"resize_mode": "Stretch"}, "[0].resize_mode", "Stretch"),
    ({"mask": "abc"}, "[0].mask", "mask"),
    ({"weight": "x"}, "[0].weight", "number"),
    ({"guidance_start": 0.8, "guidance_end": 0.2}, "[0].guidance_start", "start"),
])
def test_bad_units_are_refused_naming_the_field(library: ControlNetLibrary, unit: dict[str, object], field: str,
                                                words: str) -> None:
    base = {"image": _b64(_square()), "module": "none", "model": "canny_tiny"}
    with pytest.raises(InvalidRequestError, match=words) as raised:
        parse_units({"args": [{**base, **unit}]}, library, W, H, MAX_PIXELS)
    assert raised.value.param == "alwayson_scripts.controlnet.args" + field


def test_more_units_than_the_count_and_no_library_are_refused(library: ControlNetLibrary) -> None:
    unit = {"image": _b64(_square()), "model": "canny_tiny"}
    with pytest.raises(InvalidRequestError, match="control_net_unit_count 2"):
        parse_units({"args": [unit] * 3}, library, W, H, MAX_PIXELS)
    with pytest.raises(InvalidRequestError, match="no ControlNet folder"):
        parse_units({"args": [unit]}, None, W, H, MAX_PIXELS)


def test_canny_finds_the_square_edges() -> None:
    edges = preprocess("canny", _square(), 64, 100, 200, "f")
    assert edges.shape == (64, 64, 3)
    assert edges[32, 16].max() == 255 or edges[32, 15].max() == 255  # the square's left border
    assert edges[32, 32].max() == 0 and edges[2, 2].max() == 0


def test_routes(library: ControlNetLibrary) -> None:
    app = FastAPI()
    errors.install(app)
    app.include_router(routes.router)
    app.state.controlnets = library
    client = TestClient(app)
    assert client.get("/controlnet/version").json() == {"version": 2}
    assert client.get("/controlnet/model_list").json() == {"model_list": library.titles()}
    modules = client.get("/controlnet/module_list").json()
    assert modules["module_list"][:3] == ["none", "canny", "invert"] and "sliders" in modules["module_detail"]["canny"]
    assert client.get("/controlnet/settings").json() == {"control_net_unit_count": 2}
    found = client.post("/controlnet/detect", json={"controlnet_module": "invert",
                                                    "controlnet_input_images": [_b64(_square())]})
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(found.json()["images"][0]))))
    assert image[0, 0].tolist() == [255, 255, 255] and image[32, 32].tolist() == [0, 0, 0]
    refused = client.post("/controlnet/detect", json={"controlnet_module": "depth",
                                                      "controlnet_input_images": [_b64(_square())]})
    assert refused.status_code == 422 and "depth" in refused.text and "controlnet_module" in refused.text


def test_a_units_preprocessor_gives_the_union_control_type() -> None:
    """InstantX FLUX.1 Union's types (canny 0, tile 1, depth 2, blur 3, pose 4) from A1111's module names; none for a
    module no type fits (the union ControlNet's first, canny)."""
    from server.controlnet import union_mode

    assert [union_mode(m) for m in ("canny", "tile_resample", "depth_midas", "depth_anything", "blur_gaussian",
                                    "openpose_full", "dw_openpose_full", "invert", "none")] == \
        [0, 1, 2, 2, 3, 4, 4, None, None]
