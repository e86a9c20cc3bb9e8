"""TensorRT build plan: per served size and component, the exact provider options of one engine.

One engine per served size. ORT 1.31's TensorRT provider parses several profiles when an input name repeats in
``trt_profile_*_shapes`` (ParseProfileShapes, onnxruntime/core/providers/tensorrt/tensorrt_execution_provider_utils.h)
and builds them, but keeps its execution context on profile 0 (open PR microsoft/onnxruntime#31624): inputs that fit
only another profile fail at run time. So each size gets its own EP-context models and engine cache under
``trt/<WxH>/``, with one profile covering batch 1..max (opt at the common batch; the UNet and text encoder see 2x the
batch because of classifier-free guidance).

Every dim comes from the model: symbolic dims (optimum exports name batch, sequence, channels) are resolved from the
component configs, and a plan with a dim still unresolved is refused rather than filled with 1.

Paths in the plan are relative, so a plan (and what it builds) does not tie the model to the build folder:
``trt_engine_cache_path`` is relative to the context model's folder, as ORT requires when dumping EP-context models
(tensorrt_execution_provider.cc logs an ERROR for an absolute path and joins it to the context model's folder via
GetPathOrParentPathOfCtxModel, onnx_ctx_model_helper.cc); the context-model and timing-cache paths are relative to the
model folder and resolved by the builder (engines/build/trt_build.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import onnx

from engines.artifacts import COMPONENTS, TRT_DIR
from engines.errors import ArtifactError
from engines.health.trt_coverage import RECORD, parse_shapes, record
from engines.pipelines.flow_family import DitFamily, detect_dit

ENGINE_CACHE = "engines"
"""Engine cache folder, relative to the context model's folder (trt/<WxH>/engines)."""
TIMING_CACHE = f"{TRT_DIR}/timing"
MODEL_RELATIVE = ("trt_ep_context_file_path", "trt_timing_cache_path")
"""Provider options that the plan gives relative to the model folder; the builder makes them absolute."""

TRT_UNIMPORTABLE = ("DynamicQuantizeLinear", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul",
                    "MatMulIntegerToFloat", "QAttention")
"""Ops TensorRT's ONNX parser does not import (onnx/onnx-tensorrt docs/operators.md lists DynamicQuantizeLinear,
MatMulInteger and ConvInteger as "N"; the com.microsoft ones are ORT contrib ops from its quantizer). A graph with any
of them splits between providers instead of becoming one engine."""

# Input layouts by component and rank: each dim's role, resolved from the model's configs and the profile.
ROLES: dict[str, dict[int, tuple[str, ...]]] = {
    "text_encoder": {2: ("cfg_batch", "tokens")},
    "text_encoder_2": {2: ("cfg_batch", "tokens")},
    "unet": {4: ("cfg_batch", "unet_channels", "height", "width"), 3: ("cfg_batch", "tokens", "hidden"),
             1: ("cfg_batch",), 0: ()},
    "vae_decoder": {4: ("batch", "latent_channels", "height", "width")},
    "vae_encoder": {4: ("batch", "image_channels", "pixel_height", "pixel_width")},
}
NAMED_ROLES: dict[str, dict[str, tuple[str, ...]]] = {
    "unet": {"text_embeds": ("cfg_batch", "pooled"), "time_ids": ("cfg_batch", "time_ids")},
}
"""SDXL's extra UNet inputs (same rank, told apart by name): the pooled projection of the second text encoder and
the six micro-conditioning time ids (original size, crop top-left, target size)."""
RESIDUAL_DOWN, RESIDUAL_MID = "down_block_additional_residual_", "mid_block_additional_residual"
"""The ControlNet residual inputs of the UNet's residual variant (``unet_controlnet/``, engines/build/controlnet.py):
[rows, channels, h / f, w / f] per level (engines/pipelines/controlnet.py ``residual_levels``); the channels are
fixed in the graph ("" role), the sides follow the latents at each level's downsampling."""
MAX_RESIDUALS = 64
ROLES["unet_controlnet"] = ROLES["unet"]
NAMED_ROLES["unet_controlnet"] = {**NAMED_ROLES["unet"], RESIDUAL_MID: ("cfg_batch", "", "resmid_h", "resmid_w"),
                                  **{f"{RESIDUAL_DOWN}{i}": ("cfg_batch", "", f"res{i}_h", f"res{i}_w")
                                     for i in range(MAX_RESIDUALS)}}
