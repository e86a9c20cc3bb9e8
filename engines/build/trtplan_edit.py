"""What an instruction edit adds to a DiT's TensorRT profiles (engines/build/trtplan_dit.py): the reference images'
latent tokens in every image-token dim, the VAE encoder at the reference sizes, and Qwen-Image-Edit's vision tower
and image-carrying text encoder.

The reference sizes do not follow the served size: each pipeline encodes its input images at a size of its own
(engines/pipelines/kontext.py ``reference_size``: the preferred-resolution table; qwen_edit.py ``reference_sizes``:
1024² at each image's aspect; flux2_refs.py ``reference_size``: the input scaled down to 1024² and floored), so
every served size's engine spans the txt2img shapes (no references) to the most reference tokens the pipeline can
add (its most input images at their largest encoded size). The sizes are computed with the pipelines' own
functions over the input aspects they take: FLUX.1 Kontext maps every aspect onto its table; FLUX.2 refuses aspects
past ``MAX_ASPECT`` (8:1); Qwen-Image-Edit sets no limit, so its plan covers aspects up to ``EDIT_ASPECT_MAX``
(recorded in the plan: a wider input would fit no profile).

Where the joined tokens go (engines/pipelines/flow_extra.py): after the noisy ones in ``hidden_states`` [rows,
tokens, C] (Kontext, Qwen-Image-Edit) and in the rotary tables (text + noisy + reference tokens); Qwen-Image-Edit
2511's ``modulate_index`` [noisy + reference tokens]; FLUX.2's 4-D latents become a one-row image [rows, C, 1, h·w
+ R] (flux2_refs.py ``LatentJoin``), so its grid height runs 1..h and its width w..h·w + R.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from engines import architectures
from engines.pipelines.flow_family import DitFamily

EDIT_ASPECT_MAX = 8.0
"""The widest input aspect (either way) Qwen-Image-Edit's plan covers; FLUX.2's own limit, as the pipeline takes
any aspect."""
RATIOS = np.exp(np.linspace(-math.log(EDIT_ASPECT_MAX), math.log(EDIT_ASPECT_MAX), 20001))
"""Input aspects (w / h) the bounds are searched over: the encoded sizes change every ~3% of aspect (one 32-pixel
step at 1024²), far coarser than this grid."""
PROBE_AREA = 4 * 1024 * 1024
"""The input area the aspects are probed at: above every pipeline's downscale threshold (its largest encoding)."""


def _inputs() -> list[tuple[int, int]]:
    """(width, height) input sizes at every probed aspect, ``PROBE_AREA`` pixels each."""
    return [(max(1, round(math.sqrt(PROBE_AREA * r))), max(1, round(math.sqrt(PROBE_AREA / r)))) for r in RATIOS]


