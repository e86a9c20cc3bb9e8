"""ControlNet preprocessors (sd-webui-controlnet's "modules") served without torch, and the model-based ones run as
ONNX files the operator puts in the ControlNet folder (issue 56).

Served always, with sd-webui-controlnet's parameters (its ``scripts/processor.py`` and
``scripts/preprocessor/model_free_preprocessors.py``; ``processor_res`` is the short side the detector sees, the
image padded to a multiple of 64 by edge replication and the padding removed after, as its
``resize_image_with_pad``): ``none``, ``invert`` (white background, black lines), ``canny`` (threshold_a low,
threshold_b high), ``threshold`` (binary: threshold_a, a pixel whose darkest channel is above it turns white),
``scribble_xdog`` (threshold_a: the difference-of-Gaussians threshold), ``lineart_standard``, ``blur_gaussian``
(threshold_a: the sigma) and ``tile_resample`` (threshold_a: the down-sampling rate; no resolution).

Model-based modules are ONNX files: ``<controlnet dir>/annotators/<module>.onnx``. The contract of such a file: one
float32 input ``[1, 3, H, W]``, RGB in [0, 1], H and W multiples of 64; its first output ``[1, C, h, w]`` (C 1 or
3) is the map, resized back to ``H x W`` when it is smaller. The module's kind says how the map becomes pixels:
depth maps are scaled from their minimum to their maximum (sd-webui-controlnet's depth annotators do so), line
maps are inverted (its lineart modules apply ``255 - x``), every other map is taken as [0, 1]. A module whose file
is absent is refused by name (422 naming ``module``, listing what this server has); an annotator file is untrusted
input like a ControlNet file: bounded in size, and refused by name when ONNX Runtime cannot load it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engines.errors import InvalidRequestError
from engines.factory import OnnxAnnotator

RES = {"name": "Resolution", "value": 512, "min": 64, "max": 2048, "step": 8}
"""sd-webui-controlnet's processor_res slider (``flag_preprocessor_resolution``)."""
MODEL_FREE: dict[str, dict[str, Any]] = {
    "none": {"model_free": False, "sliders": []},
    "canny": {"model_free": False, "sliders": [
        RES, {"name": "Canny Low Threshold", "value": 100, "min": 1, "max": 255, "step": 1},
        {"name": "Canny High Threshold", "value": 200, "min": 1, "max": 255, "step": 1}]},
    "invert": {"model_free": False, "sliders": [RES]},
    "threshold": {"model_free": False, "sliders": [
        RES, {"name": "Binarization Threshold", "value": 127, "min": 0, "max": 255, "step": 1}]},
    "scribble_xdog": {"model_free": False, "sliders": [
        RES, {"name": "XDoG Threshold", "value": 32, "min": 1, "max": 64, "step": 1}]},
    "lineart_standard": {"model_free": False, "sliders": [RES]},
    "blur_gaussian": {"model_free": False, "sliders": [
        RES, {"name": "Sigma", "value": 9.0, "min": 0.01, "max": 64.0, "step": 0.01}]},
    "tile_resample": {"model_free": False, "sliders": [
        None, {"name": "Down Sampling Rate", "value": 1.0, "min": 1.0, "max": 8.0, "step": 0.01}]},
    "inpaint": {"model_free": False, "sliders": []},
    "inpaint_only": {"model_free": False, "sliders": []},
}
"""The preprocessors served without a file, with sd-webui-controlnet's ``module_detail`` (sliders: processor_res,
threshold_a, threshold_b; None where the module has no resolution slider)."""
ANNOTATOR_KINDS: dict[str, str] = {
    "depth_midas": "depth", "depth_zoe": "depth", "depth_leres": "depth", "depth_anything": "depth",
    "lineart_realistic": "lines", "lineart_coarse": "lines", "lineart_anime": "lines",
    "softedge_hed": "map", "softedge_pidinet": "map", "normal_bae": "map", "openpose": "map", "openpose_full": "map",
    "seg_ofade20k": "map", "mlsd": "map",
}
"""The model-based modules an ONNX file may serve, by sd-webui-controlnet's name, and how its map becomes pixels."""
log = logging.getLogger(__name__)
INPAINT = {"inpaint": "global", "inpaint_only": "only"}
"""sd-webui-controlnet's inpaint modules (``inpaint``, labelled ``inpaint_global_harmonious``, and ``inpaint_only``):
the image passes unchanged, the unit's mask makes its masked pixels -1 in the hint (ControlUnit.hint_mask)."""
REFERENCE = ("reference_only", "reference_adain", "reference_adain+attn")
"""sd-webui-controlnet's reference modules: attention hooks on the UNet (no ControlNet file), not served."""
LABELS = {"inpaint": "inpaint_global_harmonious", "invert": "invert (from white bg & black line)",
          "lineart_standard": "lineart_standard (from white bg & black line)"}
"""sd-webui-controlnet's display names (``module_list?alias_names=true``); units may send either."""
LEGACY = {"depth": "depth_midas", "lineart": "lineart_realistic", "hed": "softedge_hed", "pidinet": "softedge_pidinet",
          "oneformer_ade20k": "seg_ofade20k", **{label: name for name, label in LABELS.items()}}