ROLES["controlnet"] = {3: ("cfg_batch", "tokens", "hidden"), 1: ("cfg_batch",)}
NAMED_ROLES["controlnet"] = {**NAMED_ROLES["unet"], "sample": ("cfg_batch", "unet_channels", "height", "width"),
                             "controlnet_cond": ("cfg_batch", "image_channels", "pixel_height", "pixel_width")}
"""A ControlNet (engines/build/controlnet.py's layout) runs on every UNet row: the UNet's latents, timestep and text
states (SDXL's added conditions too), the control image at the output's pixels, one conditioning scale per row."""
BUILD_BUDGET_S = {"sd1": 900.0, "sd2": 900.0, "sdxl": 2700.0, "flux": 5400.0, "flux-schnell": 5400.0,
                  "sd3": 2700.0, "sd35": 3600.0, "qwen-image": 9000.0, "flux2-klein": 3600.0, "z-image": 3600.0}
"""Seconds `engines build` may take per served size, by architecture (fp16 engines, builder optimization level 3,
one H200): estimates scaled from the denoiser's FLOPs (SDXL's UNet ~3x SD 1.5's, plus a second text encoder and
an fp32 VAE; Flux's 12B transformer and T5-XXL; Qwen-Image's 20B transformer and 7B text encoder about 1.7x
Flux's; FLUX.2 [klein]'s 4-9B and Z-Image's 6B transformers with a 4-8B Qwen3 encoder about two thirds of Flux's),
not yet measured on a GPU. The plan carries the
total; `sdserve accept` budgets its relocation step (which builds every size) with it."""
PROTOBUF_LIMIT = 2**31 - 1
"""Bytes one serialized ModelProto may hold. The TensorRT provider hands the parser a serialized graph
(GraphViewer::ToProto + SerializeToString in tensorrt_execution_provider.cc, GetSupportedList and
CreateNodeComputeInfoFromGraph) whose initializers stored on disk stay references to their external files
(graph_proto_serializer.cc copies only in-memory data inline) and passes the model's path, so TensorRT's parser
reads the weights from the model folder. A component over the limit therefore builds only from a file path, with
its weights external and no ORT optimization folding them into new inline tensors: trt_build builds from the path
at ORT_DISABLE_ALL. Unverified on a GPU so far (docs/gpu-path.md, the second device run)."""
OPTIONAL_COMPONENTS = ("text_encoder_2", "vae_encoder", "unet_controlnet")
"""Built when the model folder has them (SDXL's second text encoder; the VAE encoder that edits need; the UNet's
ControlNet residual variant)."""


@dataclass(frozen=True)
class ShapeProfile:
    """One served size and the batch range its engines take (images, before the CFG doubling)."""

    width: int
    height: int
    batch_min: int
    batch_opt: int
    batch_max: int

    @property
    def name(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class BuildFlags:
    fp16: bool = True
    int8: bool = False
    builder_optimization_level: int = 3
    timing_cache: bool = True


def _json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def _int(*values: Any) -> int | None:
    """The first positive int below 100,000 (tokenizers store 1e30 for "no limit")."""
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 100_000), None)


def model_dims(model_dir: Path) -> dict[str, int | None]:
    """The dims a Stable Diffusion export leaves symbolic, read from its configs (None where none says)."""
    text = _json(model_dir / "text_encoder" / "config.json")
    text_2 = _json(model_dir / "text_encoder_2" / "config.json")
    unet = _json(model_dir / "unet" / "config.json")
    vae = _json(model_dir / "vae_decoder" / "config.json")
    tokenizer = _json(model_dir / "tokenizer" / "tokenizer_config.json")
    blocks = vae.get("block_out_channels")
    return {"tokens": _int(tokenizer.get("model_max_length"), text.get("max_position_embeddings")),
            "unet_channels": _int(unet.get("in_channels")),
            "latent_channels": _int(vae.get("latent_channels"), unet.get("out_channels"), unet.get("in_channels")),
            "hidden": _int(unet.get("cross_attention_dim"), text.get("hidden_size")),
            "pooled": _int(text_2.get("projection_dim"), text_2.get("hidden_size")),
            "time_ids": 6, "image_channels": 3,
            "factor": 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8, **_residual_dims(unet)}


