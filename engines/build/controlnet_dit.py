"""FLUX.1 ControlNets (diffusers ``FluxControlNetModel``, the InstantX kind and its union variant): the tiny faithful
ones, the ONNX export of a diffusers folder, and the Flux transformer's variant that takes the ControlNet residuals
(issue 56).

Why FLUX.1's and not Z-Image's: FLUX.1 ControlNets are the DiT ControlNets clients send today (InstantX canny and
Union, Shakker-Labs Union Pro, XLabs' set) and diffusers has a pipeline for them (FluxControlNetPipeline) to prove
parity against; sdserve serves FLUX.1 dev and schnell already.

Build-time only: imports torch and diffusers. Layouts::

    ControlNet folder:  model.onnx  config.json  manifest.json
        inputs  hidden_states [B,N,64] (the packed noisy latents), controlnet_cond [B,N,64] (the control image
                VAE-encoded, ``(mean - shift) * scaling``, packed as the latents are), controlnet_mode [B,1] int64 (the
                union kind only: config ``num_mode``), encoder_hidden_states [B,T,D], pooled_projections [B,P],
                timestep [B] (t / 1000), rope_cos / rope_sin [tokens, head] (text tokens first: one more for the
                union kind, whose mode embedding leads the text), guidance [B] (config ``guidance_embeds``),
                conditioning_scale [B] (one scale per row)
        outputs controlnet_block_sample_<i> (one per double block), controlnet_single_block_sample_<j> (one per
                single block), each [B,N,inner]
    model folder:       transformer_controlnet/model.onnx (+ config.json), beside the plain transformer/ (unchanged:
                        a model without ControlNet runs no slower)
        inputs  the plain transformer's, then block_residual_<k> for each of its double blocks and
                single_residual_<k> for each single block: one residual per transformer block, so the variant serves a
                ControlNet of any depth (the pipeline binds ControlNet sample ``k // ceil(blocks / samples)`` to block
                ``k``, diffusers' interval rule, and zeros where a ControlNet has no single blocks)

The tiny ControlNet has the tiny Flux transformer's widths (engines/build/dit.py FLUX). diffusers zero-initialises the
ControlNet's output projections and its ``controlnet_x_embedder`` (``zero_module``): a tiny one so built would add
nothing and prove nothing, so they get seeded random weights, as a trained ControlNet's are non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engines.artifacts import MANIFEST, read_manifest, write_model_manifest
from engines.build.dit import FLUX, RECIPES, SEED
from engines.build.dit_export import PRECISION, TORCH_DTYPES, cast_model, register_half_symbolics
from engines.build.dit_folder import export_onnx
from engines.build.export import write_json, write_manifest

CONTROLNET_FLUX = {**FLUX, "num_layers": 1, "num_single_layers": 1}
"""The tiny Flux transformer's widths; one double and one single block (the tiny transformer's depth)."""
UNION_MODES = 7
"""InstantX's FLUX.1 Union modes: canny 0, tile 1, depth 2, blur 3, pose 4, gray 5, low quality 6."""
ZERO_STD = 0.05
"""Standard deviation of the tiny ControlNet's (otherwise zero) output projections (its control embedder:
EMBED_GAIN)."""
EMBED_GAIN = 2.0
"""The control embedder's weight scale over sqrt(fan-in) (engines/build/controlnet.py's for the SD embedding): a moved
control shape then moves the tiny FLUX.1 image by several levels, not one (tests/e2e/test_controlnet_dit_serving.py)."""
TOKENS, TEXT = 16, 8
"""Example image and text token counts of the traced graphs (both axes are dynamic)."""
TINY_FLUX_FAMILIES = tuple(name for name, recipe in RECIPES.items() if recipe.transformer == "FluxTransformer2DModel")
"""The tiny families a FLUX.1 ControlNet is built for (engines/build/dit.py RECIPES: dev and schnell)."""


class _RopeInputs(torch.nn.Module):
    """The network's ``pos_embed`` while tracing: it answers with the rope tables the graph takes as inputs (the
    pipeline computes them, engines/pipelines/flux.py ``flux_rope``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None, "the rope tables are set by the traced forward"
        return self.tables


def _rope_apply(x: torch.Tensor, freqs_cis: tuple[torch.Tensor, torch.Tensor], use_real: bool = True,
                use_real_unbind_dim: int = -1, sequence_dim: int = 2) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` for FLUX.1 blocks (x [B, tokens, heads, dim], real tables, interleaved
    pairs): each pair (a, b) becomes (a cos - b sin, b cos + a sin). Pairs are split with ``unflatten`` so the traced
    graph keeps its batch and token axes dynamic."""
    cos, sin = freqs_cis[0][None, :, None, :], freqs_cis[1][None, :, None, :]
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    swapped = torch.stack([-b, a], dim=-1).flatten(-2)
    return (x.float() * cos + swapped.float() * sin).to(x.dtype)


