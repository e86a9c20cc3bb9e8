"""What ControlNet adds to a model's memory (engines/health/memory_plan.py, request_memory.py; issue 56).

Served ControlNet (engines/pipelines/controlnet.py ``attach``, only when ``[runtime.controlnet] dir`` is set) loads:

- **the UNet's residual variant** ``unet_controlnet/model.onnx`` (engines/build/controlnet.py) beside the plain
  ``unet/``: a second UNet-sized component, its weights and (one TensorRT context each) its activations;
- **every ControlNet** of the folder (``<dir>/<name>/model.onnx``), each its own session: its weights from its file
  (engines/health/onnx_scan.py ``scan_onnx``: the protobuf's headers, never the bytes); a ControlNet is a UNet's
  down half and mid block, so its activations are counted with the UNet rule on its own config;
- **the residuals** of every controlled evaluation: per residual level (``residual_levels``) rows × channels ×
  (h / f) × (w / f) at the residual UNet's input type, where h × w are the latents and f the level's downsampling;
  the sets alive grow with the units as FLUX.1's below (``residual_sets``: the pipeline's ``control_res{k % 2}``
  outputs and ``control_sum{k % 2}`` sums are cached buffers, so all it touched stay held).

FLUX.1 (``transformer_controlnet/``, engines/pipelines/controlnet_dit.py) counts the residual transformer as a
second transformer session and each ControlNet as one, and its residuals: one ``[rows, image_tokens, inner]``
tensor per transformer block (double and single) per set, at the residual inputs' own type (the graph's: an fp16
or bf16 export takes fp32 residuals behind its casts), ``inner`` = heads x head dim. A set has at most one tensor
per block (a ControlNet with fewer samples shares them across blocks; units of several depths are summed per
block). The sets the pipeline's buffers keep grow with the units (``residual_sets``): one unit's outputs; with two, the
second's and their sum; from three, two output and two sum sets alternating. The plan counts the most (any number
of units); a request, its own units.

A ControlNet folder that is no ControlNet (no model.onnx or config.json) is left out here as at load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

MOST_SETS = 4
"""Residual sets a controlled evaluation holds with three units or more (engines/pipelines/controlnet.py and
controlnet_dit.py ``run``: two alternating output sets and two alternating sum sets, each a cached buffer)."""
VARIANT = "unet_controlnet"


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def nets(controlnet_dir: str | Path | None) -> dict[str, Path]:
    """name -> folder of every ControlNet under ``controlnet_dir`` (a subfolder with model.onnx and config.json),
    sorted; {} when none is configured."""
    if not controlnet_dir:
        return {}
    root = Path(controlnet_dir)
    if not root.is_dir():
        return {}
    return {p.name: p for p in sorted(root.iterdir())
            if (p / "model.onnx").is_file() and (p / "config.json").is_file()}


def residual_bytes(unet_config: dict[str, Any], width: int, height: int, rows: int, factor: int, item: int) -> int:
    """Bytes of one set of ControlNet residuals for ``rows`` UNet rows at ``width`` x ``height`` pixels: the sum
    over the residual levels of rows × channels × (h / f) × (w / f) × ``item``, as the pipeline's buffers hold
    them (engines/pipelines/controlnet.py ``run``); 0 for a config without the UNet's block layout."""
    if not isinstance(unet_config.get("block_out_channels"), list) or \
            not isinstance(unet_config.get("layers_per_block"), int):
        return 0
    from engines.pipelines.controlnet import residual_levels

    h, w = height // factor, width // factor
    return sum(rows * channels * (h // f) * (w // f) * item for channels, f in residual_levels(unet_config))


def request_bytes(unet_config: dict[str, Any], width: int, height: int, rows: int, factor: int, item: int,
                  units: int | None = None) -> int:
    """The residual bytes a controlled request holds: the sets ``units`` keep (None: the most, ``residual_sets``)
    of an SD UNet's residuals, or of a FLUX.1 transformer config's (``residual_config``)."""
    if FLUX_KEY in unet_config:
        return residual_sets(units) * flux_residual_bytes(unet_config, width, height, rows, factor,
                                                          int(unet_config.get(ITEM_KEY) or item))
    return residual_sets(units) * residual_bytes(unet_config, width, height, rows, factor, item)


DIT_VARIANT = "transformer_controlnet"
"""FLUX.1's residual transformer (engines/pipelines/controlnet_dit.py): one residual input per block."""
FLUX_KEY, ITEM_KEY = "num_single_layers", "_residual_itemsize"
"""A FLUX.1 transformer config is told by its single blocks; ``residual_config`` adds the residuals' item size."""


def residual_sets(units: int | None) -> int:
    """Residual sets an evaluation with ``units`` units keeps (engines/pipelines/controlnet.py ``control_res{k % 2}``
    and controlnet_dit.py ``flux_control_res{k % 2}`` per unit, their ``..._sum{k % 2}`` from the second unit): 1, 3,
    then 4; None: the most."""
    if units is None:
        return MOST_SETS
    return 0 if units <= 0 else min(MOST_SETS, 2 * units - 1)


def flux_residual_bytes(config: dict[str, Any], width: int, height: int, rows: int, factor: int, item: int) -> int:
    """One set of FLUX.1 residuals: one ``[rows, tokens, inner]`` tensor per double and single block, ``tokens``
    the 2x2-packed latents of ``width`` x ``height`` at the VAE's ``factor``."""
    tokens = (height // factor // 2) * (width // factor // 2)
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    blocks = int(config["num_layers"]) + int(config[FLUX_KEY])
    return blocks * rows * tokens * inner * item


def residual_config(folder: Path) -> dict[str, Any]:
    """The config a controlled request's residuals are priced by (RequestMemory.controlnet): the residual UNet's,
    or FLUX.1's transformer config with the residual inputs' item size; {} without a residual variant."""
    if (folder / VARIANT / "model.onnx").is_file():
        return unet_config(folder)
    path = folder / DIT_VARIANT / "model.onnx"
    config = _json(folder / DIT_VARIANT / "config.json") or _json(folder / "transformer" / "config.json")
    if not path.is_file() or FLUX_KEY not in config:
        return {}
    return {**config, ITEM_KEY: residual_itemsize(path)}


def residual_itemsize(path: Path) -> int:
    """Bytes per element of the residual transformer's first block residual input, read from the graph."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(path), load_external_data=False).graph
    elem = next(i.type.tensor_type.elem_type for i in graph.input if i.name.startswith("block_residual_"))
    return int(tensor_dtype_to_np_dtype(elem).itemsize)


def variant(folder: Path, controlnet_dir: str | Path | None) -> str:
    """The residual denoiser ControlNet is served with on ``folder`` ("" when none is configured or present)."""
    if not controlnet_dir:
        return ""
    return next((v for v in (VARIANT, DIT_VARIANT) if (folder / v / "model.onnx").is_file()), "")


def unet_config(folder: Path) -> dict[str, Any]:
    """The residual UNet's config (its own, else the plain UNet's: the variant is the same network)."""
    return _json(folder / VARIANT / "config.json") or _json(folder / "unet" / "config.json")


def plan_parts(folder: Path, lay: Any, served_as: Any, dtype: str | None, controlnet_dir: str | Path | None,
               component: Callable[..., Any], itemsize: dict[str, int]) -> tuple[list[Any], dict[str, Any]]:
    """The memory plan's ControlNet components (the residual UNet as ``unet_controlnet``, each ControlNet as
    ``controlnet:<name>``) and its ``controlnet`` section (what is served, the residual bytes at the served shape);
    no components when ControlNet is not served. ``component`` and ``itemsize``: engines/health/memory_plan.py's
    ``component`` and ``ITEMSIZE`` (passed in: that module imports this one)."""
    from dataclasses import replace

    found = nets(controlnet_dir)
    section: dict[str, Any] = {"served": False, "dir": str(controlnet_dir or ""), "nets": sorted(found),
                               "residual_bytes": 0, "residual_sets": MOST_SETS, "note": ""}
    if not controlnet_dir:
        return [], section
    name = variant(folder, controlnet_dir)
    if not name:
        section["note"] = (f"{folder.name} has no {VARIANT}/model.onnx: ControlNet is not served on it (export "
                           "the model with `sdserve engines export --controlnet`)")
        return [], section
    kind = lay.parts.get("unet") or lay.parts.get("transformer", "unet")
    residual = component(folder, name, kind, lay, served_as, dtype)
    parts = [residual, *(replace(component(path.parent, net, kind, lay, served_as, dtype), name=f"controlnet:{net}")
                         for net, path in found.items())]
    rows = served_as.images * (2 if lay.cfg else 1)
    section["served"] = True
    section["residual_bytes"] = request_bytes(residual_config(folder), served_as.width, served_as.height, rows,
                                              lay.factor, itemsize[residual.dtype])
    return parts, section