def _bounds(sizes: list[tuple[int, int]], multiple: int, images: int) -> dict[str, int]:
    tokens = [(w // multiple) * (h // multiple) for w, h in sizes]
    sides = [s for size in sizes for s in size]
    return {"ref_images": images, "ref_tokens": images * max(tokens), "ref_tokens_one": max(tokens),
            "ref_side_min": min(sides), "ref_side_max": max(sides)}


def edit_module(family: DitFamily) -> ModuleType | None:
    """The module defining the family's reference hooks: the first class in its pipeline's MRO whose module has
    ``reference_sizes`` and ``REFERENCES`` (engines/pipelines/kontext.py, qwen_edit.py, flux2_refs.py); None for
    a pipeline without instruction edits."""
    cls = architectures.get(family.base).pipeline_class()
    for base in getattr(cls, "__mro__", ()):
        module = sys.modules.get(base.__module__)
        if module is not None and hasattr(module, "reference_sizes") and hasattr(module, "REFERENCES"):
            return module
    return None


def references(family: DitFamily, folder: Path, multiple: int) -> dict[str, int]:
    """The reference bounds of an instruction-edit folder ({} for one that serves no instruction edits: no VAE
    encoder, or a pipeline without references): ``ref_tokens`` (the most tokens the references add to a row),
    ``ref_side_min``/``ref_side_max`` (pixels the VAE encoder sees), and, for a pipeline with a vision tower
    (Qwen-Image-Edit), its bounds. The encoded sizes are the pipeline module's own ``reference_sizes`` over every
    probed aspect within its ``MAX_ASPECT`` (else ``EDIT_ASPECT_MAX``), and its ``MIN_SIDE`` square."""
    module = edit_module(family)
    if module is None or not (folder / "vae_encoder" / "model.onnx").is_file():
        return {}
    aspect = float(getattr(module, "MAX_ASPECT", EDIT_ASPECT_MAX))
    probes = [(w, h) for w, h in _inputs() if max(w / h, h / w) <= aspect]
    if hasattr(module, "MIN_SIDE"):
        probes.append((int(module.MIN_SIDE), int(module.MIN_SIDE)))
    sizing = module.reference_sizes
    kwargs = {"multiple": multiple} if "multiple" in inspect.signature(sizing).parameters else {}
    bounds = _bounds(list(sizing(tuple(probes), **kwargs)), multiple, int(module.REFERENCES))
    return {**bounds, **(qwen_vision(folder) if hasattr(module, "VisionInputs") else {})}


def qwen_condition_patches(folder: Path, width: int, height: int) -> int:
    """The vision tower's patches for one input image of ``width`` x ``height``: resized to 384² at its aspect, then
    the Qwen2-VL processor's ``smart_resize`` (engines/pipelines/qwen_edit.py ``VisionInputs``)."""
    return _patch_counter(folder)(width, height)


def _patch_counter(folder: Path) -> Callable[[int, int], int]:
    """``qwen_condition_patches`` with the folder's processor and vision configs read once."""
    from engines.pipelines import qwen_edit
    from engines.pipelines.unet_family import read_json

    processor = read_json(folder / "processor" / "preprocessor_config.json")
    vision = read_json(folder / "vision" / "config.json")
    patch, merge = int(vision["patch_size"]), int(vision["spatial_merge_size"])
    size = processor.get("size") or {}
    low = int(processor.get("min_pixels") or size.get("shortest_edge", 56 * 56))
    high = int(processor.get("max_pixels") or size.get("longest_edge", 28 * 28 * 1280))

    def count(width: int, height: int) -> int:
        w, h = qwen_edit.calculate_dimensions(qwen_edit.CONDITION_AREA, width / height)
        h, w = qwen_edit.smart_resize(h, w, patch * merge, low, high)
        return (h // patch) * (w // patch)
    return count


def qwen_vision(folder: Path) -> dict[str, int]:
    """Qwen-Image-Edit's vision tower and text encoder bounds: patches per image (min, square, max), merged
    tokens per image (4 patches each), and the text encoder's ids and image embeddings."""
    from engines.pipelines import qwen_edit
    from engines.pipelines.unet_family import read_json

    merge = int(read_json(folder / "vision" / "config.json")["spatial_merge_size"]) ** 2
    count = _patch_counter(folder)
    patches = sorted({count(w, h) for w, h in _inputs()})
    square = count(1024, 1024)
    images = qwen_edit.REFERENCES
    return {"patches_min": patches[0], "patches_opt": square, "patches_max": patches[-1],
            "embed_tokens_min": 1, "embed_tokens_opt": square // merge,
            "embed_tokens_max": images * patches[-1] // merge,
            "edit_ids_min": qwen_edit.EDIT_DROP + 1, "edit_ids_opt": qwen_edit.EDIT_DROP + 128 + square // merge,
            "edit_ids_max": qwen_edit.EDIT_DROP + qwen_edit.MAX_SEQUENCE_LENGTH, "merge": merge}


QWEN_EDIT_ROLES: dict[tuple[str, str], tuple[str, ...]] = {
    ("text_encoder", "input_ids"): ("one", "edit_ids"),
    ("text_encoder", "image_embeds"): ("embed_tokens", ""),
    ("text_encoder", "position_ids"): ("", "one", "edit_ids"),
    ("vision", "pixel_values"): ("patches", ""),
    ("vision", "window_index"): ("merged",),
    ("vision", "rope_cos"): ("patches", ""), ("vision", "rope_sin"): ("patches", ""),
    ("vision", "window_mask"): ("patches", "patches"),
}
"""Qwen-Image-Edit's text encoder runs one row per call (each prompt with its images' embeddings on its pad
tokens, engines/pipelines/qwen_edit.py ``_states``); its vision tower one image per call. "" marks a dim fixed in
the graph."""


def edit_values(base: dict[str, int | None], values: dict[str, int | None], bound: str) -> dict[str, int | None]:
    """``values`` (trtplan_dit.values at one bound) with the references' bounds applied: the max bound adds the most
    reference tokens, the opt bound one input image's (an edit model's usual request), the min bound none (txt2img);
    the VAE encoder spans the reference sides; FLUX.2's joined grid (one row at min and opt)."""
    if not base.get("ref_tokens"):
        return values
    out = dict(values)
    h, w = int(values["height"] or 0), int(values["width"] or 0)
    pack = int(base.get("pack") or 2)
    if bound == "max":
        refs = int(base["ref_tokens"] or 0)
        for key in ("image_tokens", "padded_image_tokens", "rope_tokens"):
            out[key] = int(values[key] or 0) + refs
        out["grid_width"] = h * w + refs if pack == 1 else w
        out["pixel_height"] = max(int(values["pixel_height"] or 0), int(base["ref_side_max"] or 0))
        out["pixel_width"] = max(int(values["pixel_width"] or 0), int(base["ref_side_max"] or 0))
    elif bound == "opt":  # tuned for an edit with one input image (what an edit model mostly serves)
        one = int(base["ref_tokens_one"] or 0)
        for key in ("image_tokens", "padded_image_tokens", "rope_tokens"):
            out[key] = int(values[key] or 0) + one
        if pack == 1:
            out["grid_height"], out["grid_width"] = 1, h * w + one
    elif bound == "min":
        out["grid_height"] = 1 if pack == 1 else h
        out["pixel_height"] = min(int(values["pixel_height"] or 0), int(base["ref_side_min"] or 0))
        out["pixel_width"] = min(int(values["pixel_width"] or 0), int(base["ref_side_min"] or 0))
    if "patches_min" in base:
        out.update({k: base.get(f"{k}_{bound}") for k in ("patches", "embed_tokens", "edit_ids")})
        out["merged"] = int(out["patches"] or 0) // int(base["merge"] or 4)
        out["one"] = 1
    return out
