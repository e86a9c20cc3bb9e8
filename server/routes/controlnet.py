"""sd-webui-controlnet's routes (its ``scripts/api.py``): ``/controlnet/version``, ``/controlnet/model_list``,
``/controlnet/module_list`` (with ``module_detail``), ``/controlnet/settings`` and ``/controlnet/detect``. The
library is ``app.state.controlnets`` (server/controlnet.py ControlNetLibrary; absent: none, the lists are empty).
``model_list`` names the ControlNets the engine loaded (a file it refused is not listed); ``module_list`` the
preprocessors this server has: the model-free ones and the folder's annotator files (server/controlnet_modules.py);
``/controlnet/detect`` returns what a unit with the same module and parameters would use (an inpaint module: the
image as RGBA with its ``controlnet_masks`` mask half transparent, as sd-webui-controlnet shows it)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from PIL import Image
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from engines.errors import InvalidRequestError
from server.controlnet import API_VERSION, UNIT_COUNT, ControlNetLibrary, served_names
from server.controlnet_modules import INPAINT, canonical, detail, inpaint_view, preprocess, with_defaults
from server.images_in import from_base64

router = APIRouter(prefix="/controlnet", tags=["controlnet"])
DETECT_MAX_PIXELS = 4096 * 4096
"""The largest image /controlnet/detect decodes (and the profile's limits.max_image_pixels, as every upload)."""
DETECT_MAX_IMAGES = 8


def _library(request: Request) -> ControlNetLibrary | None:
    library = getattr(request.app.state, "controlnets", None)
    return library if isinstance(library, ControlNetLibrary) else None


@router.get("/version")
def version() -> dict[str, int]:
    return {"version": API_VERSION}


@router.get("/model_list")
def model_list(request: Request) -> dict[str, list[str]]:
    library = _library(request)
    if library is None:
        return {"model_list": []}
    return {"model_list": library.titles(served_names(getattr(request.app.state, "engine", None)))}


@router.get("/module_list")
def module_list(request: Request, alias_names: bool = False) -> dict[str, Any]:
    library = _library(request)
    modules = detail(library.annotators if library else None, labels=alias_names)
    return {"module_list": list(modules), "module_detail": modules}


@router.get("/settings")
def settings(request: Request) -> dict[str, int]:
    library = _library(request)
    return {"control_net_unit_count": library.unit_count if library else UNIT_COUNT}


class DetectRequest(BaseModel):
    controlnet_module: str = "none"
    controlnet_input_images: list[str] = Field(default_factory=list)
    controlnet_images: list[str] = Field(default_factory=list)
    """What webuiapi's ``controlnet_detect`` sends instead of ``controlnet_input_images`` (taken when that is
    empty, so its calls work)."""
    controlnet_masks: list[str] = Field(default_factory=list)
    """The inpaint modules' masks, one per image (sd-webui-controlnet: required for them, ignored by the others)."""
    controlnet_processor_res: float = 512
    controlnet_threshold_a: float = 64
    controlnet_threshold_b: float = 64


def _detect(body: DetectRequest, library: ControlNetLibrary | None, max_pixels: int) -> dict[str, Any]:
    annotators = library.annotators if library else None
    modules, module = detail(annotators), canonical(body.controlnet_module)
    if module not in modules:
        raise InvalidRequestError(f"unknown ControlNet module {body.controlnet_module[:64]!r}; this server has "
                                  f"{list(modules)} (GET /controlnet/module_list)", param="controlnet_module")
    key = "controlnet_input_images" if body.controlnet_input_images or not body.controlnet_images else \
        "controlnet_images"
    given: list[str] = getattr(body, key)
    if not given or len(given) > DETECT_MAX_IMAGES:
        raise InvalidRequestError(f"{key} needs 1 to {DETECT_MAX_IMAGES} images", param=key)
    if module in INPAINT and len(body.controlnet_masks) != len(given):
        raise InvalidRequestError(f"module {body.controlnet_module[:64]!r} needs controlnet_masks: one mask per image",
                                  param="controlnet_masks")
    images = []
    for i, text in enumerate(given):
        field = f"{key}[{i}]"
        image = np.asarray(from_base64(text, field, max_pixels).convert("RGB"))
        if module in INPAINT:  # the image passes unchanged; the answer shows the mask (visualize_inpaint_mask)
            mask = np.asarray(from_base64(body.controlnet_masks[i], f"controlnet_masks[{i}]", max_pixels)
                              .convert("RGB"))[:, :, 0]
            if mask.shape != image.shape[:2]:
                raise InvalidRequestError(f"mask {i} is {mask.shape[1]}x{mask.shape[0]}, its image "
                                          f"{image.shape[1]}x{image.shape[0]}", param=f"controlnet_masks[{i}]")
            images.append(_png(inpaint_view(image, mask)))
            continue
        res, low, high = with_defaults(module, body.controlnet_processor_res,
                                       body.controlnet_threshold_a, body.controlnet_threshold_b, annotators)
        try:
            out = preprocess(module, image, int(res), low, high, "controlnet", annotators)
        except InvalidRequestError as exc:  # named as this route's fields: controlnet_threshold_a, ...
            raise InvalidRequestError(str(exc), param=(exc.param or "").replace("controlnet.", "controlnet_")) \
                from None
        images.append(_png(out))
    return {"images": images, "info": "Success"}


def _png(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@router.post("/detect")
async def detect(body: DetectRequest, request: Request) -> dict[str, Any]:
    settings = getattr(request.app.state, "settings", None)
    limit = min(DETECT_MAX_PIXELS, settings.limits.max_image_pixels) if settings is not None else DETECT_MAX_PIXELS
    return await run_in_threadpool(_detect, body, _library(request), limit)
