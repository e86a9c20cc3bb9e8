"""What ControlNet adds to a model's memory (engines/health/memory_plan.py, request_memory.py; issue 56).

Served ControlNet (engines/pipelines/controlnet.py ``attach``, only when ``[runtime.controlnet] dir`` is set) loads:

- **the UNet's residual variant** ``unet_controlnet/model.onnx`` (engines/build/controlnet.py) beside the plain
  ``unet/``: a second UNet-sized component, its weights and (one TensorRT context each) its activations;
- **every ControlNet** of the folder (``<dir>/<name>/model.onnx``), each its own session: its weights from its file
  (engines/health/onnx_scan.py ``scan_onnx``: the protobuf's headers, never the bytes); a ControlNet is a UNet's
  down half and mid block, so its activations are counted with the UNet rule on its own config;
- **the residuals** of every controlled evaluation: per residual level (``residual_levels``) rows × channels ×
  (h / f) × (w / f) at the residual UNet's input type, where h × w are the latents and f the level's downsampling;
  the pipeline keeps two sets alive at once (each unit's outputs and the running sum, ``control_res{k % 2}``).

A ControlNet folder that is no ControlNet (no model.onnx or config.json) is left out here as at load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESIDUAL_SETS = 2
"""Residual sets alive at once during a controlled evaluation (engines/pipelines/controlnet.py ``run``: one unit's
outputs and the sum of the units before it, in two alternating buffer sets)."""
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


def request_bytes(unet_config: dict[str, Any], width: int, height: int, rows: int, factor: int, item: int) -> int:
    """The residual bytes a controlled request holds: ``RESIDUAL_SETS`` sets."""
    return RESIDUAL_SETS * residual_bytes(unet_config, width, height, rows, factor, item)


DIT_VARIANT = "transformer_controlnet"
"""FLUX.1's residual transformer (engines/pipelines/controlnet_dit.py): its weights and its ControlNets' are counted;
its per-block residuals are not (yet): the plan's note says so."""


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
                               "residual_bytes": 0, "residual_sets": RESIDUAL_SETS, "note": ""}
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
    if name == VARIANT:
        section["residual_bytes"] = request_bytes(unet_config(folder), served_as.width, served_as.height, rows,
                                                  lay.factor, itemsize[residual.dtype])
    else:
        section["note"] = f"the per-block residuals of {DIT_VARIANT} are not counted"
    return parts, section