def _residual_dims(unet: dict[str, Any]) -> dict[str, int | None]:
    """The downsampling of each ControlNet residual the UNet of config ``unet`` takes (``res_factor_<i>``, the
    mid block's ``res_factor_mid``), as engines/pipelines/controlnet.py ``residual_levels`` lists them."""
    if not isinstance(unet.get("block_out_channels"), list) or not isinstance(unet.get("layers_per_block"), int):
        return {}
    from engines.pipelines.controlnet import residual_levels

    levels = residual_levels(unet)
    return {**{f"res_factor_{i}": f for i, (_, f) in enumerate(levels[:-1])}, "res_factor_mid": levels[-1][1]}


def graph_inputs(path: Path) -> dict[str, list[int | str]]:
    """Input names and declared dims (int, or the symbolic name; "" when unnamed), read without external weights."""
    model = onnx.load(str(path), load_external_data=False)
    init = {i.name for i in model.graph.initializer}
    return {i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input if i.name not in init}


def resolve(component: str, name: str, declared: list[int | str], values: dict[str, int | None],
            roles: tuple[str, ...] | None = None) -> list[int]:
    """Concrete dims of one input; ArtifactError naming the input and dim when one cannot be resolved, or when a
    fixed dim in the graph contradicts what the configs and profile need. ``roles``: the input's dim roles when
    the caller knows them (the DiT plan, engines/build/trtplan_dit.py); else the UNet families' tables."""
    roles = roles or NAMED_ROLES.get(component, {}).get(name) or ROLES.get(component, {}).get(len(declared))
    dims = []
    for i, dim in enumerate(declared):
        role = roles[i] if roles else None
        want = values.get(role) if role else None
        fixed = dim if isinstance(dim, int) and dim > 0 else None
        if fixed is not None and want is not None and fixed != want:
            raise ArtifactError(f"{component} input {name!r} dim {i} is {fixed} in the graph, but the plan needs "
                                f"{want} ({role})")
        if fixed is None and want is None:
            raise ArtifactError(f"{component} input {name!r} dim {i} ({dim or 'unnamed'!s}) cannot be resolved: "
                                f"no {role or 'known role for this input'} in the model's configs; refusing a plan "
                                "with an unresolved dim")
        dims.append(fixed if fixed is not None else int(want or 0))
    return dims


