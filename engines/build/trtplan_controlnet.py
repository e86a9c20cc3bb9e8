"""TensorRT plans of the ControlNets a model serves (``--controlnet-dir``; issue 56): SD 1.x / SDXL ControlNets
(engines/build/trtplan.py ``controlnet_plan``) and FLUX.1's (``flux_controlnet_plan`` here), and what
`sdserve engines build --controlnet-dir DIR` prints and builds beside the model's own plan.

A FLUX.1 ControlNet (engines/build/controlnet_dit.py: ``FluxControlNetModel``, the InstantX kind and its union kind)
runs on every transformer row with the transformer's own inputs: the packed latents ``[rows, image_tokens, 64]``,
the text states, pooled projections, timestep and guidance, plus the control latents packed as the latents are
(``controlnet_cond``: same shape), one scale per row and, for the union kind, ``controlnet_mode`` ``[rows, 1]``;
its rope tables cover the text and image tokens, and one more text token for the union kind's mode embedding
(engines/pipelines/controlnet_dit.py ``union_rope``). The profile bounds are the DiT plan's
(engines/build/trtplan_dit.py): min one image, opt and max at the served batch; the model's residual transformer
``transformer_controlnet/`` is a component of the model's own plan (``trtplan.plan``).

Each ControlNet's plan is shaped as the model's (component ``controlnet``, source ``model.onnx``, every path
relative to the ControlNet's folder: its engines live in ``<net>/trt/<WxH>/`` as the model's live in its folder).
A ControlNet for another base is refused by name and left out, as the server leaves it out at load; a plan whose
options ORT's Python parser refuses builds nothing (``require_parsed``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from engines.artifacts import TRT_DIR
from engines.build import trtplan
from engines.build.trtplan import ENGINE_CACHE, BuildFlags, ShapeProfile, graph_inputs, record, rows
from engines.errors import ArtifactError
from engines.health.trt_coverage import RECORD

log = logging.getLogger(__name__)
COMPONENT = "controlnet"
FLUX_NET = "FluxControlNetModel"
"""The diffusers class (config.json ``_class_name``) of a FLUX.1 ControlNet."""


def _config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def flux_controlnet_plan(net_dir: Path, model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags,
                         device_id: int = 0) -> dict[str, Any]:
    """A FLUX.1 ControlNet's plan for the FLUX.1 model ``model_dir`` (ArtifactError naming it when it does not fit:
    another base, other widths, XLabs' pixel-hint kind, guidance the transformer does not take)."""
    from engines.build import trtplan_dit
    from engines.pipelines.controlnet_dit import unfit

    dit = trtplan._dit_family(model_dir)
    config = _config(net_dir / "config.json")
    transformer = _config(model_dir / "transformer" / "config.json")
    why = unfit(net_dir.name, config, transformer) if dit is not None else \
        f"ControlNet {net_dir.name} is a FLUX.1 ControlNet, {model_dir.name} is no FLUX.1 model (another base)"
    if not why and not (model_dir / trtplan_dit.CONTROLLED / "model.onnx").is_file():  # exported for FLUX.1 only
        why = (f"{model_dir.name} has no {trtplan_dit.CONTROLLED}/model.onnx (FLUX.1's residual transformer: "
               "`sdserve engines export --controlnet`), so it serves no FLUX.1 ControlNet")
    if not why and config.get("guidance_embeds") and not transformer.get("guidance_embeds"):
        why = f"ControlNet {net_dir.name} embeds guidance, this model's transformer takes none"
    if why or dit is None:
        raise ArtifactError(f"no TensorRT plan for {net_dir.name} on {model_dir.name}: {why}")
    dims = {**trtplan_dit.dims(model_dir, dit), "control_text": int(config.get("num_mode") is not None)}
    inputs = graph_inputs(net_dir / "model.onnx")
    precision = trtplan_dit.controlled_precision(dit, net_dir)
    sizes = {}
    for p in profiles:
        options = trtplan._options(COMPONENT, inputs, dims, p, flags, device_id, dit=dit, precision=precision)
        sizes[p.name] = _size(p, options, rows(COMPONENT, inputs, dims, p, dit))
    return {"model": net_dir.name, "serves": model_dir.name, "dims": dims, "architecture": dit.name,
            "weights": {COMPONENT: trtplan.weights(net_dir, "model.onnx")},
            "build_flags": asdict(flags) | {"precision": {COMPONENT: precision}}, "sizes": sizes,
            "manifest": f"{TRT_DIR}/manifest.json"}