def make_tiny_flux_controlnet(seed: int = SEED, union: bool = False, guidance_embeds: bool = True,
                              single_layers: int = 1) -> Any:
    """The tiny FLUX.1 ControlNet (``union``: with InstantX's seven modes; ``single_layers`` 0: double blocks
    only), seeded, its zero layers given random weights."""
    from diffusers import FluxControlNetModel

    torch.manual_seed(seed + 9)  # not the transformer's weights again
    net = FluxControlNetModel(**{**CONTROLNET_FLUX, "num_single_layers": single_layers},
                              guidance_embeds=guidance_embeds,
                              num_mode=UNION_MODES if union else None).eval()
    generator = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():
        for layer in [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]:
            for param in layer.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * ZERO_STD)
        embedder = net.controlnet_x_embedder  # at ZERO_STD the control image barely steered the tiny net
        embedder.weight.mul_(EMBED_GAIN / (ZERO_STD * embedder.weight.shape[1] ** 0.5))
        embedder.bias.zero_()
    return net


def _rope_tables(model: Any, text: int) -> tuple[torch.Tensor, torch.Tensor]:
    head = int(model.config.attention_head_dim)
    return torch.randn(text + TOKENS, head), torch.randn(text + TOKENS, head)


class _FluxControlNet(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.rope = _RopeInputs()
        model.pos_embed = self.rope
        self.union = model.config.num_mode is not None
        self.guidance = bool(model.config.guidance_embeds)

    def forward(self, hidden_states: torch.Tensor, cond: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mode, rest = (rest[0], rest[1:]) if self.union else (None, rest)
        states, pooled, timestep, cos, sin = rest[:5]
        guidance = rest[5] if self.guidance else None
        scale = rest[-1].reshape(-1, 1, 1)
        self.rope.tables = (cos, sin)
        ids = torch.zeros(1, 3)  # unused: positions arrive as the rope tables
        blocks, singles = self.model(hidden_states=hidden_states, controlnet_cond=cond, controlnet_mode=mode,
                                     conditioning_scale=1.0, encoder_hidden_states=states, pooled_projections=pooled,
                                     timestep=timestep, img_ids=ids, txt_ids=ids, guidance=guidance,
                                     return_dict=False)
        return tuple(sample * scale for sample in [*(blocks or []), *(singles or [])])


class _ControlledFlux(torch.nn.Module):
    """The Flux transformer with one residual input per block (diffusers' ``controlnet_block_samples`` and
    ``controlnet_single_block_samples`` at one sample per block: its interval is then 1)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.rope = _RopeInputs()
        model.pos_embed = self.rope
        self.blocks = len(model.transformer_blocks)
        self.guidance = bool(model.config.guidance_embeds)

    def forward(self, hidden_states: torch.Tensor, states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        guidance, residuals = (rest[0], rest[1:]) if self.guidance else (None, rest)
        self.rope.tables = (cos, sin)
        ids = torch.zeros(1, 3)
        return self.model(hidden_states=hidden_states, encoder_hidden_states=states, pooled_projections=pooled,
                          timestep=timestep, img_ids=ids, txt_ids=ids, guidance=guidance,
                          controlnet_block_samples=list(residuals[:self.blocks]),
                          controlnet_single_block_samples=list(residuals[self.blocks:]), return_dict=False)[0]


class _HalfInside(torch.nn.Module):
    """A network cast to half precision behind fp32 graph inputs and outputs (as engines/build/dit_export.py exports
    the plain transformer at ``--dtype fp16|bf16``): floating inputs are cast in, but the rope tables at ``keep``
    (diffusers keeps them in fp32 at every dtype), and outputs cast to fp32. The pipeline then binds fp32 values
    whichever dtype the export has."""

    def __init__(self, inner: torch.nn.Module, dtype: torch.dtype, keep: tuple[int, ...]) -> None:
        super().__init__()
        self.inner, self.dtype, self.keep = inner, dtype, keep

    def forward(self, *args: torch.Tensor) -> Any:
        cast = [a.to(self.dtype) if a.is_floating_point() and i not in self.keep else a for i, a in enumerate(args)]
        out = self.inner(*cast)
        return tuple(o.float() for o in out) if isinstance(out, tuple) else out.float()


def _wrap(kind: Any, dtype: str, keep: tuple[int, ...]) -> Any:
    """``kind`` (an export module class) as a wrapper of a network; in ``dtype`` (its transformer precision, the
    network cast in place, its class's fp32 keeps kept) behind fp32 inputs and outputs."""
    if dtype == "fp32":
        return kind
    if dtype not in PRECISION:
        raise ValueError(f"dtype {dtype!r}: expected fp32 or one of {sorted(PRECISION)}")
    half = PRECISION[dtype]["transformer"]

    def wrap(model: Any) -> torch.nn.Module:
        cast_model(model, half)
        return _HalfInside(kind(model), TORCH_DTYPES[half], keep)
    return wrap


def _traced(model: Any, wrap: Any, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    """Export ``wrap(model)`` (which puts the rope stand-in in) with diffusers' rotary function swapped for the
    dynamic one; the model's own ``pos_embed`` and the function restored after (the model stays usable)."""
    from diffusers.models.transformers import transformer_flux

    original, rotary = model.pos_embed, transformer_flux.apply_rotary_emb
    module = wrap(model)
    transformer_flux.apply_rotary_emb = _rope_apply
    register_half_symbolics()  # aten::rms_norm (the q/k norms) has no symbolic of the legacy exporter's own
    try:
        export_onnx(module, args, path, inputs, outputs, dynamic)  # weights external past 2 GB
    finally:
        model.pos_embed, transformer_flux.apply_rotary_emb = original, rotary


def _common(config: Any, rows: int) -> tuple[list[torch.Tensor], list[str], dict[str, dict[int, str]]]:
    """(example args, names, dynamic axes) of the inputs the transformer and the ControlNet share after the latents:
    text states, pooled projections, timestep (the rope tables and guidance follow)."""
    args = [torch.randn(rows, TEXT, int(config.joint_attention_dim)),
            torch.randn(rows, int(config.pooled_projection_dim)), torch.tensor([0.5] * rows)]
    names = ["encoder_hidden_states", "pooled_projections", "timestep"]
    dynamic = {"encoder_hidden_states": {0: "batch", 1: "text_tokens"}, "pooled_projections": {0: "batch"},
               "timestep": {0: "batch"}, "rope_cos": {0: "tokens"}, "rope_sin": {0: "tokens"}}
    return args, names, dynamic


def residual_names(config: Any) -> tuple[list[str], list[str]]:
    """A ControlNet's outputs: one per double block, one per single block."""
    get = config.get if isinstance(config, dict) else config.__getitem__
    return ([f"controlnet_block_sample_{i}" for i in range(int(get("num_layers")))],
            [f"controlnet_single_block_sample_{j}" for j in range(int(get("num_single_layers")))])


def export_flux_controlnet(net: Any, out: Path, source: dict[str, Any], dtype: str = "fp32") -> Path:
    """``net`` (a diffusers FluxControlNetModel without XLabs' hint block) as ``out``/model.onnx with its config.json
    and manifest; ``dtype`` fp16/bf16: the network in the transformer's precision of that export (``net`` is cast in
    place), its inputs and outputs fp32."""
    if net.input_hint_block is not None:
        raise ValueError("XLabs FLUX.1 ControlNets (conditioning_embedding_channels: a pixel hint block) are not "
                         "served; InstantX-style ones (VAE-encoded control latents) and their union kind are")
    out.mkdir(parents=True, exist_ok=True)
    config, rows = net.config, 2
    union = config.num_mode is not None
    channels = int(config.in_channels)
    common, names, dynamic = _common(config, rows)
    tokens = {0: "batch", 1: "image_tokens"}
    args = [torch.randn(rows, TOKENS, channels), torch.randn(rows, TOKENS, channels)]
    inputs = ["hidden_states", "controlnet_cond"]
    if union:
        args.append(torch.zeros(rows, 1, dtype=torch.int64))
        inputs.append("controlnet_mode")
        dynamic["controlnet_mode"] = {0: "batch"}
    args += [*common, *_rope_tables(net, TEXT + int(union))]
    inputs += [*names, "rope_cos", "rope_sin"]
    if config.guidance_embeds:
        args.append(torch.tensor([3.5] * rows))
        inputs.append("guidance")
        dynamic["guidance"] = {0: "batch"}
    args.append(torch.ones(rows))
    inputs.append("conditioning_scale")
    blocks, singles = residual_names(config)
    dynamic |= {"hidden_states": tokens, "controlnet_cond": tokens, "conditioning_scale": {0: "batch"},
                **{name: tokens for name in [*blocks, *singles]}}
    rope = (inputs.index("rope_cos"), inputs.index("rope_sin"))
    _traced(net, _wrap(_FluxControlNet, dtype, rope), tuple(args), out / "model.onnx", inputs, [*blocks, *singles],
            dynamic)
    write_json(out / "config.json", {"_class_name": "FluxControlNetModel", **dict(config)})
    write_manifest(out, source if dtype == "fp32" else {**source, "dtype": dtype})
    return out


def export_controlled_flux(transformer: Any, out: Path, dtype: str = "fp32") -> Path:
    """``transformer`` (FluxTransformer2DModel) with one residual input per block, as
    ``out``/transformer_controlnet/model.onnx (+ config.json); ``dtype``: as the model's plain transformer was
    exported (fp16/bf16: cast in place, fp32 inputs and outputs)."""
    config, rows = transformer.config, 2
    inner = int(config.num_attention_heads) * int(config.attention_head_dim)
    common, names, dynamic = _common(config, rows)
    args = [torch.randn(rows, TOKENS, int(config.in_channels)), *common, *_rope_tables(transformer, TEXT)]
    inputs = ["hidden_states", *names, "rope_cos", "rope_sin"]
    if config.guidance_embeds:
        args.append(torch.tensor([3.5] * rows))
        inputs.append("guidance")
        dynamic["guidance"] = {0: "batch"}
    residuals = [f"block_residual_{k}" for k in range(len(transformer.transformer_blocks))] + \
        [f"single_residual_{k}" for k in range(len(transformer.single_transformer_blocks))]
    args += [torch.randn(rows, TOKENS, inner) for _ in residuals]
    tokens = {0: "batch", 1: "image_tokens"}
    dynamic |= {"hidden_states": tokens, "out_hidden_states": tokens, **{name: tokens for name in residuals}}
    target = out / "transformer_controlnet"
    rope = (inputs.index("rope_cos"), inputs.index("rope_sin"))
    _traced(transformer, _wrap(_ControlledFlux, dtype, rope), tuple(args), target / "model.onnx", [*inputs, *residuals],
            ["out_hidden_states"], dynamic)
    write_json(target / "config.json", {"_class_name": type(transformer).__name__, **dict(config)})
    if (out / MANIFEST).is_file():  # the folder's manifest covers the new files too (its other keys kept)
        kept = {k: v for k, v in read_manifest(out / MANIFEST).items() if k not in ("files", "format")}
        write_model_manifest(out, kept)
    return target


def build_tiny_flux_controlnet(out: Path, model: Path | None = None, diffusers_out: Path | None = None,
                               union: bool = False, family: str = "flux") -> Path:
    """The tiny FLUX.1 ControlNet (``union``: the union kind) exported to ``out``; with ``model`` (the tiny
    ``family`` model's folder: flux or flux-schnell) its transformer's residual variant is added there;
    ``diffusers_out``: the ControlNet's torch weights too (parity tests)."""
    from engines.build.dit import make_dit_components

    net = make_tiny_flux_controlnet(union=union, guidance_embeds=RECIPES[family].transformer_config["guidance_embeds"])
    export_flux_controlnet(net, out, {"kind": "tiny", "family": "flux-controlnet" + ("-union" if union else ""),
                                      "seed": SEED})
    if model is not None:
        export_controlled_flux(make_dit_components(family)["transformer"], model)
    if diffusers_out is not None:
        net.save_pretrained(diffusers_out)
    return out


def is_flux_controlnet(src: Path) -> bool:
    """Whether the diffusers folder ``src`` holds a FluxControlNetModel (config.json's ``_class_name``)."""
    config = src / "config.json"
    return config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("_class_name") == \
        "FluxControlNetModel"


def export_flux_controlnet_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers FluxControlNetModel folder (``dtype``: the model's export dtype)."""
    from diffusers import FluxControlNetModel

    if not is_flux_controlnet(src):
        raise ValueError(f"{src}: config.json does not name FluxControlNetModel")
    return export_flux_controlnet(FluxControlNetModel.from_pretrained(src).eval(), out,
                                  {"kind": "diffusers-folder", "path_name": src.name}, dtype)


def export_controlled_flux_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Add transformer_controlnet/ to the exported FLUX.1 model ``out`` from the diffusers folder ``src``, in the
    dtype its transformer was exported in."""
    from diffusers import FluxTransformer2DModel

    return export_controlled_flux(FluxTransformer2DModel.from_pretrained(src / "transformer").eval(), out, dtype)
