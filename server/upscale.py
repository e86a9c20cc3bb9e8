"""A1111's extras upscale (``/sdapi/v1/extra-single-image``, ``/extra-batch-images``) on sdserve's upscalers: the
resizers None, Lanczos and Nearest (server/hires.py) and the ONNX upscalers of ``[runtime] upscaler_dir``
(engines/pipelines/upscale.py, run tiled).

The steps are A1111's (scripts/postprocessing_upscale.py ``process``/``upscale`` and modules/upscaler.py
``Upscaler.upscale``): ``upscaler_1`` "None" leaves the image as it is; otherwise the factor is
``upscaling_resize`` (resize_mode 0) or ``max(w / width, h / height)`` for ``upscaling_resize_w``/``_h`` (resize_mode
1); the target is that factor times the size, rounded down to a multiple of 8; the upscaler runs up to three times
until the image reaches the target (a x4 model once for a 2x, twice for an 8x), then a LANCZOS resize lands on it
exactly; with resize_mode 1 and ``upscaling_crop`` the result is centred on a canvas of exactly w x h.
``upscaler_2`` at ``extras_upscaler_2_visibility`` > 0 upscales the original the same way and is blended in. The
infotext (``Postprocess upscale by: 2.0, Postprocess upscaler: Lanczos``) is written into the PNG (``postprocessing``,
beside the source's own ``parameters``) and returned as A1111's ``html_info``.

Bounds: every pass's output and the canvas are checked against ``limits.max_request_pixels`` before the pass runs
(a 422 naming the field that asked for it); the ONNX passes run tile by tile (``runtime.upscaler_tile``), so a 4x
of a 1024x1024 image never holds more than one tile's activations and the uint8 result.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from engines.errors import ConfigError, InvalidRequestError, ModelLoadError
from engines.factory import OnnxUpscaler, UpscalerLibrary
from server.hires import OPT_F, UPSCALERS

if TYPE_CHECKING:
    from server.settings import Settings

Scaler = OnnxUpscaler | Image.Resampling | None
"""An ONNX upscaler, a PIL resampling filter (Lanczos, Nearest), or None (A1111's "None": no upscale)."""
FACE_RESTORERS = {"gfpgan_visibility": "GFPGAN", "codeformer_visibility": "CodeFormer"}
"""A1111's face restoration fields -> the model each needs (none is installed in sdserve)."""


@dataclass(frozen=True)
class UpscaleJob:
    """What one extras request asks of every image (A1111's ExtrasBaseRequest upscale fields)."""

    resize_mode: int
    by: float
    to_width: int
    to_height: int
    crop: bool
    first: tuple[str, Scaler]
    second: tuple[str, Scaler]
    second_visibility: float
    tile: int
    overlap: int
    max_pixels: int
    deadline: float | None = None


def with_upscaler_dir(settings: Settings, folder: Path | None) -> Settings:
    """The profile with ``sdserve serve --upscaler-dir`` applied (ConfigError, exit 10, when it is not a folder)."""
    if folder is None:
        return settings
    if not folder.is_dir():
        raise ConfigError(f"--upscaler-dir {folder}: not a folder")
    runtime = settings.runtime.model_copy(update={"upscaler_dir": str(folder.resolve())})
    return settings.model_copy(update={"runtime": runtime})


def available(library: UpscalerLibrary) -> list[str]:
    """Every upscaler name a request may send: the resizers, then the folder's ONNX files."""
    return [*UPSCALERS, *(name for name in library.files() if name not in UPSCALERS)]


def resolve(name: str, field: str, library: UpscalerLibrary) -> tuple[str, Scaler]:
    """``name`` as a scaler (an ONNX upscaler loaded now); unknown: 422 naming ``field`` and listing the names."""
    if name in UPSCALERS:
        return name, UPSCALERS[name] if name != "None" else None
    try:
        model = library.get(name)
    except ModelLoadError as exc:
        raise InvalidRequestError(f"{field} {name[:64]!r} is installed but cannot be used: {exc}",
                                  param=field) from None
    if model is None:
        raise InvalidRequestError(f"{field} {name[:64]!r} is not an upscaler of this server; available: "
                                  f"{available(library)} (GET /sdapi/v1/upscalers); an ESRGAN-family model is "
                                  f"served as <name>.onnx in [runtime] upscaler_dir", param=field)
    return name, model


def refuse_face_restorers(values: dict[str, float]) -> None:
    """GFPGAN and CodeFormer need their own models, which sdserve does not have: a visibility above 0 is a 422
    naming the field and the model (0, every client's default, is accepted)."""
    for field, model in FACE_RESTORERS.items():
        if values.get(field, 0) > 0:
            raise InvalidRequestError(f"{field}: {model} face restoration is not installed on this server (no "
                                      f"{model} model; GET /sdapi/v1/face-restorers lists none): send 0",
                                      param=field)


def factor(job: UpscaleJob, width: int, height: int) -> float:
    """A1111's upscale factor for one image."""
    return max(job.to_width / width, job.to_height / height) if job.resize_mode == 1 else job.by


def upscale_image(image: Image.Image, job: UpscaleJob) -> tuple[Image.Image, dict[str, str]]:
    """One image through A1111's upscale steps: the result (RGB) and its infotext items, in A1111's order."""
    image = image.convert("RGB")
    info: dict[str, str] = {}
    if job.first[1] is None:
        return image, info
    result = _upscale(image, job, job.first, info)
    info["Postprocess upscaler"] = job.first[0]
    if job.second[1] is not None and job.second_visibility > 0:
        other = _upscale(image, job, job.second, info)
        result = Image.blend(result, other, job.second_visibility)
        info["Postprocess upscaler 2"] = job.second[0]
    return result, info


def _upscale(image: Image.Image, job: UpscaleJob, scaler: tuple[str, Scaler], info: dict[str, str]) -> Image.Image:
    field = "upscaling_resize_w" if job.resize_mode == 1 else "upscaling_resize"
    scale = factor(job, image.width, image.height)
    if job.resize_mode == 1:
        info["Postprocess upscale to"] = f"{job.to_width}x{job.to_height}"
        _bound(job.to_width, job.to_height, job.max_pixels, field)
    else:
        info["Postprocess upscale by"] = str(job.by)
    dest = (int(image.width * scale // OPT_F * OPT_F), int(image.height * scale // OPT_F * OPT_F))
    if dest[0] < 1 or dest[1] < 1:
        raise InvalidRequestError(f"{field}: a factor of {scale:g} makes the {image.width}x{image.height} image "
                                  f"{dest[0]}x{dest[1]} (A1111 rounds down to a multiple of {OPT_F})", param=field)
    _bound(*dest, job.max_pixels, field)
    for _ in range(3):  # Upscaler.upscale: the upscaler's own pass until the image reaches the target
        before = image.size
        image = _one_pass(image, scale, job, scaler)
        if image.size == before or (image.width >= dest[0] and image.height >= dest[1]):
            break
    if image.size != dest:
        image = image.resize(dest, Image.Resampling.LANCZOS)
    if job.resize_mode == 1 and job.crop:
        canvas = Image.new("RGB", (job.to_width, job.to_height))
        canvas.paste(image, (job.to_width // 2 - image.width // 2, job.to_height // 2 - image.height // 2))
        image = canvas
        info["Postprocess crop to"] = f"{image.width}x{image.height}"
    return image


def _one_pass(image: Image.Image, scale: float, job: UpscaleJob, scaler: tuple[str, Scaler]) -> Image.Image:
    name, how = scaler
    if isinstance(how, OnnxUpscaler):
        _bound(image.width * how.scale, image.height * how.scale, job.max_pixels,
               "upscaler_1" if scaler == job.first else "upscaler_2", f"a x{how.scale} pass of {name}")
        out = how.run(np.asarray(image), job.tile, job.overlap, job.deadline)
        return Image.fromarray(out, "RGB")
    assert how is not None
    size = (int(image.width * scale), int(image.height * scale))
    _bound(*size, job.max_pixels, "upscaling_resize")
    return image.resize(size, how)


def _bound(width: int, height: int, limit: int, field: str, what: str = "the upscaled image") -> None:
    if width * height > limit:
        raise InvalidRequestError(f"{field}: {what} would be {width}x{height} ({width * height} pixels), over this "
                                  f"server's limit of {limit} pixels per request (limits.max_request_pixels): ask "
                                  "for a smaller size or factor", param=field)


def quote(text: str) -> str:
    """A1111's infotext quoting (modules/infotext_utils.py ``quote``): JSON-quoted when it holds , : or a newline."""
    import json

    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def infotext(info: dict[str, Any]) -> str:
    """The postprocessing infotext, as A1111's run_postprocessing joins ``pp.info``."""
    return ", ".join(k if k == v else f"{k}: {quote(str(v))}" for k, v in info.items() if v is not None)


def html_info(text: str) -> str:
    """A1111's ``ui_common.plaintext_to_html``: each line escaped, joined by <br>, inside <p>."""
    return "<p>" + "<br>\n".join(html.escape(line) for line in text.split("\n")) + "</p>"
