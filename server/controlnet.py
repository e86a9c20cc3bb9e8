"""ControlNet on A1111's routes as sd-webui-controlnet defines it (issue 56): the library of exported ControlNets
(``name [hash8]`` as the extension lists them), the preprocessors served without torch (``none``, ``canny`` through
OpenCV, ``invert``) and the ``alwayson_scripts.controlnet.args`` units parsed as its ``external_code.py``
``to_processing_unit`` does: the legacy keys (``input_image``, ``guidance``), ``image`` as base64, ``{"image",
"mask"}`` or absent, ``resize_mode`` and ``control_mode`` by name or number, ``pixel_perfect``.

What is refused (422 naming the field): an unknown model or module (listing what exists), more units than
``control_net_unit_count``, a control mode other than Balanced (its soft injection is not served: ignoring it
would change the image), a unit without an image, a mask (inpaint units are not served).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError
from engines.types.request import ControlUnit
from server.images_in import from_base64, resize

API_VERSION = 2
"""sd-webui-controlnet's ``get_api_version()``."""
UNIT_COUNT = 3
"""``control_net_unit_count``'s default in sd-webui-controlnet."""
RESIZE_MODES = ("Just Resize", "Crop and Resize", "Resize and Fill")
RESIZE_ALIASES = {"Inner Fit (Scale to Fit)": "Crop and Resize", "Outer Fit (Shrink to Fit)": "Resize and Fill",
                  "Scale to Fit (Inner Fit)": "Crop and Resize", "Envelope (Outer Fit)": "Resize and Fill"}
CONTROL_MODES = ("Balanced", "My prompt is more important", "ControlNet is more important")
LEGACY_KEYS = {"guessmode": "guess_mode", "guidance": "guidance_end", "lowvram": "low_vram", "input_image": "image"}
SLIDER_RES = {"name": "Resolution", "value": 512, "min": 64, "max": 2048, "step": 8}
MODULES: dict[str, dict[str, Any]] = {
    "none": {"model_free": False, "sliders": []},
    "canny": {"model_free": False, "sliders": [
        SLIDER_RES, {"name": "Canny Low Threshold", "value": 100, "min": 1, "max": 255, "step": 1},
        {"name": "Canny High Threshold", "value": 200, "min": 1, "max": 255, "step": 1}]},
    "invert": {"model_free": False, "sliders": [SLIDER_RES]},
}
"""The preprocessors served, with sd-webui-controlnet's ``module_detail`` (sliders: processor_res, threshold_a,
threshold_b)."""
HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ControlNetFile:
    """One exported ControlNet of the library folder (a subfolder with model.onnx and config.json)."""

    name: str
    folder: Path
    sha256: str

    @property
    def title(self) -> str:
        """``name [hash8]``, as sd-webui-controlnet lists a model."""
        return f"{self.name} [{self.sha256[:8]}]"


class ControlNetLibrary:
    """The ControlNet folder: every subfolder holding model.onnx and config.json, hashed once per scan."""

    def __init__(self, folder: Path, unit_count: int = UNIT_COUNT) -> None:
        self.folder = folder
        self.unit_count = unit_count
        self.files: tuple[ControlNetFile, ...] = ()
        self.scan()

    def scan(self) -> tuple[ControlNetFile, ...]:
        found = []
        for sub in sorted(p for p in self.folder.iterdir() if p.is_dir()) if self.folder.is_dir() else []:
            model = sub / "model.onnx"
            if model.is_file() and (sub / "config.json").is_file():
                digest = hashlib.sha256()
                with model.open("rb") as f:
                    for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                        digest.update(chunk)
                found.append(ControlNetFile(sub.name, sub, digest.hexdigest()))
        self.files = tuple(found)
        return self.files

    def titles(self) -> list[str]:
        return [f.title for f in self.files]

    def resolve(self, model: str, field: str) -> ControlNetFile:
        """The file a unit's ``model`` names: ``name`` or ``name [hash8]`` (the hash must then match)."""
        name, _, tag = str(model).partition(" [")
        for f in self.files:
            if f.name == name and (not tag or f.sha256.startswith(tag.rstrip("]"))):
                return f
        raise InvalidRequestError(f"unknown ControlNet model {str(model)[:80]!r}; this server has "
                                  f"{self.titles() or 'none'} (GET /controlnet/model_list)", param=field)


@dataclass(frozen=True)
class ParsedUnit:
    """One enabled unit: what the engine runs and what the infotext says."""

    unit: ControlUnit
    infotext: str


def _choice(value: Any, names: tuple[str, ...], field: str, aliases: dict[str, str] | None = None) -> str:
    if isinstance(value, bool) or value is None:
        raise InvalidRequestError(f"{field} must be one of {list(names)} or its number", param=field)
    if isinstance(value, int | float) and float(value).is_integer():
        index = 0 if int(value) == 3 and names is RESIZE_MODES else int(value)  # 3: Just Resize (Latent upscale)
        if 0 <= index < len(names):
            return names[index]
    if isinstance(value, str) and (aliases or {}).get(value, value) in names:
        return (aliases or {}).get(value, value)
    raise InvalidRequestError(f"{field} {str(value)[:64]!r} is not one of {list(names)}", param=field)


def _number(unit: dict[str, Any], key: str, default: float, field: str) -> float:
    value = unit.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not np.isfinite(value):
        raise InvalidRequestError(f"{field}.{key} must be a number", param=f"{field}.{key}")
    return float(value)


