"""ControlNet on A1111's routes as sd-webui-controlnet defines it (issue 56): the library of exported ControlNets
(``name [hash8]`` as the extension lists them; only those the engine loaded once it has, a file it refused is not
listed), the preprocessors (server/controlnet_modules.py: the model-free ones, and ONNX annotator files in the
folder's ``annotators/``) and the ``alwayson_scripts.controlnet.args`` units parsed as its ``external_code.py``
``to_processing_unit`` does: the legacy keys (``input_image``, ``guidance``), ``image`` as base64, ``{"image",
"mask"}`` or absent, ``resize_mode`` and ``control_mode`` by name or number, ``pixel_perfect``. The OpenAI
routes' ``controlnet`` field (openai_units) is a list of the same units.

Provenance: each unit's control image as sent is a C2PA ingredient (``inputTo``: an input to the model) carrying the
ControlNet's name and the SHA-256 of its model.onnx (record_control).

What is refused (422 naming the field): an unknown model or module (listing what exists), more units than
``control_net_unit_count``, a control mode other than Balanced (its soft injection is not served: ignoring it
would change the image), a mask on a module other than the inpaint ones, the reference modules (attention hooks).

Inpaint units (``inpaint_global_harmonious``, alias ``inpaint``, and ``inpaint_only``) take the unit's mask (``mask``
or ``image: {"image", "mask"}``) or, on img2img inpainting, the request's: the hint is the image with its masked
pixels -1 (ControlUnit.hint_mask, engines/pipelines/controlnet.py). A unit without an image takes img2img's init
image (sd-webui-controlnet's ``choose_input_image``): the pipeline runs its preprocessor on the batch's init image,
and refuses it on txt2img (422 naming the unit's ``image``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError
from engines.types.request import Batch, ControlUnit
from server.controlnet_modules import INPAINT, MODEL_FREE, Annotators, canonical, preprocess, with_defaults
from server.images_in import decode, from_base64_bytes, resize
from server.provenance_stage import ingredient

API_VERSION = 2
"""sd-webui-controlnet's ``get_api_version()``."""
UNIT_COUNT = 3
"""``control_net_unit_count``'s default in sd-webui-controlnet."""
RESIZE_MODES = ("Just Resize", "Crop and Resize", "Resize and Fill")
RESIZE_ALIASES = {"Inner Fit (Scale to Fit)": "Crop and Resize", "Outer Fit (Shrink to Fit)": "Resize and Fill",
                  "Scale to Fit (Inner Fit)": "Crop and Resize", "Envelope (Outer Fit)": "Resize and Fill"}
CONTROL_MODES = ("Balanced", "My prompt is more important", "ControlNet is more important")
LEGACY_KEYS = {"guessmode": "guess_mode", "guidance": "guidance_end", "lowvram": "low_vram", "input_image": "image"}
MODULES = MODEL_FREE
"""The preprocessors served without a file (server/controlnet_modules.py; annotator files add to them)."""
__all__ = ["MODULES", "preprocess"]
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
        self.annotators = Annotators(folder)
        """The model-based preprocessors: ``annotators/<module>.onnx`` (server/controlnet_modules.py)."""
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

    def titles(self, served: set[str] | None = None) -> list[str]:
        """``name [hash8]`` of each file; with ``served`` (served_names), only the ones the engine loaded."""
        return [f.title for f in self.files if served is None or f.name in served]

    def resolve(self, model: str, field: str, served: set[str] | None = None) -> ControlNetFile:
        """The file a unit's ``model`` names: ``name`` or ``name [hash8]`` (the hash must then match); with
        ``served``, a file the engine refused at load is unknown too."""
        name, _, tag = str(model).partition(" [")
        for f in self.files:
            if f.name == name and (not tag or f.sha256.startswith(tag.rstrip("]"))) and (
                    served is None or f.name in served):
                return f
        raise InvalidRequestError(f"unknown ControlNet model {str(model)[:80]!r}; this server has "
                                  f"{self.titles(served) or 'none'} (GET /controlnet/model_list)", param=field)


_SERVED: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
"""Per engine, the ControlNets it serves once its self-test ran (the ControlNet canary refuses nets then): they
are attached at load only, so the capability snapshot is not rebuilt for every ControlNet request and listing."""


def served_names(engine: Any) -> set[str] | None:
    """The ControlNets the engine loaded: its sessions ``controlnet_<name>`` (``@<size>`` per prebuilt size;
    engines/pipelines/controlnet.py names them so). None without an engine (nothing to filter by)."""
    capabilities = getattr(engine, "capabilities", None)
    if capabilities is None:
        return None
    try:
        known = _SERVED.get(engine)
    except TypeError:  # an engine object that cannot be a weak key: read it every time
        known = None
    if known is not None:
        return set(known)
    snapshot = capabilities()
    names = frozenset(name.split("@")[0].removeprefix("controlnet_") for name in snapshot.sessions
                      if name.startswith("controlnet_"))
    if names and snapshot.self_test is not None:  # before the self-test ran, its ControlNet canary may refuse some
        with contextlib.suppress(TypeError):
            _SERVED[engine] = names
    return set(names)


