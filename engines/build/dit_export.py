"""ONNX export of the flow-matching DiT families (Flux.1, SD 3 / 3.5): the tiny builds of engines/build/dit.py and
local diffusers folders (`sdserve engines export --from`). Build-time only: imports torch, diffusers, transformers.

Output layout (ONNX, fp32, legacy exporter)::

    text_encoder/ text_encoder_2/ [text_encoder_3/] transformer/ vae_decoder/ [vae_encoder/]  model.onnx + config.json
    tokenizer/ tokenizer_2/ [tokenizer_3/]  scheduler/scheduler_config.json  model_index.json  manifest.json

(text_encoder_3/ and tokenizer_3/: SD 3's T5; Flux's T5 is text_encoder_2/ and tokenizer_2/. vae_encoder/: img2img.)
The transformer takes ``hidden_states`` (Flux: packed [B, tokens, 64]; SD 3: [B, 16, h, w]),
``encoder_hidden_states``, ``pooled_projections``, ``timestep`` (Flux: t / 1000; SD 3: t), Flux also
``rope_cos``/``rope_sin`` and dev ``guidance``; it outputs ``out_hidden_states``. The q/k RMSNorms of Flux and SD 3.5
(``torch.nn.RMSNorm``, which the legacy exporter cannot export) are written out as opset-17 ops.

Flux's rotary position tables are transformer *inputs* (``rope_cos``, ``rope_sin``: [text + image tokens,
head_dim], fp32): diffusers' ``FluxPosEmbed`` computes them in float64, which would put double ops in the graph
(TensorRT has none); the serving pipeline computes them on the host in float64 from ``txt_ids``/``img_ids`` exactly
as diffusers does and casts them to fp32 (engines/diffusion/dit_pipeline.py ``flux_rope``).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from engines.build.export import OPSET, VaeDecoderExport, VaeEncoderExport, write_manifest

log = logging.getLogger(__name__)


class _ClipPooled(torch.nn.Module):
    """Flux's CLIP-L: (last_hidden_state, pooler_output); the pipeline reads the pooled output only."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, return_dict=True)
        return out.last_hidden_state, out.pooler_output


class _ClipProjected(torch.nn.Module):
    """SD 3's CLIP encoders: (text_embeds, last_hidden_state, penultimate hidden state), named as optimum does."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model(input_ids, output_hidden_states=True)
        return out.text_embeds, out.last_hidden_state, out.hidden_states[-2]


class _T5(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, return_dict=False)[0]


class _GivenRope(torch.nn.Module):
    """Stands in for FluxPosEmbed during export: returns the tables the graph takes as inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None
        return self.tables


