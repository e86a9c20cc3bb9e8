"""A1111's extras routes on the real app (issue 57 point 4), driven by webuiapi's own methods (webuiapi/webuiapi.py
``extra_single_image``, ``extra_batch_images``, ``interrogate``: their payloads and their response parsing), its
session forwarding to the app in this process.

The ESRGAN upscaler is a tiny RRDBNet written in torch (engines/build/esrgan.py), exported to ONNX and run by ONNX
Runtime's CPU provider (onnxruntime/core/providers/cpu) tile by tile (engines/pipelines/upscale.py): the served image
equals the torch network run on the whole image within 1/255. The resizers match PIL's resizes in A1111's steps
(modules/upscaler.py ``Upscaler.upscale``, scripts/postprocessing_upscale.py), and each signed upscale carries its
source image as the C2PA ``parentOf`` ingredient (server/provenance.py, read back with server/provenance_verify.py).
"""

from __future__ import annotations

import base64
import hashlib
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import webuiapi
from fastapi.testclient import TestClient
from PIL import Image

from engines.build.esrgan import RECEPTIVE_RADIUS, RRDBNet, export_rrdbnet, tiny_rrdbnet
from engines.engine import OrtEngine
from server.app import create_app
from server.provenance_verify import verify_bytes
from server.settings import ProvenanceSettings, load_settings
from tests.provenance_ca import SigningCredential, make_credential

MODEL = "4x-TinyESRGAN"
TILE = 16
"""Small tiles, so the test images span several in each direction."""


class InProcess(webuiapi.WebUIApi):
    """webuiapi's client without its connect-time probe of the extensions (a socket this test does not open)."""

    def check_extensions(self) -> None:
        pass