@dataclass(frozen=True)
class ParsedUnit:
    """One enabled unit: what the engine runs and what the infotext says."""

    unit: ControlUnit
    infotext: str
    ingredient: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The control image as sent, as a C2PA ingredient with the ControlNet's name and model hash."""


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


def _image(value: Any, field: str, max_pixels: int,
           inpaint: str) -> tuple[Image.Image | None, bytes, np.ndarray | None]:
    """The unit's image (None: absent, the init image on img2img), its bytes as sent (base64 or a data URL) and, for
    an inpaint module, its mask's first channel (``{"image", "mask"}``; None: the request's mask on img2img)."""
    mask = None
    if isinstance(value, dict):
        if value.get("mask") and not inpaint:
            raise InvalidRequestError("a ControlNet mask is served with the inpaint modules only "
                                      "(inpaint_global_harmonious, inpaint_only)", param=f"{field}.mask")
        if value.get("mask"):
            mask = np.asarray(decode(from_base64_bytes(value["mask"], f"{field}.mask"), f"{field}.mask",
                                     max_pixels).convert("RGB"))[:, :, 0]
        value = value.get("image")
    if value is None or value == "":
        return None, b"", mask
    if not isinstance(value, str):
        raise InvalidRequestError("a ControlNet unit's image must be base64 text", param=f"{field}.image")
    data = from_base64_bytes(value, f"{field}.image")
    return decode(data, f"{field}.image", max_pixels).convert("RGB"), data, mask


def parse_units(script: Any, library: ControlNetLibrary | None, width: int, height: int,
                max_pixels: int, served: set[str] | None = None,
                base: str = "alwayson_scripts.controlnet.args") -> tuple[ParsedUnit, ...]:
    """``alwayson_scripts.controlnet`` (``{"args": [unit, ...]}``) as the engine's units, disabled ones left out;
    ``served``: the ControlNets the engine loaded (served_names), ``base``: the field the errors name."""
    args = script.get("args") if isinstance(script, dict) else None
    if not isinstance(args, list):
        raise InvalidRequestError(f"{base.removesuffix('.args')} needs args: a list of units", param=base)
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
        module = canonical(str(unit.get("module", "none")))
        if module not in MODULES and module not in library.annotators.files():
            preprocess(module, np.zeros((1, 1, 3), np.uint8), 0, 0, 0, field, library.annotators)  # refused by name
        net = library.resolve(str(unit.get("model", "None")), f"{field}.model", served)
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
        inpaint = INPAINT.get(module, "")
        image, data, mask = _image(unit.get("image"), field, max_pixels, inpaint)
        res, low, high = with_defaults(module, _number(unit, "processor_res", -1, field),
                                       _number(unit, "threshold_a", -1, field),
                                       _number(unit, "threshold_b", -1, field), library.annotators)
        size = (image.width, image.height) if image is not None else (width, height)  # the init image: the batch's
        if unit.get("pixel_perfect") is True:  # external_code.py pixel_perfect_resolution
            k = (min if resize_mode == "Resize and Fill" else max)(height / size[1], width / size[0])
            res = float(round(k * min(size)))
        run = _preprocessor(module, int(res), low, high, field, library)
        fitted = np.zeros((0, 0, 3), np.uint8) if image is None else np.asarray(resize(
            Image.fromarray(run(np.asarray(image))), width, height, RESIZE_MODES.index(resize_mode)).convert("RGB"))  # type: ignore[arg-type]
        hint_mask = None if mask is None else _fit_mask(mask, image, width, height, resize_mode, field)
        info = (f'ControlNet {i}: "Module: {module}, Model: {net.title}, Weight: {weight:g}, Resize Mode: '
                f"{resize_mode}, Processor Res: {int(res)}, Threshold A: {low:g}, Threshold B: {high:g}, Guidance "
                f'Start: {start:g}, Guidance End: {end:g}, Pixel Perfect: {unit.get("pixel_perfect") is True}, '
                f'Control Mode: {control_mode}"')
        source = {**ingredient(data, f"{field}.image", "inputTo"),
                  "controlnet": {"unit": i, "model": net.name, "sha256": net.sha256, "module": module}} if data else {}
        parsed.append(ParsedUnit(ControlUnit(np.ascontiguousarray(fitted), net.name, weight, start, end,
                                             union_mode(module), hint_mask, inpaint,  # type: ignore[arg-type]
                                             run if image is None else None, field), info, source))
    return tuple(parsed)