def preprocess(module: str, image: np.ndarray, res: int, low: float, high: float, field: str) -> np.ndarray:
    """uint8 [H, W, 3] through ``module``; ``res`` (processor_res) sets the short side the detector sees."""
    if module == "none":
        return image
    if module == "invert":
        return np.ascontiguousarray(255 - image)
    if module == "canny":
        import cv2

        h, w = image.shape[:2]
        if res > 0 and min(h, w) != res:
            scale = res / min(h, w)
            size = (max(1, round(w * scale)), max(1, round(h * scale)))
            image = cv2.resize(image, size, interpolation=cv2.INTER_CUBIC if scale > 1 else cv2.INTER_AREA)
        edges = cv2.Canny(image, low, high)
        return np.ascontiguousarray(np.repeat(edges[:, :, None], 3, axis=2))
    raise InvalidRequestError(f"unknown ControlNet module {module[:64]!r}; this server has {sorted(MODULES)} "
                              "(GET /controlnet/module_list)", param=f"{field}.module")


def _image(value: Any, field: str, max_pixels: int) -> Image.Image:
    if isinstance(value, dict):
        if value.get("mask"):
            raise InvalidRequestError("a ControlNet mask (inpaint units) is not served", param=f"{field}.mask")
        value = value.get("image")
    if not isinstance(value, str) or not value:
        raise InvalidRequestError("a ControlNet unit needs an image (base64)", param=f"{field}.image")
    return from_base64(value, f"{field}.image", max_pixels).convert("RGB")


def parse_units(script: Any, library: ControlNetLibrary | None, width: int, height: int,
                max_pixels: int) -> tuple[ParsedUnit, ...]:
    """``alwayson_scripts.controlnet`` (``{"args": [unit, ...]}``) as the engine's units, disabled ones left out."""
    base = "alwayson_scripts.controlnet.args"
    args = script.get("args") if isinstance(script, dict) else None
    if not isinstance(args, list):
        raise InvalidRequestError("alwayson_scripts.controlnet needs args: a list of units", param=base)
    if library is None:
        raise InvalidRequestError("this server has no ControlNet folder (--controlnet-dir)", param=base)
    enabled = sum(1 for unit in args if not isinstance(unit, dict) or unit.get("enabled", True))
    if enabled > library.unit_count:  # clients pad to the count with disabled units: those are not counted
        raise InvalidRequestError(f"{enabled} enabled ControlNet units, over control_net_unit_count "
                                  f"{library.unit_count}", param=base)
    parsed = []
    for i, raw in enumerate(args):
        field = f"{base}[{i}]"
        if not isinstance(raw, dict):
            raise InvalidRequestError("a ControlNet unit must be an object", param=field)
        unit: dict[str, Any] = {LEGACY_KEYS.get(str(k), str(k)): v for k, v in raw.items()}
        if "mask" in unit or "mask_image" in unit:
            unit["image"] = {"image": unit.get("image"), "mask": unit.get("mask") or unit.get("mask_image")}
        if not unit.get("enabled", True):
            continue
        module = str(unit.get("module", "none"))
        if module not in MODULES:
            preprocess(module, np.zeros((1, 1, 3), np.uint8), 0, 0, 0, field)  # refuses naming the module
        net = library.resolve(str(unit.get("model", "None")), f"{field}.model")
        resize_mode = _choice(unit.get("resize_mode", 1), RESIZE_MODES, f"{field}.resize_mode", RESIZE_ALIASES)
        control_mode = _choice(unit.get("control_mode", 0), CONTROL_MODES, f"{field}.control_mode")
        if control_mode != "Balanced":
            raise InvalidRequestError(f"control_mode {control_mode!r} is not served (only Balanced)",
                                      param=f"{field}.control_mode")
        weight = _number(unit, "weight", 1.0, field)
        start, end = _number(unit, "guidance_start", 0.0, field), _number(unit, "guidance_end", 1.0, field)
        if not 0.0 <= start <= end <= 1.0:
            raise InvalidRequestError("guidance_start and guidance_end must satisfy 0 <= start <= end <= 1",
                                      param=f"{field}.guidance_start")
        image = _image(unit.get("image"), field, max_pixels)
        sliders = [s["value"] for s in MODULES[module]["sliders"]] + [0, 0, 0]
        res = _number(unit, "processor_res", -1, field)
        low, high = _number(unit, "threshold_a", -1, field), _number(unit, "threshold_b", -1, field)
        res, low, high = (v if v >= 0 else float(d) for v, d in zip((res, low, high), sliders, strict=False))
        if unit.get("pixel_perfect") is True:  # external_code.py pixel_perfect_resolution
            k = (min if resize_mode == "Resize and Fill" else max)(height / image.height, width / image.width)
            res = float(round(k * min(image.height, image.width)))
        detected = preprocess(module, np.asarray(image), int(res), low, high, field)
        fitted = resize(Image.fromarray(detected), width, height, RESIZE_MODES.index(resize_mode))  # type: ignore[arg-type]
        info = (f'ControlNet {i}: "Module: {module}, Model: {net.title}, Weight: {weight:g}, Resize Mode: '
                f"{resize_mode}, Processor Res: {int(res)}, Threshold A: {low:g}, Threshold B: {high:g}, Guidance "
                f'Start: {start:g}, Guidance End: {end:g}, Pixel Perfect: {unit.get("pixel_perfect") is True}, '
                f'Control Mode: {control_mode}"')
        parsed.append(ParsedUnit(ControlUnit(np.ascontiguousarray(np.asarray(fitted.convert("RGB"))), net.name,
                                             weight, start, end), info))
    return tuple(parsed)