class Forward:
    """webuiapi's requests session, posting to the app in this process instead of a socket."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def post(self, url: str, json: dict[str, Any]) -> httpx.Response:
        return self.client.post(url.removeprefix("http://127.0.0.1:7860"), json=json)


@pytest.fixture(scope="module")
def credential() -> SigningCredential:
    return make_credential()


@pytest.fixture(scope="module")
def net() -> RRDBNet:
    return tiny_rrdbnet()


@pytest.fixture(scope="module")
def served(tiny_model: Path, net: RRDBNet, credential: SigningCredential,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, webuiapi.WebUIApi]]:
    folder = tmp_path_factory.mktemp("upscalers")
    export_rrdbnet(net, folder / f"{MODEL}.onnx")
    (folder / "notes.txt").write_text("not a model")
    key, chain, _ = credential.write(tmp_path_factory.mktemp("signer"))
    settings = load_settings("dev")
    runtime = settings.runtime.model_copy(update={"upscaler_dir": str(folder), "upscaler_tile": TILE,
                                                  "upscaler_tile_overlap": RECEPTIVE_RADIUS})
    settings = settings.model_copy(update={"runtime": runtime, "provenance": ProvenanceSettings(
        mode="require", key_file=str(key), chain_file=str(chain))})
    with TestClient(create_app(OrtEngine(tiny_model, settings.runtime), settings),
                    base_url="http://localhost") as client:
        deadline = time.monotonic() + 240
        while client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/ready").text
            time.sleep(0.05)
        api = InProcess(baseurl="http://127.0.0.1:7860/sdapi/v1")
        api.session = Forward(client)  # type: ignore[assignment]
        yield client, api


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour gradients with noise: something an upscaler has to work on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x / width, y / height, (x + y) / (width + height)], -1) * 200
    return Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8), "RGB")


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_listing_offers_the_resizers_and_the_folders_model(served: tuple[TestClient, Any]) -> None:
    listed = served[0].get("/sdapi/v1/upscalers").json()
    assert [u["name"] for u in listed] == ["None", "Lanczos", "Nearest", MODEL]
    assert listed[-1]["scale"] == 4.0 and listed[-1]["model_path"] == f"{MODEL}.onnx"


def test_lanczos_2x_is_a1111s_resize_with_its_infotext(served: tuple[TestClient, webuiapi.WebUIApi]) -> None:
    source = _picture(40, 30)
    result = served[1].extra_single_image(source, upscaler_1="Lanczos", upscaling_resize=2)
    # Upscaler.upscale: LANCZOS by the factor (80x60), then LANCZOS to the target rounded down to 8 (80x56)
    expected = source.resize((80, 60), Image.Resampling.LANCZOS).resize((80, 56), Image.Resampling.LANCZOS)
    assert result.image.size == (80, 56)
    assert np.array_equal(np.asarray(result.image.convert("RGB")), np.asarray(expected))
    assert result.info == "<p>Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos</p>"
    assert result.image.info["postprocessing"] == "Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos"


def test_the_onnx_esrgan_tiled_matches_the_torch_network(served: tuple[TestClient, webuiapi.WebUIApi],
                                                         net: RRDBNet) -> None:
    source = _picture(48, 40, seed=3)  # 3 x 3 tiles of 16 px
    result = served[1].extra_single_image(source, upscaler_1=MODEL, upscaling_resize=4)
    with torch.no_grad():
        pixels = torch.from_numpy(np.asarray(source).transpose(2, 0, 1)[None].astype(np.float32) / 255)
        reference = net(pixels).clamp(0, 1)[0].numpy().transpose(1, 2, 0) * 255
    served_pixels = np.asarray(result.image.convert("RGB")).astype(np.float32)
    assert served_pixels.shape == reference.shape == (160, 192, 3)
    assert np.abs(served_pixels - reference).max() <= 1.0
    assert reference.std() > 20  # not a flat image: the parity means something
    assert result.info == f"<p>Postprocess upscale by: 4.0, Postprocess upscaler: {MODEL}</p>"


def test_a_batch_scaled_to_a_size_and_cropped(served: tuple[TestClient, webuiapi.WebUIApi]) -> None:
    images = [_picture(32, 32, 1), _picture(40, 24, 2)]
    result = served[1].extra_batch_images(images, resize_mode=1, upscaling_resize_w=100, upscaling_resize_h=60,
                                          upscaling_crop=True, upscaler_1="Nearest")
    assert [im.size for im in result.images] == [(100, 60), (100, 60)]
    assert result.info == ("<p>Postprocess upscale to: 100x60, Postprocess crop to: 100x60, "
                           "Postprocess upscaler: Nearest</p>")


def test_the_second_upscaler_is_blended_at_its_visibility(served: tuple[TestClient, webuiapi.WebUIApi]) -> None:
    source = _picture(24, 24, 5)
    both = served[1].extra_single_image(source, upscaler_1="Lanczos", upscaler_2="Nearest",
                                        extras_upscaler_2_visibility=0.5, upscaling_resize=2)
    lanczos = source.resize((48, 48), Image.Resampling.LANCZOS)
    nearest = source.resize((48, 48), Image.Resampling.NEAREST)
    assert np.array_equal(np.asarray(both.image.convert("RGB")), np.asarray(Image.blend(lanczos, nearest, 0.5)))
    assert "Postprocess upscaler 2: Nearest" in both.info


def test_none_returns_the_image_unchanged(served: tuple[TestClient, webuiapi.WebUIApi]) -> None:
    source = _picture(20, 12, 6)
    result = served[1].extra_single_image(source)  # webuiapi's defaults: upscaler_1 "None"
    assert np.array_equal(np.asarray(result.image.convert("RGB")), np.asarray(source))
    assert result.info == "<p></p>"


def test_aiyabots_upscale_payload(served: tuple[TestClient, Any]) -> None:
    """Kilvoctu/aiyabot core/upscalecog.py ``dream``: a data-URL image, the factor, both upscalers and the face
    restorers at its defaults (0.0); its choices include A1111's model upscalers, refused by name."""
    image = "data:image/png;base64," + base64.b64encode(_png_bytes(_picture(24, 16, 8))).decode()
    payload = {"upscaling_resize": 2.0, "upscaler_1": "Lanczos", "image": image, "gfpgan_visibility": 0.0,
               "codeformer_visibility": 0.0, "upscale_first": False, "upscaler_2": "None",
               "extras_upscaler_2_visibility": 0.5}
    reply = served[0].post("/sdapi/v1/extra-single-image", json=payload)
    assert reply.status_code == 200, reply.text
    assert Image.open(io.BytesIO(base64.b64decode(reply.json()["image"]))).size == (48, 32)
    refused = served[0].post("/sdapi/v1/extra-single-image", json={**payload, "upscaler_1": "ESRGAN_4x"})
    assert refused.status_code == 422
    assert "upscaler_dir" in refused.json()["detail"][0]["msg"]


