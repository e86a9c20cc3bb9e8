"""Inpaint ControlNet units, units without an image and the reference modules, as sd-webui-controlnet serves them
(issue 56): ``inpaint_global_harmonious`` (module ``inpaint``) and ``inpaint_only`` take the unit's mask (``mask`` or
``image: {"image", "mask"}``) or img2img's; the hint is the image with the masked pixels -1 (diffusers'
``make_inpaint_condition``); a unit without an image takes img2img's init image (its ``choose_input_image``); the
reference modules are attention hooks, refused by name. The parsing (server/controlnet.py), the hint the UNet
pipeline prepares (engines/pipelines/controlnet.py prepare_hint, plain numpy) and /controlnet/detect."""

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
from engines.pipelines.controlnet import prepare_hint, prepare_image
from engines.types.request import Batch, ControlUnit, EditImage, ImageSpec
from server import errors
from server.controlnet import ControlNetLibrary, parse_units
from server.routes import controlnet as routes

W = H = 64
MAX_PIXELS = 1 << 20
BASE = "alwayson_scripts.controlnet.args"


def _b64(image: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _picture(size: int = 64) -> np.ndarray:
    ramp = np.linspace(20, 230, size, dtype=np.float32)
    return np.ascontiguousarray(np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)),
                                          np.full((size, size), 90.0)], axis=2).astype(np.uint8))


