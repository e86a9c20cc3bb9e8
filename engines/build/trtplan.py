"""TensorRT build plan: per component, the exact provider options for the served shape profiles.

One TensorRT optimization profile per served size, covering the served batch sizes (min = smallest, opt = max =
largest; the UNet and text encoder see 2x the batch because of classifier-free guidance). Profiles are given to the
TensorRT provider by repeating each input name, one entry per profile. Engines are dumped as EP-context models so a
serving node loads prebuilt engines and never builds one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx

from engines.artifacts import TRT_DIR

COMPONENTS = ("text_encoder", "unet", "vae_decoder")


@dataclass(frozen=True)
class ShapeProfile:
    width: int
    height: int
    batch_min: int
    batch_max: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}xb{self.batch_min}-{self.batch_max}"


@dataclass(frozen=True)
class BuildFlags:
    fp16: bool = True
    int8: bool = False
    builder_optimization_level: int = 3
    timing_cache: bool = True


def _inputs(path: Path) -> dict[str, list[int | str]]:
    """Input names and declared dims, read from the graph without loading external weights."""
    model = onnx.load(str(path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in init}


def _dims(template: list[int | str], concrete: dict[int, int]) -> str:
    dims = [concrete.get(i, d if isinstance(d, int) and d > 0 else 1) for i, d in enumerate(template)]
    return "x".join(str(d) for d in dims)


def component_shapes(component: str, inputs: dict[str, list[int | str]], p: ShapeProfile, batch: int,
                     factor: int) -> str:
    """``name:dims`` for every input of ``component`` at ``batch`` images of profile ``p``."""
    h, w = p.height // factor, p.width // factor
    parts = []
    for name, dims in inputs.items():
        if component == "text_encoder":
            concrete = {0: 2 * batch}
        elif component == "unet" and len(dims) == 4:
            concrete = {0: 2 * batch, 2: h, 3: w}
        elif component == "unet" and len(dims) == 3:
            concrete = {0: 2 * batch}
        elif component == "vae_decoder":
            concrete = {0: batch, 2: h, 3: w}
        else:  # timestep: static
            concrete = {}
        parts.append(f"{name}:{_dims(dims, concrete)}")
    return ",".join(parts)


def plan(model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags, device_id: int = 0) -> dict[str, Any]:
    """The artifact plan: provider options per component and the files the build will write."""
    vae_cfg = model_dir / "vae_decoder" / "config.json"
    factor = 2 ** (len(json.loads(vae_cfg.read_text()).get("block_out_channels", [0] * 4)) - 1) if vae_cfg.is_file() \
        else 8
    out = model_dir / TRT_DIR
    components = {}
    for component in COMPONENTS:
        inputs = _inputs(model_dir / component / "model.onnx")
        mins = [component_shapes(component, inputs, p, p.batch_min, factor) for p in profiles]
        maxs = [component_shapes(component, inputs, p, p.batch_max, factor) for p in profiles]
        options = {
            "device_id": str(device_id), "trt_fp16_enable": str(flags.fp16), "trt_int8_enable": str(flags.int8),
            "trt_builder_optimization_level": str(flags.builder_optimization_level),
            "trt_engine_cache_enable": "True", "trt_engine_cache_path": str(out / "engines"),
            "trt_timing_cache_enable": str(flags.timing_cache), "trt_timing_cache_path": str(out / "timing"),
            "trt_profile_min_shapes": ",".join(mins), "trt_profile_opt_shapes": ",".join(maxs),
            "trt_profile_max_shapes": ",".join(maxs),
            "trt_dump_ep_context_model": "True", "trt_ep_context_file_path": str(out / f"{component}_ctx.onnx"),
            "trt_ep_context_embed_mode": "0",
        }
        components[component] = {"source": str(model_dir / component / "model.onnx"), "provider_options": options,
                                 "writes": [f"{TRT_DIR}/{component}_ctx.onnx", f"{TRT_DIR}/engines/*.engine"]}
    return {"model": str(model_dir), "profiles": [asdict(p) | {"name": p.name} for p in profiles],
            "build_flags": asdict(flags), "components": components, "manifest": f"{TRT_DIR}/manifest.json"}


def profiles_from(sizes: list[tuple[int, int]], batch_sizes: tuple[int, ...]) -> list[ShapeProfile]:
    return [ShapeProfile(w, h, min(batch_sizes), max(batch_sizes)) for w, h in sizes]