def _size(p: ShapeProfile, options: dict[str, str], bounds: dict[str, int]) -> dict[str, Any]:
    return {"profile": asdict(p) | {"name": p.name},
            "components": {COMPONENT: {"source": "model.onnx", "provider_options": options,
                                       "writes": [f"{TRT_DIR}/{p.name}/{COMPONENT}_ctx.onnx",
                                                  f"{TRT_DIR}/{p.name}/{ENGINE_CACHE}/*"]}},
            RECORD: {COMPONENT: record(options, bounds)}}


def net_plan(net_dir: Path, model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags,
             device_id: int = 0) -> dict[str, Any]:
    """The plan of the ControlNet in ``net_dir`` for ``model_dir``, by its kind (config.json ``_class_name``)."""
    if not (net_dir / "model.onnx").is_file():
        raise ArtifactError(f"{net_dir} has no model.onnx: no ControlNet to plan")
    if _config(net_dir / "config.json").get("_class_name") == FLUX_NET:
        return flux_controlnet_plan(net_dir, model_dir, profiles, flags, device_id)
    if trtplan._dit_family(model_dir) is not None:
        raise ArtifactError(f"no TensorRT plan for {net_dir.name} on {model_dir.name}: ControlNet {net_dir.name} is "
                            "an SD ControlNet, this is a DiT model (a ControlNet for another base model)")
    return trtplan.controlnet_plan(net_dir, model_dir, profiles, flags, device_id)


def folder_plans(controlnet_dir: Path, model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags,
                 device_id: int = 0) -> dict[str, Any]:
    """Every ControlNet of ``controlnet_dir`` (engines/health/controlnet_memory.py ``nets``) planned for
    ``model_dir``, each with its ``option_parser`` verdicts (ORT's real Python parser, engines/build/trt_build.py
    ``parser_verdicts``): ``{"controlnets": {name: plan}, "controlnets_refused": {name: why}}``."""
    from engines.build.trt_build import parser_verdicts
    from engines.health.controlnet_memory import nets

    planned: dict[str, Any] = {}
    refused: dict[str, str] = {}
    for name, folder in nets(controlnet_dir).items():
        try:
            found = net_plan(folder, model_dir, profiles, flags, device_id)
        except ArtifactError as exc:
            refused[name] = str(exc)
            log.warning("ControlNet %s left out of the TensorRT plan: %s", name, exc)
            continue
        planned[name] = found | {"option_parser": parser_verdicts(folder, found)}
    return {"controlnets": planned, "controlnets_refused": refused}


def verdicts(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The section's parser verdicts, keyed ``controlnet:<name>/<size>/<component>`` (for trt_build.require_parsed)."""
    return {f"controlnet:{name}/{key}": verdict for name, found in section.get("controlnets", {}).items()
            for key, verdict in found["option_parser"].items()}


def build(section: dict[str, Any], controlnet_dir: Path, observations: dict[str, Any], nvml_index: int) -> list[Path]:
    """Each planned ControlNet's engines and manifest in its own folder (engines/build/trt_build.py ``build``)."""
    from engines.build.trt_build import build as build_one

    plans = section.get("controlnets", {})
    return [build_one(controlnet_dir / name, {k: v for k, v in found.items() if k != "option_parser"}, observations,
                      nvml_index) for name, found in plans.items()]
