"""Edits against a real `sdserve serve`: the openai SDK's images.edit (with and without a mask) and
create_variation, Open WebUI's and LibreChat's multipart edits replayed, webuiapi's img2img and inpainting, and
hostile uploads through the HTTP stack (4xx naming the problem, never a 500)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
import webuiapi
from PIL import Image

from tests.unit.test_images_in import bomb, gradient, png

SIZE = 64


def picture() -> Image.Image:
    return gradient("RGB", (SIZE, SIZE))


def transparent_left(image: Image.Image) -> Image.Image:
    """OpenAI's mask: the left half transparent (edit there), the right half opaque (keep)."""
    rgba = image.convert("RGBA")
    alpha = np.full((SIZE, SIZE), 255, np.uint8)
    alpha[:, : SIZE // 2] = 0
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def _image(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


@pytest.fixture(scope="module")
def client(dev_server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{dev_server}/v1", api_key="not-needed", max_retries=0)


@pytest.fixture
def http(dev_server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dev_server, timeout=60) as c:
        yield c


def test_openai_edit_with_a_mask_repaints_only_the_transparent_area(client: openai.OpenAI) -> None:
    raw = client.images.with_raw_response.edit(
        image=("in.png", png(picture()), "image/png"), mask=("mask.png", png(transparent_left(picture())), "image/png"),
        prompt="a red balloon", n=2, size="64x64", response_format="b64_json", extra_body={"steps": 4, "seed": 7})
    assert raw.headers["x-sdserve-mode"] == "inpaint" and raw.headers["x-sdserve-strength"] == "1"
    result = raw.parse()
    assert len(result.data) == 2
    original = np.asarray(picture())
    for item in result.data:
        out = _image(item.b64_json)
        assert out.shape == (SIZE, SIZE, 3)
        assert np.array_equal(out[:, SIZE // 2:], original[:, SIZE // 2:])  # kept exactly (the paste-back)
        assert np.abs(out[:, : SIZE // 2].astype(int) - original[:, : SIZE // 2]).mean() > 5


def test_openai_edit_without_a_mask_is_img2img(client: openai.OpenAI) -> None:
    raw = client.images.with_raw_response.edit(image=("in.png", png(picture()), "image/png"), prompt="an oil painting",
                                               size="64x64", extra_body={"steps": 8, "seed": 3, "strength": 0.5})
    assert raw.headers["x-sdserve-mode"] == "img2img" and raw.headers["x-sdserve-strength"] == "0.5"
    assert _image(raw.parse().data[0].b64_json).shape == (SIZE, SIZE, 3)


def test_openai_variation_is_img2img_with_the_stated_strength(client: openai.OpenAI) -> None:
    raw = client.images.with_raw_response.create_variation(image=("in.png", png(picture()), "image/png"),
                                                           size="64x64", n=1)
    assert raw.headers["x-sdserve-mode"] == "img2img" and raw.headers["x-sdserve-strength"] == "0.7"
    assert _image(raw.parse().data[0].b64_json).shape == (SIZE, SIZE, 3)


def test_open_webui_edit_replay(http: httpx.Client) -> None:
    """Open WebUI posts the image as ``image[]`` with model, prompt, n and size form fields."""
    r = http.post("/v1/images/edits", files=[("image[]", ("image.png", png(picture()), "image/png"))],
                  data={"model": "gpt-image-1", "prompt": "make it night", "n": "1", "size": "64x64"})
    assert r.status_code == 200, r.text
    assert _image(r.json()["data"][0]["b64_json"]).shape == (SIZE, SIZE, 3)


def test_librechat_style_edit(http: httpx.Client) -> None:
    """gpt-image edit tools send image + mask with quality, background, output_format and input_fidelity."""
    r = http.post("/v1/images/edits", files=[("image", ("a.png", png(picture()), "image/png")),
                                             ("mask", ("m.png", png(transparent_left(picture())), "image/png"))],
                  data={"prompt": "a cat", "size": "64x64", "quality": "auto", "background": "auto",
                        "output_format": "webp", "input_fidelity": "high", "n": "1"})
    assert r.status_code == 200, r.text
    assert r.headers["x-sdserve-mode"] == "inpaint" and r.json()["output_format"] == "webp"
    assert "input_fidelity" in r.headers["x-sdserve-ignored-fields"]
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).format == "WEBP"


@pytest.mark.parametrize(("files", "data", "status", "named"), [
    ([("image", ("b.png", bomb(100_000, 100_000), "image/png"))], {}, 400, "over this server's limit"),
    ([("image", ("t.png", png(picture())[:80], "image/png"))], {}, 400, "truncated or corrupt"),
    ([("image", ("x.txt", b"hello, not an image", "text/plain"))], {}, 400, "not an image"),
    ([("image", ("a.png", png(picture()), "image/png")),
      ("mask", ("m.png", png(gradient("RGBA", (32, 32))), "image/png"))], {}, 400, "same dimensions"),
    ([("image", ("a.png", png(picture()), "image/png"))], {"stream": "true"}, 400, "stream"),
    ([("image", ("a.png", png(picture()), "image/png"))], {"scheduler": "dpm_fast"}, 400, "unknown scheduler"),
    ([("image", ("a.png", png(picture()), "image/png"))], {"bogus": "1"}, 400, "unknown field 'bogus'"),
    ([("mask", ("m.png", png(transparent_left(picture())), "image/png"))], {}, 400, "send one image (got 0)"),
])
def test_hostile_edit_uploads_are_4xx_naming_the_problem(http: httpx.Client, files: list[tuple[str, object]],
                                                         data: dict[str, str], status: int, named: str) -> None:
    r = http.post("/v1/images/edits", files=files,
                  data={"prompt": "x", "size": "64x64", "steps": "2", **data})
    assert r.status_code == status, r.text
    assert named in r.json()["error"]["message"]


def test_edits_need_multipart(http: httpx.Client) -> None:
    r = http.post("/v1/images/edits", json={"prompt": "x", "image": "abc"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_fifty_megabytes_of_base64_is_413_before_it_is_read(http: httpx.Client) -> None:
    body = b'{"init_images": ["' + b"A" * (50 << 20) + b'"]}'
    r = http.post("/sdapi/v1/img2img", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize(("image", "fmt"), [(gradient("CMYK", (SIZE, SIZE)), "JPEG"),
                                             (gradient("P", (SIZE, SIZE)), "PNG"),
                                             (gradient("RGB", (SIZE, SIZE)), "WEBP")])
def test_documented_conversions_serve(http: httpx.Client, image: Image.Image, fmt: str) -> None:
    r = http.post("/v1/images/edits", files=[("image", ("i", png(image, format=fmt), "application/octet-stream"))],
                  data={"prompt": "x", "size": "64x64", "steps": "2"})
    assert r.status_code == 200, r.text


def _webui(url: str) -> webuiapi.WebUIApi:
    host, port = url.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler", steps=4)


def test_webuiapi_img2img(dev_server: str) -> None:
    result = _webui(dev_server).img2img(images=[picture()], prompt="a watercolor", denoising_strength=0.5,
                                        width=SIZE, height=SIZE, seed=5, cfg_scale=7)
    assert result.image.size == (SIZE, SIZE)
    assert result.info["mode"] == "img2img" and result.info["denoising_strength"] == 0.5
    assert "init_images" not in result.parameters  # include_init_images is False


@pytest.mark.parametrize("sampler", ["LMS", "Heun", "PLMS", "UniPC", "LMS Karras"])
def test_a1111_img2img_with_the_multistep_samplers(dev_server: str, sampler: str) -> None:
    """AI Render's default sampler (LMS) and the other multistep ones A1111 lists serve img2img (once refused)."""
    result = _webui(dev_server).img2img(images=[picture()], prompt="a watercolor", denoising_strength=0.5,
                                        width=SIZE, height=SIZE, seed=5, sampler_name=sampler)
    assert result.image.size == (SIZE, SIZE)
    name, _, schedule = sampler.partition(" ")  # "LMS Karras": A1111 reports the sampler and its schedule type
    assert (result.info["sampler_name"], result.info["mode"]) == (name, "img2img")
    assert f"Sampler: {name}, Schedule type: {schedule or 'Automatic'}," in result.info["infotexts"][0]


def test_webuiapi_inpainting_with_its_defaults(dev_server: str) -> None:
    """webuiapi's defaults: mask_blur 4, inpainting_fill 0 (fill), inpaint_full_res True (only masked, the whole
    image keeps its size), image_cfg_scale 1.5."""
    mask = Image.new("L", (96, 80), 0)
    mask.paste(255, (10, 10, 40, 40))
    whole = gradient("RGB", (96, 80))
    result = _webui(dev_server).img2img(images=[whole], mask_image=mask, prompt="a flower", denoising_strength=0.9,
                                        width=SIZE, height=SIZE, seed=9, inpaint_full_res_padding=8)
    assert result.image.size == (96, 80)  # only-masked pastes back into the whole image
    out, original = np.asarray(result.image.convert("RGB")), np.asarray(whole)
    assert np.array_equal(out[60:, 60:], original[60:, 60:])  # far from the (blurred) mask: untouched
    assert np.abs(out[15:35, 15:35].astype(int) - original[15:35, 15:35]).mean() > 5
    assert result.info["mode"] == "inpaint"


def test_a1111_img2img_whole_picture_inpainting_and_refusals(http: httpx.Client) -> None:
    text = base64.b64encode(png(picture())).decode()
    mask = base64.b64encode(png(Image.new("L", (SIZE, SIZE), 255))).decode()
    body = {"init_images": ["data:image/png;base64," + text], "mask": mask, "inpaint_full_res": False,
            "inpainting_fill": 1, "width": SIZE, "height": SIZE, "steps": 2, "include_init_images": True}
    r = http.post("/sdapi/v1/img2img", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["init_images"]  # echoed when asked
    for field, value in (("resize_mode", 3), ("initial_noise_multiplier", 0.5)):
        refused = http.post("/sdapi/v1/img2img", json={**body, field: value})
        assert refused.status_code == 422 and field in refused.text
    bad = http.post("/sdapi/v1/img2img", json={**body, "init_images": ["bm90IGFuIGltYWdl"]})
    assert bad.status_code == 422 and "init_images.0" in bad.text