def test_a_second_upscale_while_one_runs_is_a_429(served: tuple[TestClient, Any]) -> None:
    """One upscale at a time per process: another is refused at once with Retry-After, never queued on a thread."""
    from server.routes import a1111_extras

    body = {"image": base64.b64encode(_png_bytes(_picture(8, 8))).decode(), "upscaler_1": "Nearest"}
    assert a1111_extras._busy.acquire(blocking=False)  # an upscale in flight
    try:
        reply = served[0].post("/sdapi/v1/extra-single-image", json=body)
    finally:
        a1111_extras._busy.release()
    assert reply.status_code == 429 and reply.headers["retry-after"] == "2"
    assert "one at a time" in reply.json()["error"]["message"]
    assert served[0].post("/sdapi/v1/extra-single-image", json=body).status_code == 200


def test_an_upscale_is_signed_with_its_source_as_ingredient(served: tuple[TestClient, Any],
                                                             credential: SigningCredential) -> None:
    source = _png_bytes(_picture(16, 16, 7))
    reply = served[0].post("/sdapi/v1/extra-single-image", json={
        "image": base64.b64encode(source).decode(), "upscaler_1": "Nearest", "upscaling_resize": 2})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-sdserve-provenance"] == "c2pa"
    checked = verify_bytes(base64.b64decode(reply.json()["image"]), credential.ca_pem.decode())
    assert checked.verdict == "trusted", checked.problems
    assert checked.ingredients == [{"title": "image", "format": "image/png", "relationship": "parentOf",
                                    "sha256": hashlib.sha256(source).hexdigest()}]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"gfpgan_visibility": 0.5}, "gfpgan_visibility", "GFPGAN"),
    ({"codeformer_visibility": 1}, "codeformer_visibility", "CodeFormer"),
    ({"upscaler_1": "R-ESRGAN 4x+"}, "upscaler_1", MODEL),
    ({"upscaler_1": "Lanczos", "upscaler_2": "SwinIR_4x", "extras_upscaler_2_visibility": 1}, "upscaler_2",
     "not an upscaler"),
    ({"upscaler_1": "Lanczos", "upscaling_resize": 64}, "upscaling_resize", "max_request_pixels"),
    ({"upscaler_1": MODEL, "upscaling_resize": 40}, "upscaling_resize", "max_request_pixels"),
    ({"image": base64.b64encode(b"not an image").decode()}, "image", "not an image"),
    ({"image": ""}, "image", "required"),
    ({"image": "bomb"}, "image", "over this server's limit"),
])
def test_refusals_name_the_field(served: tuple[TestClient, Any], fields: dict[str, Any], param: str,
                                 words: str) -> None:
    if fields.get("image") == "bomb":  # 4100 x 4100 declared, over limits.max_image_pixels (16 Mi pixels)
        fields = {"image": base64.b64encode(_png_bytes(Image.new("L", (4100, 4100)))).decode()}
    body = {"image": base64.b64encode(_png_bytes(_picture(160, 160))).decode(), **fields}
    reply = served[0].post("/sdapi/v1/extra-single-image", json=body)
    assert reply.status_code == 422, reply.text
    detail = reply.json()["detail"][0]
    assert detail["loc"] == ["body", param] and words in detail["msg"]


def test_a_batch_image_that_is_not_one_is_named_by_its_index(served: tuple[TestClient, Any]) -> None:
    good = base64.b64encode(_png_bytes(_picture(8, 8))).decode()
    reply = served[0].post("/sdapi/v1/extra-batch-images", json={
        "upscaler_1": "Nearest", "imageList": [{"data": good, "name": "a"}, {"data": "@@", "name": "b"}]})
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"] == ["body", "imageList", "1", "data"]


def test_interrogate_is_a_501_naming_the_missing_model(served: tuple[TestClient, webuiapi.WebUIApi]) -> None:
    with pytest.raises(RuntimeError) as raised:
        served[1].interrogate(_picture(16, 16))
    status, text = raised.value.args
    assert status == 501 and "CLIP interrogator model" in text
    tagger = served[0].post("/sdapi/v1/interrogate", json={"image": "", "model": "deepdanbooru"})
    assert tagger.status_code == 501 and "DeepDanbooru" in tagger.json()["detail"]
    unknown = served[0].post("/sdapi/v1/interrogate", json={"image": "", "model": "blip2"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "model"]
