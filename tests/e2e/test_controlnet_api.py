"""ControlNet beyond the A1111 units, on a real `sdserve serve --profile dev --controlnet-dir` that signs its images
(require mode): the OpenAI routes' ``controlnet`` field on /v1/images/generations (JSON) and /v1/images/edits
(multipart, the openai client's ``extra_body``), the control image recorded as a C2PA ingredient with the
ControlNet's hash in the signed manifest, an annotator file of the folder (``annotators/depth_midas.onnx``) served
as a module by /controlnet/module_list, /controlnet/detect (also as webuiapi's controlnet_detect calls it) and a
unit, and the refusals naming the field. The
annotator, the residual UNet and the ControlNet run on ONNX Runtime's CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import openai
import pytest
import webuiapi
from onnx import TensorProto, helper
from PIL import Image

from server.provenance_verify import verify_bytes
from tests.e2e.conftest import ServerProcess, controlnet_copy
from tests.provenance_ca import SigningCredential

pytestmark = pytest.mark.slow
BASE = {"prompt": "a lighthouse at dusk", "steps": 3, "seed": 21, "size": "64x64", "response_format": "b64_json"}


def _annotator(path: Path) -> None:
    """A tiny depth annotator: the mean of the three channels ([1, 3, H, W] -> [1, 1, H, W])."""
    node = helper.make_node("ReduceMean", ["image"], ["depth"], axes=[1], keepdims=1)
    graph = helper.make_graph([node], "depth", [helper.make_tensor_value_info("image", TensorProto.FLOAT,
                                                                              [1, 3, "h", "w"])],
                              [helper.make_tensor_value_info("depth", TensorProto.FLOAT, [1, 1, "h", "w"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)


@pytest.fixture(scope="module")
def built(controlnet_tiny: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny model with unet_controlnet/, ControlNet folder with edges/ and annotators/depth_midas.onnx): this
    module's copy of the session's `engines tiny --controlnet` build (tests/e2e/conftest.py)."""
    model, library = controlnet_copy(controlnet_tiny, tmp_path_factory.mktemp("controlnet-api"))
    _annotator(library / "annotators" / "depth_midas.onnx")
    return model, library


@pytest.fixture(scope="module")
def server(built: tuple[Path, Path], credential: SigningCredential,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model, library = built
    env = credential.require_env(tmp_path_factory.mktemp("secret"))
    process = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library), env=env)
    try:
        process.wait_ready(timeout=300)
        yield process
    finally:
        assert process.stop() == 0, process.log


def _png() -> bytes:
    image = np.zeros((64, 64, 3), np.uint8)
    image[16:48, 16:48] = 255
    image[28:36, :] = 128
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def _unit(url: str, **extra: Any) -> dict[str, Any]:
    title = httpx.get(f"{url}/controlnet/model_list").json()["model_list"][0]
    return {"image": "data:image/png;base64," + base64.b64encode(_png()).decode(), "model": title,
            "module": "canny", "threshold_a": 100, "threshold_b": 200, **extra}


def _generate(url: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={**BASE, **extra}, timeout=120)


def test_openai_generations_take_units_and_sign_the_control_image(server: ServerProcess, built: tuple[Path, Path],
                                                                  credential: SigningCredential) -> None:
    url = server.url
    assert url is not None
    plain, controlled = _generate(url), _generate(url, controlnet=[_unit(url)])
    zero = _generate(url, controlnet=[_unit(url, weight=0.0)])
    assert plain.status_code == controlled.status_code == zero.status_code == 200, server.log[-4000:]
    images = [base64.b64decode(r.json()["data"][0]["b64_json"]) for r in (plain, controlled, zero)]
    assert np.abs(_pixels(images[1]) - _pixels(images[0])).mean() > 2.0  # the control has teeth
    assert np.abs(_pixels(images[2]) - _pixels(images[0])).max() <= 1  # weight 0: the plain image
    verified = verify_bytes(images[1], credential.ca_pem.decode())
    assert verified.verdict == "trusted", verified.problems
    assert verified.ingredients == [{"title": "controlnet[0].image", "format": "image/png",
                                     "relationship": "inputTo", "sha256": hashlib.sha256(_png()).hexdigest()}]
    assert verified.generation is not None
    net = verified.generation["ingredients"][0]["controlnet"]  # sdserve's assertion: which ControlNet, its hash
    onnx_sha = hashlib.sha256((built[1] / "edges" / "model.onnx").read_bytes()).hexdigest()
    assert net == {"unit": 0, "model": "edges", "sha256": onnx_sha, "module": "canny"}
    assert verify_bytes(images[0], credential.ca_pem.decode()).ingredients == []  # no control: no ingredient