def _preprocessor(module: str, res: int, low: float, high: float, field: str,
                  library: ControlNetLibrary) -> Callable[[np.ndarray], np.ndarray]:
    """The unit's preprocessor on a uint8 [H, W, 3] image (the unit's, or img2img's init image in the pipeline)."""
    return lambda pixels: preprocess(module, pixels, res, low, high, field, library.annotators)


def _fit_mask(mask: np.ndarray, image: Image.Image | None, width: int, height: int, resize_mode: str,
              field: str) -> np.ndarray:
    """An inpaint unit's mask fitted to the output as its image is (the same resize mode), binarized as
    sd-webui-controlnet's ``high_quality_resize`` does (> 127): bool [height, width], True where masked."""
    size = (image.width, image.height) if image is not None else (width, height)
    if mask.shape != (size[1], size[0]):
        raise InvalidRequestError(f"the ControlNet mask is {mask.shape[1]}x{mask.shape[0]}, its image "
                                  f"{size[0]}x{size[1]}: send them at one size", param=f"{field}.mask")
    fitted = resize(Image.fromarray(mask).convert("RGB"), width, height, RESIZE_MODES.index(resize_mode))  # type: ignore[arg-type]
    return np.asarray(fitted)[:, :, 0] > 127


UNION_MODES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "openpose": 4}
"""A1111 preprocessor (its name's first word) -> InstantX FLUX.1 Union control type (canny 0, tile 1, depth 2,
blur 3, pose 4, gray 5, low quality 6): the unit's control type on a union ControlNet."""


def union_mode(module: str) -> int | None:
    """The union control type a unit's ``module`` makes (``depth_midas`` -> depth 2, ``tile_resample`` -> tile 1), or
    None where none fits (the ControlNet's first type, canny, as diffusers' default)."""
    return UNION_MODES["openpose"] if "openpose" in module else UNION_MODES.get(module.split("_")[0])


def openai_units(value: Any, field: str = "controlnet") -> dict[str, Any]:
    """The OpenAI routes' ``controlnet`` extension field (a list of units; on the multipart edits route, that list
    as JSON text) as an ``alwayson_scripts.controlnet`` script: the same keys as an A1111 unit (``image`` as base64
    or a data URL, ``model``, ``module``, ``weight``, ``guidance_start``/``guidance_end``, ``processor_res``,
    ``threshold_a``/``threshold_b``, ``resize_mode``, ``pixel_perfect``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidRequestError(f"{field} must be a JSON list of ControlNet units", param=field) from None
    if not isinstance(value, list):
        raise InvalidRequestError(f"{field} must be a list of ControlNet units", param=field)
    return {"args": value}


def openai_control(request: Any, value: Any, batch: Batch, hires: bool = False,
                   field: str = "controlnet") -> Batch:
    """``batch`` with the units of an OpenAI route's ``controlnet`` field (at the batch's size), their control
    images recorded for provenance. Refused naming ``field``: no ControlNet folder, a size served through Hires
    fix (as A1111's enable_hr with units)."""
    library = getattr(request.app.state, "controlnets", None)
    if not isinstance(library, ControlNetLibrary):
        raise InvalidRequestError("this server has no ControlNet folder (--controlnet-dir)", param=field)
    if hires:
        raise InvalidRequestError("ControlNet units at a size served through Hires fix are not served yet: ask a "
                                  "served size", param=field)
    units = parse_units(openai_units(value, field), library, batch.width, batch.height,
                        request.app.state.settings.limits.max_image_pixels,
                        served_names(getattr(request.app.state, "engine", None)), base=field)
    if not units:
        return batch
    record_control(request, units)
    return dataclasses.replace(batch, control=tuple(u.unit for u in units))


def record_control(request: Any, units: tuple[ParsedUnit, ...]) -> None:
    """Add the units' control images to the request's provenance ingredients (server/provenance_stage.py
    record_inputs): every image of the request was made under the same control, so each image's list gets them."""
    extra = [u.ingredient for u in units if u.ingredient]
    if not extra:
        return
    current: list[list[dict[str, Any]]] = getattr(request.state, "provenance_inputs", None) or [[]]
    request.state.provenance_inputs = [[*inputs, *extra] for inputs in current]


def script_info(unit_count: int) -> list[dict[str, Any]]:
    """``/sdapi/v1/script-info``'s entries for sd-webui-controlnet's script: always on, on txt2img and img2img, one
    argument per unit (A1111's ScriptArg fields)."""
    args = [{"label": f"ControlNet Unit {i}", "value": None, "minimum": None, "maximum": None, "step": None,
             "choices": None} for i in range(unit_count)]
    return [{"name": "controlnet", "is_alwayson": True, "is_img2img": img2img, "args": args}
            for img2img in (False, True)]