"""Names sd-webui-controlnet accepted before its 1.1 renames (and its labels), mapped to the modules above."""
ANNOTATOR_FOLDER = "annotators"
MAX_ANNOTATOR_BYTES = 2 << 30
"""The largest annotator file loaded (2 GiB: ONNX's protobuf limit)."""


def resize_with_pad(image: np.ndarray, res: int) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
    """``image`` with its short side at ``res`` (cubic up, area down), padded by edge replication to multiples of
    64, and the function that removes the padding again (sd-webui-controlnet's ``resize_image_with_pad``)."""
    import cv2

    h, w = image.shape[:2]
    k = float(res) / float(min(h, w))
    th, tw = max(1, int(np.round(h * k))), max(1, int(np.round(w * k)))
    resized = cv2.resize(image, (tw, th), interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)
    padded = np.pad(resized, [[0, -th % 64], [0, -tw % 64], [0, 0]], mode="edge")
    return np.ascontiguousarray(padded), lambda x: np.ascontiguousarray(x[:th, :tw])


def _rgb(gray: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2) if gray.ndim == 2 else gray)


def _canny(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    import cv2

    padded, unpad = resize_with_pad(image, res)
    return _rgb(unpad(cv2.Canny(padded, int(a), int(b))))


def _threshold(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    padded, unpad = resize_with_pad(image, res)
    return _rgb(unpad(np.where(padded.min(axis=2) > a, 255, 0).astype(np.uint8)))


def _scribble_xdog(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    import cv2

    padded, unpad = resize_with_pad(image, res)
    x = padded.astype(np.float32)
    dog = (255 - np.min(cv2.GaussianBlur(x, (0, 0), 5.0) - cv2.GaussianBlur(x, (0, 0), 0.5), axis=2))
    dog = dog.clip(0, 255).astype(np.uint8)
    return _rgb(unpad(np.where(2 * (255 - dog.astype(np.int32)) > a, 255, 0).astype(np.uint8)))


def _lineart_standard(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    import cv2

    padded, unpad = resize_with_pad(image, res)
    x = padded.astype(np.float32)
    intensity = np.min(cv2.GaussianBlur(x, (0, 0), 6.0) - x, axis=2).clip(0, 255)
    strong = intensity[intensity > 8]
    intensity = intensity / max(16.0, float(np.median(strong)) if strong.size else 0.0) * 127
    return _rgb(unpad(intensity.clip(0, 255).astype(np.uint8)))


def _blur_gaussian(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    import cv2

    padded, unpad = resize_with_pad(image, res)
    return np.ascontiguousarray(cv2.GaussianBlur(unpad(padded), (0, 0), float(a)))


def _tile_resample(image: np.ndarray, res: int, a: float, b: float) -> np.ndarray:
    import cv2

    if a < 1.1:
        return image
    h, w = image.shape[:2]
    size = (max(1, int(w / a)), max(1, int(h / a)))
    return np.ascontiguousarray(cv2.resize(image, size, interpolation=cv2.INTER_AREA))


RUN: dict[str, Callable[[np.ndarray, int, float, float], np.ndarray]] = {
    "none": lambda image, res, a, b: image,
    "invert": lambda image, res, a, b: np.ascontiguousarray(255 - image),
    "inpaint": lambda image, res, a, b: image, "inpaint_only": lambda image, res, a, b: image,
    "canny": _canny, "threshold": _threshold, "scribble_xdog": _scribble_xdog,
    "lineart_standard": _lineart_standard, "blur_gaussian": _blur_gaussian, "tile_resample": _tile_resample,
}


class Annotators:
    """The model-based modules of a ControlNet folder: ``annotators/<module>.onnx`` for a module of
    ANNOTATOR_KINDS, each session loaded on first use (CPU execution provider: a preprocessor, run once per
    request, not per step) and kept."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder / ANNOTATOR_FOLDER if folder is not None else None
        self.refused: dict[str, str] = {}
        """Module -> why its file was refused (too large, not loadable)."""
        self._sessions: dict[str, OnnxAnnotator] = {}
        self._lock = threading.Lock()

    def files(self) -> dict[str, Path]:
        """The annotator files present, by module (files of other names are not modules: left out)."""
        if self.folder is None or not self.folder.is_dir():
            return {}
        return {p.stem: p for p in sorted(self.folder.glob("*.onnx"))
                if p.stem in ANNOTATOR_KINDS and p.is_file() and p.stem not in self.refused}

    def session(self, module: str, field: str) -> OnnxAnnotator:
        with self._lock:
            if module in self._sessions:
                return self._sessions[module]
            path = self.files().get(module)
            if path is None:
                raise InvalidRequestError(f"unknown ControlNet module {module[:64]!r}", param=field)
            try:
                if path.stat().st_size > MAX_ANNOTATOR_BYTES:
                    raise ValueError(f"over {MAX_ANNOTATOR_BYTES} bytes")
                session = OnnxAnnotator(path)
            except Exception as exc:  # untrusted file: refused by name, never fatal; the reason in the log only
                self.refused[module] = type(exc).__name__  # (ORT's message names the file's path)
                log.warning("ControlNet annotator %s refused: %s", module, exc)
                raise InvalidRequestError(f"ControlNet module {module!r}: its annotator file "
                                          f"{ANNOTATOR_FOLDER}/{module}.onnx was refused ({self.refused[module]}: "
                                          "not loadable, see the server log)", param=field) from None
            self._sessions[module] = session
            return session

    def run(self, module: str, image: np.ndarray, res: int, field: str) -> np.ndarray:
        """uint8 [H, W, 3] through the module's ONNX file at processor_res ``res``."""
        import cv2

        session = self.session(module, field)
        padded, unpad = resize_with_pad(image, res)
        x = (padded.astype(np.float32) / 255.0).transpose(2, 0, 1)[None]
        out = session(x)
        if out.ndim != 4 or out.shape[0] != 1 or out.shape[1] not in (1, 3):
            raise InvalidRequestError(f"ControlNet module {module!r}: its file answered {list(out.shape)}, not "
                                      "[1, 1 or 3, h, w]", param=field)
        out = out[0].transpose(1, 2, 0)
        kind = ANNOTATOR_KINDS[module]
        if kind == "depth":
            low, high = float(out.min()), float(out.max())
            out = (out - low) / (high - low) if high > low else np.zeros_like(out)
        pixels = (np.nan_to_num(out).clip(0, 1) * 255.0).round().astype(np.uint8)
        if kind == "lines":
            pixels = 255 - pixels
        pixels = pixels[:, :, 0] if pixels.shape[2] == 1 else pixels
        if pixels.shape[:2] != padded.shape[:2]:
            pixels = cv2.resize(pixels, (padded.shape[1], padded.shape[0]), interpolation=cv2.INTER_CUBIC)
        return _rgb(unpad(pixels))


def detail(annotators: Annotators | None, labels: bool = False) -> dict[str, dict[str, Any]]:
    """``module_detail`` of every module this server has: the model-free ones, then those with a file; with
    ``labels``, keyed by sd-webui-controlnet's display names (``alias_names``)."""
    found = {name: {"model_free": False, "sliders": [RES]} for name in (annotators.files() if annotators else {})}
    modules = {**MODEL_FREE, **found}
    return {LABELS.get(name, name): value for name, value in modules.items()} if labels else modules


def canonical(module: str) -> str:
    """A unit's module as this server names it (legacy names and display labels mapped)."""
    return LEGACY.get(module, module)


def with_defaults(module: str, res: float, a: float, b: float,
                  annotators: Annotators | None = None) -> tuple[float, float, float]:
    """processor_res, threshold_a and threshold_b with each negative one (sd-webui-controlnet's -1: "the module's
    default") replaced by the module's slider value."""
    sliders = [s["value"] if s else 512 for s in detail(annotators).get(module, {"sliders": []})["sliders"]]
    values = [*sliders, 512, 0, 0][:3] if not sliders else [*sliders, 0, 0, 0][:3]
    return tuple(v if v >= 0 else float(d) for v, d in zip((res, a, b), values, strict=True))  # type: ignore[return-value]


def preprocess(module: str, image: np.ndarray, res: int, a: float, b: float, field: str,
               annotators: Annotators | None = None) -> np.ndarray:
    """uint8 [H, W, 3] through ``module``: threshold_a ``a`` and threshold_b ``b`` as the module reads them; an
    unknown module or one without its file is refused naming ``<field>.module`` and listing what exists."""
    image, module = (image if image.ndim == 3 else _rgb(image)), canonical(module)
    if module == "blur_gaussian" and a <= 0:
        raise InvalidRequestError("blur_gaussian's threshold_a (Sigma) must be above 0", param=f"{field}.threshold_a")
    if module in RUN:
        return RUN[module](image, max(1, int(res)), a, b)
    if annotators is not None and module in annotators.files():
        return annotators.run(module, image, max(1, int(res)), f"{field}.module")
    if module in REFERENCE:
        raise InvalidRequestError(f"ControlNet module {module!r} is an attention hook of sd-webui-controlnet (it runs "
                                  "no ControlNet model), which this server does not serve; this server has "
                                  f"{list(detail(annotators))} (GET /controlnet/module_list)", param=f"{field}.module")
    absent = (f" (its file {ANNOTATOR_FOLDER}/{module}.onnx is not in the ControlNet folder)"
              if module in ANNOTATOR_KINDS else "")
    raise InvalidRequestError(f"unknown ControlNet module {module[:64]!r}{absent}; this server has "
                              f"{list(detail(annotators))} (GET /controlnet/module_list)", param=f"{field}.module")


def inpaint_view(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """What /controlnet/detect returns for an inpaint module (sd-webui-controlnet's ``visualize_inpaint_mask``): the
    image as RGBA, its alpha ``255 - mask // 2`` (the mask's first channel: masked pixels half transparent)."""
    alpha = (255 - np.asarray(mask, np.uint8) // 2)[:, :, None]
    return np.ascontiguousarray(np.concatenate([image[:, :, :3], alpha], axis=2))