def test_openai_edits_take_units_as_json_text(server: ServerProcess, credential: SigningCredential) -> None:
    url = server.url
    assert url is not None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="not-needed", max_retries=0)
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), (40, 90, 160)).save(buffer, format="PNG")
    init = buffer.getvalue()
    result = client.images.edit(image=("a.png", init, "image/png"), prompt="a hat", size="64x64",
                                response_format="b64_json",
                                extra_body={"steps": 2, "seed": 5, "controlnet": json.dumps([_unit(url)])})
    assert result.data and result.data[0].b64_json
    verified = verify_bytes(base64.b64decode(result.data[0].b64_json), credential.ca_pem.decode())
    assert verified.verdict == "trusted", verified.problems
    assert [(i["title"], i["relationship"]) for i in verified.ingredients] == [
        ("image", "parentOf"), ("controlnet[0].image", "inputTo")]
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("a.png", init, "image/png"), prompt="a hat", size="64x64",
                           extra_body={"steps": 2, "controlnet": "[{not json"})
    assert refused.value.param == "controlnet"


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"model": "missing"}, "controlnet[0].model", "edges ["),
    ({"module": "openpose"}, "controlnet[0].module", "annotators/openpose.onnx"),
    ({"weight": "heavy"}, "controlnet[0].weight", "number"),
])
def test_openai_bad_units_name_the_field(server: ServerProcess, extra: dict[str, Any], param: str,
                                         fragment: str) -> None:
    url = server.url
    assert url is not None
    answer = _generate(url, controlnet=[_unit(url, **extra)])
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    over = _generate(url, controlnet=[_unit(url)] * 4)  # over control_net_unit_count (3)
    assert over.status_code == 400 and over.json()["error"]["param"] == "controlnet"
    assert "control_net_unit_count" in over.json()["error"]["message"]


def test_annotator_file_is_a_module(server: ServerProcess) -> None:
    url = server.url
    assert url is not None
    modules = httpx.get(f"{url}/controlnet/module_list").json()
    assert {"threshold", "scribble_xdog", "tile_resample", "blur_gaussian", "depth_midas"} <= set(
        modules["module_list"])
    assert "openpose" not in modules["module_list"]  # no file for it
    detected = httpx.post(f"{url}/controlnet/detect", json={
        "controlnet_module": "depth_midas", "controlnet_input_images": [base64.b64encode(_png()).decode()],
        "controlnet_processor_res": 64}, timeout=60)
    assert detected.status_code == 200, detected.text
    depth = _pixels(base64.b64decode(detected.json()["images"][0]))
    assert depth.shape == (64, 64, 3) and depth.min() == 0 and depth.max() == 255  # scaled min..max
    body = {"prompt": "a lighthouse", "steps": 3, "seed": 21, "width": 64, "height": 64, "sampler_name": "Euler",
            "alwayson_scripts": {"controlnet": {"args": [_unit(url, module="depth_midas", processor_res=64)]}}}
    answer = httpx.post(f"{url}/sdapi/v1/txt2img", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert 'ControlNet 0: "Module: depth_midas' in json.loads(answer.json()["info"])["infotexts"][0]
    host, port = url.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port))  # its detect sends controlnet_images as data URLs
    replayed = api.controlnet_detect([Image.open(io.BytesIO(_png()))], module="depth_midas", processor_res=64)
    assert len(replayed.images) == 1  # decoded by webuiapi into PIL images
    assert (np.asarray(replayed.image.convert("RGB")).astype(np.int16) == depth).all()
    assert "depth_midas" in api.controlnet_module_list()
    refused = httpx.post(f"{url}/controlnet/detect", json={
        "controlnet_module": "lineart_realistic", "controlnet_input_images": [base64.b64encode(_png()).decode()]})
    assert refused.status_code == 422 and "depth_midas" in refused.text and "controlnet_module" in refused.text
