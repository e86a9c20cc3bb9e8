"""The ControlNet preprocessors of server/controlnet_modules.py against sd-webui-controlnet's definitions (its
``scripts/processor.py``: threshold, scribble_xdog, lineart_standard, blur_gaussian, tile_resample, the 64-multiple
``resize_image_with_pad``), the ONNX annotator files run on ONNX Runtime's CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession), and the pieces of server/controlnet.py the
routes share: the served filter, the OpenAI field, script-info and the provenance ingredients."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from PIL import Image

from engines.errors import InvalidRequestError
from server.controlnet import (
    ControlNetLibrary,
    openai_units,
    parse_units,
    record_control,
    script_info,
    served_names,
)
from server.controlnet_modules import detail, preprocess, resize_with_pad, with_defaults


def _square(size: int = 64, value: int = 255) -> np.ndarray:
    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4: 3 * size // 4, size // 4: 3 * size // 4] = value
    return image


def _b64(image: np.ndarray) -> tuple[str, bytes]:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode(), buf.getvalue()


def _mean_graph(path: Path) -> None:
    """A tiny annotator: the mean over the three channels, [1, 3, H, W] -> [1, 1, H, W]."""
    node = helper.make_node("ReduceMean", ["image"], ["map"], axes=[1], keepdims=1)
    graph = helper.make_graph([node], "mean", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                             [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("map", TensorProto.FLOAT, [1, 1, "h", "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # loadable by every ONNX Runtime this project supports
    onnx.save(model, path)


@pytest.fixture
def library(tmp_path: Path) -> ControlNetLibrary:
    for name in ("edges", "refused"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx").write_bytes(name.encode())
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "annotators").mkdir()
    _mean_graph(tmp_path / "annotators" / "depth_midas.onnx")
    _mean_graph(tmp_path / "annotators" / "lineart_realistic.onnx")
    (tmp_path / "annotators" / "openpose.onnx").write_bytes(b"not an onnx file")
    (tmp_path / "annotators" / "not_a_module.onnx").write_bytes(b"x")
    return ControlNetLibrary(tmp_path, unit_count=2)


def test_resize_with_pad_pads_to_64_and_unpads() -> None:
    image = np.arange(50 * 70 * 3, dtype=np.uint8).reshape(50, 70, 3)
    padded, unpad = resize_with_pad(image, 100)
    assert padded.shape == (128, 192, 3)  # short side 100 (cubic up), 140 wide, both padded to multiples of 64
    assert unpad(padded).shape == (100, 140, 3)
    assert (padded[100:, :140] == padded[99:100, :140]).all()  # edge replication


def test_threshold_is_binary_on_the_darkest_channel() -> None:
    image = _square(value=200)
    image[0, 0] = (250, 250, 100)  # its darkest channel is below the threshold
    out = preprocess("threshold", image, 64, 150, 0, "f")
    assert out.shape == (64, 64, 3) and set(np.unique(out)) == {0, 255}
    assert out[32, 32].tolist() == [255] * 3 and out[0, 0].tolist() == [0] * 3
    assert preprocess("threshold", image, 64, 210, 0, "f").max() == 0  # above the square's value: all black


def test_scribble_xdog_finds_edges_and_its_threshold_thins_them() -> None:
    low = preprocess("scribble_xdog", _square(), 64, 4, 0, "f")
    high = preprocess("scribble_xdog", _square(), 64, 64, 0, "f")
    assert set(np.unique(low)) <= {0, 255} and 0 < (low > 0).mean() < 0.6
    assert (high > 0).sum() < (low > 0).sum()
    assert low[2, 2].max() == 0 and low[32, 32].max() == 0  # flat areas have no lines


def test_lineart_standard_marks_the_dark_side_of_edges() -> None:
    out = preprocess("lineart_standard", 255 - _square(), 64, 0, 0, "f")  # a dark square on white
    assert out.shape == (64, 64, 3) and out[32, 16].max() > 100 and out[2, 2].max() == 0


def test_blur_gaussian_and_tile_resample() -> None:
    blurred = preprocess("blur_gaussian", _square(), 64, 4.0, 0, "f")
    assert 0 < blurred[32, 16, 0] < 255 and abs(float(blurred.mean()) - float(_square().mean())) < 4
    with pytest.raises(InvalidRequestError) as refused:
        preprocess("blur_gaussian", _square(), 64, 0, 0, "u")
    assert refused.value.param == "u.threshold_a"
    assert preprocess("tile_resample", _square(), 512, 2.0, 0, "f").shape == (32, 32, 3)
    assert preprocess("tile_resample", _square(), 512, 1.0, 0, "f").shape == (64, 64, 3)  # < 1.1: unchanged


def test_negative_parameters_take_the_module_defaults() -> None:
    assert with_defaults("threshold", -1, -1, -1) == (512, 127, 0)
    assert with_defaults("canny", 256, -1, -1) == (256, 100, 200)
    assert with_defaults("tile_resample", -1, -1, -1) == (512, 1.0, 0)
    assert with_defaults("blur_gaussian", -1, 3.0, -1) == (512, 3.0, 0)


def test_annotator_files_run_and_absent_ones_are_refused_by_name(library: ControlNetLibrary) -> None:
    modules = detail(library.annotators)
    assert "depth_midas" in modules and "lineart_realistic" in modules and "not_a_module" not in modules
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, 32:] = 90
    depth = preprocess("depth_midas", image, 64, 0, 0, "u", library.annotators)
    assert depth[0, 0].tolist() == [0] * 3 and depth[0, 63].tolist() == [255] * 3  # scaled min..max
    lines = preprocess("lineart_realistic", image, 64, 0, 0, "u", library.annotators)
    assert lines[0, 0].tolist() == [255] * 3 and lines[0, 63].tolist() == [165] * 3  # 255 - mean, inverted
    with pytest.raises(InvalidRequestError, match="annotators/depth_zoe.onnx") as absent:
        preprocess("depth_zoe", image, 64, 0, 0, "u", library.annotators)
    assert absent.value.param == "u.module" and "depth_midas" in str(absent.value)
    with pytest.raises(InvalidRequestError, match="openpose.*refused") as bad:
        preprocess("openpose", image, 64, 0, 0, "u", library.annotators)
    assert bad.value.param == "u.module" and str(library.folder) not in str(bad.value)  # no server path
    assert "openpose" not in detail(library.annotators)  # a refused file is no longer offered


def test_units_refuse_a_module_without_its_file_naming_the_field(library: ControlNetLibrary) -> None:
    text, _ = _b64(_square())
    unit = {"image": text, "module": "depth_zoe", "model": "edges"}
    with pytest.raises(InvalidRequestError, match="depth_midas") as raised:
        parse_units({"args": [unit]}, library, 64, 64, 1 << 20)
    assert raised.value.param == "alwayson_scripts.controlnet.args[0].module"
    parsed = parse_units({"args": [{**unit, "module": "depth_midas"}]}, library, 64, 64, 1 << 20)
    assert parsed[0].unit.image.shape == (64, 64, 3) and "Module: depth_midas" in parsed[0].infotext


def test_the_served_filter_hides_a_file_the_engine_refused(library: ControlNetLibrary) -> None:
    engine = SimpleNamespace(capabilities=lambda: SimpleNamespace(sessions={
        "unet": 0, "controlnet_edges@64x64": 0, "controlnet_sum": 0}, self_test=None))
    served = served_names(engine)
    assert served is not None and "edges" in served and "refused" not in served
    assert [t.split(" [")[0] for t in library.titles(served)] == ["edges"]
    assert served_names(None) is None and len(library.titles()) == 2
    text, _ = _b64(_square())
    with pytest.raises(InvalidRequestError, match="edges \\[") as raised:
        parse_units({"args": [{"image": text, "model": "refused"}]}, library, 64, 64, 1 << 20, served)
    assert raised.value.param == "alwayson_scripts.controlnet.args[0].model"


def test_openai_field_and_its_errors(library: ControlNetLibrary) -> None:
    text, data = _b64(_square())
    units = [{"image": f"data:image/png;base64,{text}", "model": "edges", "module": "invert"}]
    assert openai_units(json.dumps(units)) == {"args": units}
    for bad in ("{not json", json.dumps({"image": text})):
        with pytest.raises(InvalidRequestError) as raised:
            openai_units(bad)
        assert raised.value.param == "controlnet"
    parsed = parse_units(openai_units(units), library, 64, 64, 1 << 20, base="controlnet")
    assert parsed[0].ingredient["sha256"] == hashlib.sha256(data).hexdigest()
    assert parsed[0].ingredient["relationship"] == "inputTo"
    assert parsed[0].ingredient["controlnet"]["sha256"] == hashlib.sha256(b"edges").hexdigest()
    with pytest.raises(InvalidRequestError, match="control_net_unit_count 2") as over:
        parse_units(openai_units(units * 3), library, 64, 64, 1 << 20, base="controlnet")
    assert over.value.param == "controlnet"
    request = SimpleNamespace(state=SimpleNamespace(provenance_inputs=[[{"title": "init_images.0"}], [{"title":
                                                                                                        "x"}]]))
    record_control(request, parsed)
    assert [[i["title"] for i in inputs] for inputs in request.state.provenance_inputs] == [
        ["init_images.0", "controlnet[0].image"], ["x", "controlnet[0].image"]]


def test_script_info_lists_one_argument_per_unit() -> None:
    info = script_info(3)
    assert [(s["name"], s["is_alwayson"], s["is_img2img"]) for s in info] == [("controlnet", True, False),
                                                                            ("controlnet", True, True)]
    assert [a["label"] for a in info[0]["args"]] == ["ControlNet Unit 0", "ControlNet Unit 1", "ControlNet Unit 2"]


def test_detect_takes_webuiapis_field_and_names_this_routes_fields(library: ControlNetLibrary) -> None:
    """webuiapi's ``controlnet_detect`` sends ``controlnet_images`` (data URLs); sd-webui-controlnet's own field is
    ``controlnet_input_images``. Both are served; the refusals name the route's own fields."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server import errors
    from server.routes import controlnet as routes

    app = FastAPI()
    errors.install(app)
    app.include_router(routes.router)
    app.state.controlnets = library
    client = TestClient(app)
    text, _ = _b64(_square())
    found = client.post("/controlnet/detect", json={"controlnet_module": "threshold", "controlnet_processor_res": 64,
                                                    "controlnet_images": [f"data:image/png;base64,{text}"],
                                                    "controlnet_threshold_a": -1})
    assert found.status_code == 200, found.text
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(found.json()["images"][0]))))
    assert image[32, 32].tolist() == [255] * 3 and image[2, 2].tolist() == [0] * 3  # default threshold 127
    blur = client.post("/controlnet/detect", json={"controlnet_module": "blur_gaussian", "controlnet_threshold_a": 0,
                                                   "controlnet_input_images": [text]})
    assert blur.status_code == 422 and blur.json()["detail"][0]["loc"][-1] == "controlnet_threshold_a", blur.text
    none = client.post("/controlnet/detect", json={"controlnet_module": "none"})
    assert none.status_code == 422 and "controlnet_input_images" in none.text
    assert client.get("/controlnet/module_list").json()["module_detail"]["depth_midas"]["sliders"][0]["value"] == 512