def component_shapes(component: str, inputs: dict[str, list[int | str]], dims: dict[str, int | None],
                     p: ShapeProfile, batch: int, cfg: bool = True, dit: DitFamily | None = None,
                     bound: str = "max") -> str:
    """``name:dims`` for every input of ``component`` at ``batch`` images of profile ``p``; ``cfg`` doubles the
    text-side batch (classifier-free guidance), without it the rows are the images (guidance <= 1: the UNet runs
    the conditional half only). ``dit``: a DiT folder's family (roles and values from trtplan_dit); ``bound``: the
    profile bound, for a dim that varies within a size (Qwen-Image's text ids)."""
    if dit is not None:
        from engines.build import trtplan_dit

        found = trtplan_dit.values(dit, dims, p.width, p.height, batch, cfg, bound)
        return ",".join(f"{name}:" + "x".join(str(d) for d in resolve(
            component, name, declared, found, trtplan_dit.roles(dit, component, name, len(declared))))
            for name, declared in inputs.items())
    factor = dims["factor"] or 8
    values = {**dims, "batch": batch, "cfg_batch": 2 * batch if cfg else batch, "height": p.height // factor,
              "width": p.width // factor, "pixel_height": p.height, "pixel_width": p.width}
    for key, f in dims.items():  # the ControlNet residuals' sides, as the pipeline's buffers floor them
        if key.startswith("res_factor_") and f:
            level = key.removeprefix("res_factor_")
            values[f"res{level}_h"], values[f"res{level}_w"] = p.height // factor // f, p.width // factor // f
    # The timestep has one value per UNet row (rows at different steps share a call under step-level batching),
    # so it follows cfg_batch; a UNet exported with a fixed [1] timestep keeps its fixed dim (resolve).
    return ",".join(f"{name}:" + "x".join(str(d) for d in resolve(component, name, declared, values))
                    for name, declared in inputs.items())


VAE_COMPONENTS = ("vae_decoder", "vae_encoder")


def fp32_components(model_dir: Path) -> tuple[str, ...]:
    """Components whose engine must stay fp32 whatever ``BuildFlags.fp16`` says: the VAE of a family whose config
    keeps ``force_upcast`` (SDXL's VAE overflows to NaN in fp16). The ONNX dtype does not decide it: TensorRT's
    ``trt_fp16_enable`` lets the builder pick fp16 kernels inside an fp32 graph."""
    from engines.errors import ModelLoadError
    from engines.pipelines.unet_family import detect

    try:
        family = detect(model_dir)
    except ModelLoadError:  # no family sdserve serves: the plan's other checks say so; no upcast known
        return ()
    return VAE_COMPONENTS if family.vae_force_upcast else ()


def _options(component: str, inputs: dict[str, list[int | str]], dims: dict[str, int | None], p: ShapeProfile,
             flags: BuildFlags, device_id: int, fp32: bool = False, dit: DitFamily | None = None,
             precision: str = "") -> dict[str, str]:
    # min: one image without CFG (a guidance <= 1 request runs the UNet on the conditional rows only);
    # opt and max: with CFG. One engine then serves both paths at every batch in range.
    shapes = {k: component_shapes(component, inputs, dims, p, b, cfg, dit, k)
              for k, b, cfg in (("min", p.batch_min, False), ("opt", p.batch_opt, True), ("max", p.batch_max, True))}
    half = {"trt_fp16_enable": str(flags.fp16 and not fp32)} if not precision else {
        "trt_fp16_enable": str(flags.fp16 and precision == "fp16"),
        "trt_bf16_enable": str(flags.fp16 and precision == "bf16")}
    # Every key here must pass ORT's Python option parser (engines/runtime/optcheck.py; `engines build --dry-run`
    # runs it on each set). `trt_load_user_initializer` is NOT one: only the provider library's C-API parser knows it,
    # and onnxruntime_pybind_state.cc refuses it ("Invalid TensorRT EP option"), so no engine could be built with it.
    return {
        "device_id": str(device_id), **half, "trt_int8_enable": str(flags.int8),
        "trt_builder_optimization_level": str(flags.builder_optimization_level),
        "trt_engine_cache_enable": "True", "trt_engine_cache_path": ENGINE_CACHE,
        "trt_timing_cache_enable": str(flags.timing_cache), "trt_timing_cache_path": TIMING_CACHE,
        "trt_profile_min_shapes": shapes["min"], "trt_profile_opt_shapes": shapes["opt"],
        "trt_profile_max_shapes": shapes["max"],
        "trt_dump_ep_context_model": "True", "trt_ep_context_embed_mode": "0",
        "trt_ep_context_file_path": f"{TRT_DIR}/{p.name}/{component}_ctx.onnx",
    }


def rows(component: str, inputs: dict[str, list[int | str]], dims: dict[str, int | None], p: ShapeProfile,
         dit: DitFamily | None = None) -> dict[str, int]:
    """The rows ``component``'s engine takes at profile ``p``: ``per_image`` (what one more image adds to the
    batch dim with classifier-free guidance: 2 for the UNet and text encoders, 1 for the VAE), ``min`` (batch_min
    images without guidance) and ``max`` (batch_max images with it), measured on the shapes the plan gives
    TensorRT, so the boot check (engines/health/trt_coverage.py) reads the engine's own bounds."""
    def step(cfg: bool) -> int:
        one, two = (parse_shapes(component_shapes(component, inputs, dims, p, b, cfg, dit)) for b in (1, 2))
        return max((b - a for name in one for a, b in zip(one[name], two[name], strict=True)), default=0)

    return {"min": p.batch_min * step(False), "max": p.batch_max * step(True), "per_image": step(True)}


def weights(model_dir: Path, source: str) -> dict[str, Any]:
    """How a component's weights reach TensorRT: bytes inline in the graph file, bytes in external files, and
    whether the whole is over protobuf's limit (then the external layout is what makes the build possible)."""
    from engines.artifacts import external_files

    path = model_dir / source
    external = sum((path.parent / f).stat().st_size for f in external_files(path))
    inline = path.stat().st_size
    return {"graph_bytes": inline, "external_bytes": external, "over_2gb": inline + external > PROTOBUF_LIMIT}


def plan(model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags, device_id: int = 0) -> dict[str, Any]:
    """The artifact plan: per size, per component, the provider options and the files the build will write. Every
    path in it is relative (to the model folder, or for the engine cache to the context model's folder)."""
    if len({p.name for p in profiles}) != len(profiles):
        raise ArtifactError(f"the served sizes repeat: {[p.name for p in profiles]}")
    dit = _dit_family(model_dir)
    if dit is None and not (model_dir / "unet" / "model.onnx").is_file():
        raise ArtifactError(f"{model_dir} has neither unet/model.onnx nor a Flux / SD 3 transformer: no TensorRT plan")
    if dit is not None:
        from engines.build import trtplan_dit

        dims = trtplan_dit.dims(model_dir, dit)
        upcast: tuple[str, ...] = ()
        present = trtplan_dit.components(dit, model_dir)
        precision = trtplan_dit.precisions(dit, model_dir)
    else:
        dims = model_dims(model_dir)
        upcast = fp32_components(model_dir)
        present = [*COMPONENTS, *(c for c in OPTIONAL_COMPONENTS if (model_dir / c / "model.onnx").is_file())]
        precision = {}
    inputs = {c: graph_inputs(model_dir / c / "model.onnx") for c in present}
    sizes = {}
    for p in profiles:
        components = {c: {"source": f"{c}/model.onnx",
                          "provider_options": _options(c, inputs[c], dims, p, flags, device_id, c in upcast, dit,
                                                       precision.get(c, "")),
                          "writes": [f"{TRT_DIR}/{p.name}/{c}_ctx.onnx", f"{TRT_DIR}/{p.name}/{ENGINE_CACHE}/*"]}
                      for c in present}
        sizes[p.name] = {"profile": asdict(p) | {"name": p.name}, "components": components,
                         RECORD: {c: record(components[c]["provider_options"], rows(c, inputs[c], dims, p, dit))
                                  for c in present}}
    base = dit.name if dit is not None else _architecture(model_dir)
    return {"model": model_dir.name, "dims": dims, "architecture": base,
            "weights": {c: weights(model_dir, f"{c}/model.onnx") for c in present},
            "budget_s": BUILD_BUDGET_S.get(base, max(BUILD_BUDGET_S.values())) * len(profiles),
            "build_flags": asdict(flags) | {"fp32_components": [c for c in present if c in upcast],
                                            **({"precision": precision} if precision else {})}, "sizes": sizes,
            "manifest": f"{TRT_DIR}/manifest.json"}


def controlnet_plan(net_dir: Path, model_dir: Path, profiles: list[ShapeProfile], flags: BuildFlags,
                    device_id: int = 0) -> dict[str, Any]:
    """A ControlNet's plan for the model it serves (``sdserve serve --controlnet-dir``): per served size, the
    provider options of its engine, shaped as ``plan``'s (component ``controlnet``, source ``model.onnx``) with every
    path relative to the ControlNet's folder (its ``trt/<WxH>/controlnet_ctx.onnx`` and engine cache beside it). Its
    rows, latents and text states are the model's UNet's (every CFG row runs it), the control image the output's
    pixels. A ControlNet for another base (engines/pipelines/controlnet.py ``base_mismatch``) is refused by name;
    the model's ``unet_controlnet/`` (planned by ``plan``) takes its residuals."""
    from engines.pipelines.controlnet import base_mismatch

    if not (net_dir / "model.onnx").is_file():
        raise ArtifactError(f"{net_dir} has no model.onnx: no ControlNet to plan")
    dims = model_dims(model_dir)
    why = base_mismatch(net_dir.name, _json(net_dir / "config.json"), dims["pooled"] is not None)
    if why:
        raise ArtifactError(f"no TensorRT plan for {net_dir.name} on {model_dir.name}: {why}")
    inputs, component = graph_inputs(net_dir / "model.onnx"), "controlnet"
    sizes = {}
    for p in profiles:
        options = _options(component, inputs, dims, p, flags, device_id)
        sizes[p.name] = {"profile": asdict(p) | {"name": p.name},
                         "components": {component: {"source": "model.onnx", "provider_options": options,
                                                    "writes": [f"{TRT_DIR}/{p.name}/{component}_ctx.onnx",
                                                               f"{TRT_DIR}/{p.name}/{ENGINE_CACHE}/*"]}},
                         RECORD: {component: record(options, rows(component, inputs, dims, p))}}
    return {"model": net_dir.name, "serves": model_dir.name, "dims": dims, "architecture": _architecture(model_dir),
            "weights": {component: weights(net_dir, "model.onnx")}, "build_flags": asdict(flags), "sizes": sizes,
            "manifest": f"{TRT_DIR}/manifest.json"}


def _dit_family(model_dir: Path) -> DitFamily | None:
    from engines.pipelines.flow_family import is_dit_folder

    return detect_dit(model_dir) if is_dit_folder(model_dir) else None


def _architecture(model_dir: Path) -> str:
    from engines.errors import ModelLoadError
    from engines.pipelines.unet_family import detect

    try:
        return detect(model_dir).base
    except ModelLoadError:
        return "unknown"


def profiles_from(sizes: list[tuple[int, int]], batch_max: int, batch_opt: int) -> list[ShapeProfile]:
    """One profile per size: batch 1..``batch_max``, optimized for ``batch_opt``."""
    if not 1 <= batch_opt <= batch_max:
        raise ArtifactError(f"opt batch {batch_opt} must be within 1..{batch_max}")
    return [ShapeProfile(w, h, 1, batch_opt, batch_max) for w, h in sizes]


CONTRIB_DOMAIN = "com.microsoft"
"""ORT's contrib-op domain. TensorRT's ONNX parser imports the standard ONNX domain (plus TensorRT's own plugins),
not ORT's fused ops: `sdserve engines optimize` emits SkipLayerNormalization, QuickGelu, BiasGelu, FastGelu,
(--target cuda) GroupNorm, BiasSplitGelu, NhwcConv, MultiHeadAttention in this domain, and the TensorRT provider
hands them to CUDA or fails the build (with dynamic batch), so such a graph never becomes one engine."""


def trt_unimportable_ops(model_dir: Path) -> dict[str, dict[str, int]]:
    """Per component, the ops in its graph that TensorRT's ONNX parser does not import, with counts: the listed
    quantizer ops and every op in ORT's contrib domain (named ``com.microsoft.<op>``)."""
    found: dict[str, dict[str, int]] = {}
    present = sorted(p.parent.name for p in model_dir.glob("*/model.onnx"))
    for component in present:
        graph = onnx.load(str(model_dir / component / "model.onnx"), load_external_data=False).graph
        for node in graph.node:
            name = node.op_type if node.op_type in TRT_UNIMPORTABLE else (
                f"{CONTRIB_DOMAIN}.{node.op_type}" if node.domain == CONTRIB_DOMAIN else "")
            if name:
                ops = found.setdefault(component, {})
                ops[name] = ops.get(name, 0) + 1
    return found


def refuse_unimportable(model_dir: Path) -> None:
    """ArtifactError naming each op TensorRT would not import: the engine would split between providers."""
    found = trt_unimportable_ops(model_dir)
    if found:
        listed = "; ".join(f"{c}: " + ", ".join(f"{op} x{n}" for op, n in sorted(ops.items()))
                           for c, ops in sorted(found.items()))
        raise ArtifactError(f"TensorRT build refused: {model_dir} has ops TensorRT's ONNX parser does not import "
                            f"({listed}); the engine would split between providers. Dynamic INT8 (`sdserve engines "
                            "quantize`) and the fused ops of `sdserve engines optimize` serve on the CUDA provider "
                            "only; build TensorRT engines from the plain exported model")