def _rotary_for_export(x: torch.Tensor, freqs_cis: tuple[torch.Tensor, torch.Tensor], use_real: bool = True,
                       use_real_unbind_dim: int = -1, sequence_dim: int = 2) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` for Flux (real tables, interleaved pairs, tokens on axis 1), written so the
    tracer keeps the batch and token counts dynamic: its ``x.reshape(*x.shape[:-1], -1, 2)`` freezes them."""
    cos, sin = (t[None, :, None, :] for t in freqs_cis)
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class _Flux(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.rope = _GivenRope()
        model.pos_embed = self.rope

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                guidance: torch.Tensor | None = None) -> torch.Tensor:
        self.rope.tables = (rope_cos, rope_sin)
        ids = torch.zeros(1, 3)  # unused: positions arrive as the rope tables
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled, timestep=timestep, img_ids=ids, txt_ids=ids,
                          guidance=guidance, return_dict=False)[0]


class _SD3(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled, timestep=timestep, return_dict=False)[0]


def _rms_norm_symbolic(g: Any, x: Any, normalized_shape: Any, weight: Any, eps: Any) -> Any:
    """``aten::rms_norm`` (torch.nn.RMSNorm: Flux's and SD 3.5's q/k norms) as opset-17 ops: the legacy exporter
    has no symbolic for it. x * 1/sqrt(mean(x², last dims) + eps) * weight, in torch's order."""
    from torch.onnx import symbolic_helper as helper

    dims = helper._get_const(normalized_shape, "is", "normalized_shape")
    value = helper._get_const(eps, "f", "eps") if not helper._is_none(eps) else torch.finfo(torch.float32).eps
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=list(range(-len(dims), 0)), keepdims_i=1)
    eps_t = g.op("Constant", value_t=torch.tensor(float(value), dtype=torch.float32))
    out = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean, eps_t))))
    return out if helper._is_none(weight) else g.op("Mul", out, weight)


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, OPSET)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer warns at every Python branch on shapes: expected here
        torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)


def _batch(*names: str) -> dict[str, dict[int, str]]:
    return {n: {0: "batch"} for n in names}


def _export_text(components: dict[str, Any], flux: bool, out: Path) -> None:
    ids = (torch.zeros(1, 77, dtype=torch.int64),)
    if flux:
        names = ["last_hidden_state", "pooler_output"]
        _export(_ClipPooled(components["text_encoder"]), ids, out / "text_encoder" / "model.onnx", ["input_ids"],
                names, _batch("input_ids", *names))
    else:
        for name in ("text_encoder", "text_encoder_2"):
            model = components[name]
            names = ["text_embeds", "last_hidden_state", f"hidden_states.{int(model.config.num_hidden_layers) - 1}"]
            _export(_ClipProjected(model), ids, out / name / "model.onnx", ["input_ids"], names,
                    _batch("input_ids", *names))
    t5 = "text_encoder_2" if flux else "text_encoder_3"
    _export(_T5(components[t5]), (torch.zeros(1, 16, dtype=torch.int64),), out / t5 / "model.onnx",
            ["input_ids"], ["last_hidden_state"],
            {"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}})


def _export_transformer(transformer: Any, flux: bool, out: Path) -> None:
    config = transformer.config
    seq = {0: "batch", 1: "text_tokens"}
    if flux:
        head = int(config.attention_head_dim)
        args = [torch.randn(1, 16, int(config.in_channels)), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.randn(1, int(config.pooled_projection_dim)), torch.tensor([0.5]),
                torch.randn(24, head), torch.randn(24, head)]
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "rope_cos", "rope_sin"]
        dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": seq,
                   "rope_cos": {0: "tokens"}, "rope_sin": {0: "tokens"},
                   "out_hidden_states": {0: "batch", 1: "image_tokens"}, **_batch("pooled_projections", "timestep")}
        if config.guidance_embeds:
            args.append(torch.tensor([3.5]))
            names.append("guidance")
            dynamic |= _batch("guidance")
        module: torch.nn.Module = _Flux(transformer)
    else:
        args = [torch.randn(1, int(config.in_channels), 8, 8), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.randn(1, int(config.pooled_projection_dim)), torch.tensor([500.0])]
        names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
        spatial = {0: "batch", 2: "height", 3: "width"}
        dynamic = {"hidden_states": spatial, "encoder_hidden_states": seq, "out_hidden_states": spatial,
                   **_batch("pooled_projections", "timestep")}
        module = _SD3(transformer)
    from diffusers.models.transformers import transformer_flux

    original, rotary = transformer.pos_embed, transformer_flux.apply_rotary_emb
    transformer_flux.apply_rotary_emb = _rotary_for_export
    try:  # _Flux swaps in the given-tables stand-in; the components stay usable after the export
        _export(module, tuple(args), out / "transformer" / "model.onnx", names, ["out_hidden_states"], dynamic)
    finally:
        transformer.pos_embed, transformer_flux.apply_rotary_emb = original, rotary


def _export_vae(vae: Any, out: Path, encoder: bool) -> None:
    spatial = {0: "batch", 2: "height", 3: "width"}
    _export(VaeDecoderExport(vae), (torch.randn(1, int(vae.config.latent_channels), 4, 4),),  # small: a fast trace
            out / "vae_decoder" / "model.onnx", ["latent_sample"], ["sample"],
            {"latent_sample": spatial, "sample": spatial})
    if not encoder:
        return
    _export(VaeEncoderExport(vae), (torch.randn(1, int(vae.config.in_channels), 32, 32),),
            out / "vae_encoder" / "model.onnx", ["sample"], ["latent_parameters"],
            {"sample": spatial, "latent_parameters": spatial})


def write_json(path: Path, data: Any) -> None:
    """Sorted, indented JSON (diffusers' ``_use_default_values`` set sorted too: same inputs, same bytes)."""
    if isinstance(data, dict) and isinstance(data.get("_use_default_values"), list):
        data = {**data, "_use_default_values": sorted(data["_use_default_values"])}  # a set's order otherwise
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def _config(model: Any) -> dict[str, Any]:
    return dict(model.config.to_dict() if hasattr(model.config, "to_dict") else model.config)


def export_dit(components: dict[str, Any], tokenizer_dirs: dict[str, Path], out: Path,
               source: dict[str, Any], vae_encoder: bool = True, native_size: int | None = None) -> Path:
    """Export a Flux or SD 3 model's networks (fp32), copy tokenizers and scheduler config, write model_index.json
    (``OnnxFluxPipeline`` / ``OnnxStableDiffusion3Pipeline``) and the manifest. ``vae_encoder``: also the VAE
    encoder (for edits; txt2img does not need it)."""
    from diffusers import FluxTransformer2DModel

    flux = isinstance(components["transformer"], FluxTransformer2DModel)
    out.mkdir(parents=True, exist_ok=True)
    _export_text(components, flux, out)
    _export_transformer(components["transformer"], flux, out)
    _export_vae(components["vae"], out, vae_encoder)
    vaes = ["vae_decoder", "vae_encoder"] if vae_encoder else ["vae_decoder"]
    names = [n for n in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer") if n in components]
    for name in names:
        write_json(out / name / "config.json", _config(components[name]))
    for name in vaes:
        write_json(out / name / "config.json", _config(components["vae"]))
    for name, folder in tokenizer_dirs.items():
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(folder, out / name)
    scheduler = components["scheduler"]
    write_json(out / "scheduler" / "scheduler_config.json", {"_class_name": type(scheduler).__name__,
                                                             **dict(scheduler.config)})
    onnx = ["diffusers", "OnnxRuntimeModel"]
    index: dict[str, Any] = {"_class_name": "OnnxFluxPipeline" if flux else "OnnxStableDiffusion3Pipeline",
                             "scheduler": ["diffusers", type(scheduler).__name__],
                             **{n: onnx for n in [*names, *vaes]},
                             **{n: ["tokenizers", "Tokenizer"] for n in tokenizer_dirs}}
    if native_size is not None:  # engines/diffusion/dit_pipeline.py NATIVE_SIZE_KEY
        index["_sdserve_native_size"] = native_size
    write_json(out / "model_index.json", index)
    write_manifest(out, source)
    return out


def is_dit_source(src: Path) -> bool:
    """Whether a folder's model_index.json names a DiT pipeline, served or refused (`sdserve engines export`)."""
    from engines.diffusion.dit_family import is_dit_folder

    return is_dit_folder(src)


def export_dit_folder(src: Path, out: Path) -> Path:
    """Export a local diffusers FluxPipeline or StableDiffusion3Pipeline folder (fp32); ModelLoadError for an
    unsupported DiT (Flux.1 Kontext, Flux.2, ...) or an sdserve ONNX folder."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel, SD3Transformer2DModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from engines.diffusion.dit_family import detect_dit
    from engines.errors import ModelLoadError

    family = detect_dit(src)
    if (src / "manifest.json").exists() or (src / "transformer" / "model.onnx").exists():
        raise ModelLoadError(f"--from {src}: this is an sdserve ONNX model folder already; export reads a diffusers "
                             "folder (transformer/, vae/, text encoders with their config.json and weights)")
    flux = family.base == "flux"
    parts: dict[str, Any] = {
        "vae": AutoencoderKL.from_pretrained(src / "vae"),
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(src / "scheduler"),
        "transformer": (FluxTransformer2DModel if flux else SD3Transformer2DModel).from_pretrained(src / "transformer"),
    }
    if flux:
        parts["text_encoder"] = CLIPTextModel.from_pretrained(src / "text_encoder")
        parts["text_encoder_2"] = T5EncoderModel.from_pretrained(src / "text_encoder_2")
    else:
        parts["text_encoder"] = CLIPTextModelWithProjection.from_pretrained(src / "text_encoder")
        parts["text_encoder_2"] = CLIPTextModelWithProjection.from_pretrained(src / "text_encoder_2")
        parts["text_encoder_3"] = T5EncoderModel.from_pretrained(src / "text_encoder_3")
    tokenizers = {n: src / n for n in ("tokenizer", "tokenizer_2", "tokenizer_3") if (src / n).is_dir()}
    log.info("exporting %s (%s) to %s", src, family.name, out)
    return export_dit(parts, tokenizers, out, {"kind": "diffusers-folder", "family": family.name,
                                               "path_name": src.name})