def test_legacy_names_and_display_labels_reach_the_modules(library: ControlNetLibrary) -> None:
    """sd-webui-controlnet's ``module_list?alias_names=true`` labels and its pre-1.1 names (``depth``) are taken by
    units and by detect, and the infotext names the module as this server does."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from server.routes import controlnet as routes

    app = FastAPI()
    app.include_router(routes.router)
    app.state.controlnets = library
    labels = TestClient(app).get("/controlnet/module_list", params={"alias_names": "true"}).json()["module_list"]
    assert "invert (from white bg & black line)" in labels and "invert" not in labels and "depth_midas" in labels
    text, _ = _b64(_square())
    units = parse_units({"args": [{"image": text, "model": "edges", "module": "invert (from white bg & black line)"},
                                  {"image": text, "model": "edges", "module": "depth"}]}, library, 64, 64, 1 << 20)
    assert units[0].unit.image[0, 0].tolist() == [255] * 3 and "Module: invert," in units[0].infotext
    assert "Module: depth_midas," in units[1].infotext


def test_the_served_names_are_read_once_per_engine_once_its_self_test_ran() -> None:
    """server/controlnet.py ``served_names``: ControlNets attach at load only and the self-test's ControlNet canary
    may refuse some, so once the self-test ran the capability snapshot is not rebuilt per request; before, it is
    read again (a net the canary refuses leaves the listing)."""
    class Engine:
        def __init__(self) -> None:
            self.reads, self.sessions, self.report = 0, {"unet": 0}, None

        def capabilities(self) -> SimpleNamespace:
            self.reads += 1
            return SimpleNamespace(sessions=dict(self.sessions), self_test=self.report)

    engine = Engine()
    assert served_names(engine) == set() and served_names(engine) == set() and engine.reads == 2
    engine.sessions.update(controlnet_edges=0, controlnet_broken=0)
    assert served_names(engine) == {"edges", "broken"} and engine.reads == 3  # loaded, the canary not run yet
    del engine.sessions["controlnet_broken"]
    engine.report = "passed"
    assert [served_names(engine) for _ in range(3)] == [{"edges"}] * 3 and engine.reads == 4