def _mask(size: int = 64) -> np.ndarray:
    """White (repaint) on the right half, as openOutpaint's mask canvas over an empty half."""
    mask = np.zeros((size, size, 3), np.uint8)
    mask[:, size // 2:] = 255
    return mask


@pytest.fixture
def library(tmp_path: Path) -> ControlNetLibrary:
    (tmp_path / "control_v11p_sd15_inpaint").mkdir()
    (tmp_path / "control_v11p_sd15_inpaint" / "model.onnx").write_bytes(b"onnx")
    (tmp_path / "control_v11p_sd15_inpaint" / "config.json").write_text(json.dumps({"_class_name": "x"}))
    return ControlNetLibrary(tmp_path)


def _one(library: ControlNetLibrary, **unit: object) -> ControlUnit:
    body = {"model": "control_v11p_sd15_inpaint", **unit}
    parsed = parse_units({"args": [body]}, library, W, H, MAX_PIXELS)
    assert len(parsed) == 1
    return parsed[0].unit


@pytest.mark.parametrize("form", ["mask", "dict"])
@pytest.mark.parametrize("module", ["inpaint_global_harmonious", "inpaint", "inpaint_only"])
def test_an_inpaint_unit_keeps_its_image_and_its_mask(library: ControlNetLibrary, module: str, form: str) -> None:
    picture, mask = _picture(32), _mask(32)  # at another size than the output: both fitted alike
    image = {"image": _b64(picture), "mask": _b64(mask)} if form == "dict" else _b64(picture)
    extra = {"mask": _b64(mask)} if form == "mask" else {}
    unit = _one(library, module=module, image=image, resize_mode="Just Resize", **extra)
    assert unit.inpaint == ("only" if module == "inpaint_only" else "global")
    assert unit.image.shape == (H, W, 3) and unit.from_init is None
    assert unit.hint_mask is not None and unit.hint_mask.shape == (H, W) and unit.hint_mask.dtype == bool
    assert unit.hint_mask[:, W // 2 + 2:].all() and not unit.hint_mask[:, : W // 2 - 2].any()
    # the image passes the module unchanged (the identity preprocessor), only resized
    assert abs(int(unit.image[0, 0, 0]) - int(picture[0, 0, 0])) <= 2


def test_the_infotext_names_the_module_as_this_server_does(library: ControlNetLibrary) -> None:
    parsed = parse_units({"args": [{"model": "control_v11p_sd15_inpaint", "module": "inpaint_global_harmonious",
                                    "image": _b64(_picture()), "mask": _b64(_mask())}]}, library, W, H, MAX_PIXELS)
    assert parsed[0].infotext.startswith('ControlNet 0: "Module: inpaint, Model: control_v11p_sd15_inpaint [')


def test_a_mask_on_another_module_is_still_refused(library: ControlNetLibrary) -> None:
    with pytest.raises(InvalidRequestError, match="inpaint modules only") as raised:
        _one(library, module="canny", image=_b64(_picture()), mask=_b64(_mask()))
    assert raised.value.param == f"{BASE}[0].mask"


def test_a_mask_of_another_size_than_its_image_is_refused(library: ControlNetLibrary) -> None:
    with pytest.raises(InvalidRequestError, match="one size") as raised:
        _one(library, module="inpaint", image=_b64(_picture(64)), mask=_b64(_mask(32)))
    assert raised.value.param == f"{BASE}[0].mask"


@pytest.mark.parametrize("module", ["reference_only", "reference_adain", "reference_adain+attn"])
def test_reference_modules_are_refused_as_attention_hooks(library: ControlNetLibrary, module: str) -> None:
    with pytest.raises(InvalidRequestError, match="attention hook") as raised:
        _one(library, module=module, model="None", image=_b64(_picture()))
    assert raised.value.param == f"{BASE}[0].module" and "unknown" not in str(raised.value)


def test_a_unit_without_an_image_takes_the_init_image_through_its_module(library: ControlNetLibrary) -> None:
    unit = _one(library, module="invert", pixel_perfect=True)
    assert unit.image.size == 0 and unit.from_init is not None and unit.field == f"{BASE}[0]"
    init = _picture()
    batch = Batch((ImageSpec("p", edit=EditImage(init)),), W, H, control=(unit,))
    hint = prepare_hint(unit, batch)
    assert hint.shape == (3, H, W)
    np.testing.assert_allclose(hint, (255 - init).astype(np.float32).transpose(2, 0, 1) / 255.0, atol=1e-6)


def test_a_unit_without_an_image_on_txt2img_is_refused_naming_its_image(library: ControlNetLibrary) -> None:
    unit = _one(library, module="none")
    with pytest.raises(InvalidRequestError, match="init image") as raised:
        prepare_hint(unit, Batch((ImageSpec("p"),), W, H, control=(unit,)))
    assert raised.value.param == f"{BASE}[0].image"


def test_the_hint_is_minus_one_where_masked_after_the_resize() -> None:
    """diffusers' make_inpaint_condition: the image in [0, 1], pixels with mask > 0.5 set to -1; the mask is applied
    at the output size, so the resize of the image (Lanczos) cannot blur the -1 away."""
    picture, mask = _picture(32), np.zeros((32, 32), bool)
    mask[8:24, 8:24] = True
    unit = ControlUnit(picture, "n", hint_mask=mask, inpaint="global")
    hint = prepare_hint(unit, Batch((ImageSpec("p"),), W, H, control=(unit,)))
    assert hint.shape == (3, H, W)
    assert (hint[:, 16:48, 16:48] == -1).all()
    assert hint[:, :16].min() >= 0 and hint[:, 48:].min() >= 0 and hint.max() <= 1


def test_an_inpaint_unit_on_img2img_inpainting_takes_the_requests_mask(library: ControlNetLibrary) -> None:
    unit = _one(library, module="inpaint_only")  # no image, no mask: the init image and its mask (openOutpaint)
    init, mask = _picture(), _mask()[:, :, 0]
    batch = Batch((ImageSpec("p", edit=EditImage(init, mask)),), W, H, control=(unit,))
    hint = prepare_hint(unit, batch)
    assert (hint[:, :, W // 2:] == -1).all()
    np.testing.assert_allclose(hint[:, :, : W // 2], init[:, : W // 2].astype(np.float32).transpose(2, 0, 1) / 255.0,
                               atol=1e-6)


def test_inpaint_only_without_the_blend_is_refused_by_name(library: ControlNetLibrary) -> None:
    """inpaint_only keeps the unmasked area by blending it back: served where the pipeline blends (inpainting), refused
    naming the module on txt2img and plain img2img, where nothing blends."""
    unit = _one(library, module="inpaint_only", image=_b64(_picture()), mask=_b64(_mask()))
    for spec in (ImageSpec("p"), ImageSpec("p", edit=EditImage(_picture()))):
        with pytest.raises(InvalidRequestError, match="inpaint_global_harmonious") as raised:
            prepare_hint(unit, Batch((spec,), W, H, control=(unit,)))
        assert raised.value.param == f"{BASE}[0].module"
    harmonious = _one(library, module="inpaint_global_harmonious", image=_b64(_picture()), mask=_b64(_mask()))
    assert (prepare_hint(harmonious, Batch((ImageSpec("p"),), W, H, control=(harmonious,)))[:, :, -1] == -1).all()


def test_an_inpaint_unit_without_any_mask_is_refused_naming_its_mask(library: ControlNetLibrary) -> None:
    unit = _one(library, module="inpaint", image=_b64(_picture()))
    with pytest.raises(InvalidRequestError, match="needs a mask") as raised:
        prepare_hint(unit, Batch((ImageSpec("p"),), W, H, control=(unit,)))
    assert raised.value.param == f"{BASE}[0].mask"


def test_the_dit_path_refuses_an_inpaint_unit_by_name() -> None:
    """engines/pipelines/controlnet_dit.py encodes prepare_image's pixels: an inpaint unit (FLUX.1) is refused naming
    its module, a unit without an image naming its image."""
    mask = np.ones((H, W), bool)
    with pytest.raises(InvalidRequestError, match="SD 1.x/2.x and SDXL") as raised:
        prepare_image(ControlUnit(_picture(), "n", hint_mask=mask, inpaint="global", field="u"), W, H)
    assert raised.value.param == "u.module"
    with pytest.raises(InvalidRequestError, match="without an image") as raised:
        prepare_image(ControlUnit(np.zeros((0, 0, 3), np.uint8), "n", from_init=lambda x: x, field="u"), W, H)
    assert raised.value.param == "u.image"


def test_module_list_and_detect(library: ControlNetLibrary) -> None:
    """module_list names ``inpaint`` and ``inpaint_only`` (with alias_names, ``inpaint_global_harmonious``);
    detect needs ``controlnet_masks`` for them and answers the image as RGBA, the mask half transparent
    (sd-webui-controlnet's visualize_inpaint_mask: alpha 255 - mask // 2)."""
    app = FastAPI()
    errors.install(app)
    app.include_router(routes.router)
    app.state.controlnets = library
    client = TestClient(app)
    modules = client.get("/controlnet/module_list").json()
    assert {"inpaint", "inpaint_only"} <= set(modules["module_list"])
    assert not any(m.startswith("reference") for m in modules["module_list"])
    labels = client.get("/controlnet/module_list", params={"alias_names": "true"}).json()["module_list"]
    assert "inpaint_global_harmonious" in labels and "inpaint_only" in labels
    picture = _picture()
    found = client.post("/controlnet/detect", json={"controlnet_module": "inpaint_global_harmonious",
                                                    "controlnet_input_images": [_b64(picture)],
                                                    "controlnet_masks": [_b64(_mask())]})
    assert found.status_code == 200, found.text
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(found.json()["images"][0]))))
    assert image.shape == (H, W, 4)
    assert np.array_equal(image[:, :, :3], picture)
    assert image[0, 0, 3] == 255 and image[0, -1, 3] == 128
    refused = client.post("/controlnet/detect", json={"controlnet_module": "inpaint",
                                                      "controlnet_input_images": [_b64(picture)]})
    assert refused.status_code == 422 and "controlnet_masks" in refused.text
