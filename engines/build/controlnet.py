"""SD 1.x and SDXL ControlNets: the tiny faithful ones, the ONNX export of a diffusers ``ControlNetModel`` folder,
and the UNet variant that takes the ControlNet residuals (issue 56).

Build-time only: imports torch and diffusers. Layouts::

    ControlNet folder:  model.onnx  config.json  manifest.json
        inputs  sample [B,4,h,w], timestep [B], encoder_hidden_states [B,77,D], controlnet_cond [B,3,H,W] (pixels in
                [0, 1], H = 8h), conditioning_scale [B] (one scale per row: rows of several requests can share a call)
        SDXL's (config addition_embed_type "text_time") take its added conditions too, after controlnet_cond:
                text_embeds [B,P] (the pooled projection), time_ids [B,6]; conditioning_scale stays last
        outputs down_block_res_sample_<i> (one per UNet down-block residual: 12 on SD 1.5, 9 on SDXL),
                mid_block_res_sample
    model folder:       unet_controlnet/model.onnx (+ config.json), beside the plain unet/ (which stays as it was:
                        a model without ControlNet runs no slower)
        inputs  sample, timestep, encoder_hidden_states, down_block_additional_residual_<i>,
                mid_block_additional_residual (SDXL: text_embeds, time_ids after encoder_hidden_states, as
                its plain unet/ takes them);  output out_sample

The tiny ControlNets have their tiny UNet's widths (engines/build/tiny.py UNET, UNET_SDXL). diffusers zero-initialises a
ControlNet's output convolutions (``zero_module``): a tiny one built so would add nothing and prove nothing, so its
zero convolutions get seeded random weights instead, as a trained ControlNet's are non-zero.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engines.artifacts import MANIFEST, read_manifest, write_model_manifest
from engines.build.export import export_graph, write_json, write_manifest
from engines.build.tiny import SEED, UNET, UNET_SDXL

CONTROLNET = {key: UNET[key] for key in ("block_out_channels", "layers_per_block", "in_channels",
                                         "down_block_types", "cross_attention_dim", "attention_head_dim",
                                         "norm_num_groups")}
CONTROLNET |= {"conditioning_embedding_out_channels": (8, 16, 32, 32)}
"""The tiny UNet's widths; the conditioning embedding keeps four levels (a factor 8 from pixels to latents)."""
CONTROLNET_SDXL = {key: UNET_SDXL[key] for key in (*CONTROLNET, "use_linear_projection", "transformer_layers_per_block",
                                                   "addition_embed_type", "addition_time_embed_dim",
                                                   "projection_class_embeddings_input_dim") if key in UNET_SDXL}
CONTROLNET_SDXL |= {"conditioning_embedding_out_channels": CONTROLNET["conditioning_embedding_out_channels"]}
"""The tiny SDXL UNet's widths and its ``text_time`` added conditioning (diffusers' SDXL ControlNets carry both)."""
CONFIGS = {"sd1": CONTROLNET, "sdxl": CONTROLNET_SDXL}
ZERO_CONV_STD = 0.05
"""Standard deviation of the tiny ControlNet's (otherwise zero) output convolutions."""
EMBED_GAIN = 2.0
"""The tiny control embedding's weight scale over sqrt(fan-in): the residuals then follow the control image (a moved
shape moves a 64x64 image by ~11 levels, tests/e2e/test_controlnet_serving.py; at diffusers' init the image moved
them by 1e-4 of their size: the image did not matter)."""


def down_residuals(config: Any) -> int:
    """How many down-block residuals a UNet or ControlNet of ``config`` gives: the input conv's, one per resnet
    layer, one per downsampler (every block but the last): 12 on SD 1.5."""
    blocks = len(config["block_out_channels"] if isinstance(config, dict) else config.block_out_channels)
    layers = int(config["layers_per_block"] if isinstance(config, dict) else config.layers_per_block)
    return 1 + blocks * layers + (blocks - 1)


def is_xl(config: Any) -> bool:
    """Whether a UNet or ControlNet of ``config`` takes SDXL's added conditions (text_embeds, time_ids)."""
    kind = config.get("addition_embed_type") if isinstance(config, dict) else config.addition_embed_type
    return kind == "text_time"


def pooled_width(config: Any) -> int:
    """The pooled text embedding's width an SDXL UNet or ControlNet takes: its added-embedding input less the six
    time ids' sinusoidal embeddings."""
    return int(config.projection_class_embeddings_input_dim) - 6 * int(config.addition_time_embed_dim)


def make_tiny_controlnet(seed: int = SEED, family: str = "sd1") -> Any:
    """The tiny ControlNet of ``family`` (sd1 or sdxl), seeded, its zero convolutions given random weights and its
    control embedding scaled so the control image steers it, as a trained net's does."""
    from diffusers import ControlNetModel

    if family not in CONFIGS:
        raise ValueError(f"no tiny ControlNet for {family!r}; expected one of {TINY_FAMILIES}")
    torch.manual_seed(seed + 7)  # not the UNet's weights again
    net = ControlNetModel(**CONFIGS[family]).eval()
    generator = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for conv in [*net.controlnet_down_blocks, net.controlnet_mid_block]:
            for param in conv.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * ZERO_CONV_STD)
        # the control embedding: diffusers zero-initialises its conv_out, and at default init its bias terms drown
        # the image after three stride-2 convs; so He-like weights, no biases, and the image steers the residuals
        embedding = net.controlnet_cond_embedding
        for conv in [embedding.conv_in, *embedding.blocks, embedding.conv_out]:
            fan_in = conv.weight[0].numel()
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * (EMBED_GAIN / fan_in ** 0.5))
            conv.bias.zero_()
    return net


class _ControlNet(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor, cond: torch.Tensor,
                scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        down, mid = self.model(sample, timestep, hidden, cond, conditioning_scale=1.0, return_dict=False)
        rows = scale.reshape(-1, 1, 1, 1)  # diffusers multiplies every residual by the (scalar) scale
        return (*[d * rows for d in down], mid * rows)


class _ControlNetXL(torch.nn.Module):
    """SDXL's ControlNet: the UNet's added conditions (pooled text embeddings, time ids) go into it too."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor, cond: torch.Tensor,
                text_embeds: torch.Tensor, time_ids: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        down, mid = self.model(sample, timestep, hidden, cond, conditioning_scale=1.0, added_cond_kwargs=added,
                               return_dict=False)
        rows = scale.reshape(-1, 1, 1, 1)
        return (*[d * rows for d in down], mid * rows)


class _ControlledUNet(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor,
                *residuals: torch.Tensor) -> torch.Tensor:
        return self.model(sample, timestep, hidden, down_block_additional_residuals=list(residuals[:-1]),
                          mid_block_additional_residual=residuals[-1], return_dict=False)[0]


class _ControlledUNetXL(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor, text_embeds: torch.Tensor,
                time_ids: torch.Tensor, *residuals: torch.Tensor) -> torch.Tensor:
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.model(sample, timestep, hidden, added_cond_kwargs=added,
                          down_block_additional_residuals=list(residuals[:-1]),
                          mid_block_additional_residual=residuals[-1], return_dict=False)[0]


def _added_conditions(config: Any, rows: int, size: int) -> tuple[list[torch.Tensor], list[str], dict[str, Any]]:
    """SDXL's added-condition example inputs, names and dynamic axes (none for SD 1.x/2.x)."""
    if not is_xl(config):
        return [], [], {}
    pixels = float(size * 8)
    args = [torch.randn(rows, pooled_width(config)), torch.tensor([[pixels, pixels, 0.0, 0.0, pixels, pixels]] * rows)]
    return args, ["text_embeds", "time_ids"], {"text_embeds": {0: "batch"}, "time_ids": {0: "batch"}}


def _residual_shapes(config: Any, rows: int, size: int) -> list[tuple[int, ...]]:
    """The residuals' shapes for a latent ``size`` x ``size`` (down blocks, then the mid block)."""
    channels = list(config.block_out_channels)
    layers = int(config.layers_per_block)
    shapes = [(rows, channels[0], size, size)]
    for level, width in enumerate(channels):
        shapes += [(rows, width, size, size)] * layers
        if level < len(channels) - 1:
            size //= 2
            shapes.append((rows, width, size, size))
    return shapes + [(rows, channels[-1], size, size)]


def _residual_dynamic(count: int, prefix: str, mid: str) -> dict[str, dict[int, str]]:
    names = [f"{prefix}_{i}" for i in range(count)] + [mid]
    return {name: {0: "batch", 2: f"height{i}", 3: f"width{i}"} for i, name in enumerate(names)}


def export_controlnet(net: Any, out: Path, source: dict[str, Any]) -> Path:
    """``net`` (a diffusers ControlNetModel, SD 1.x/2.x or SDXL) as ``out``/model.onnx with its config.json and
    manifest."""
    out.mkdir(parents=True, exist_ok=True)
    size, rows = 8, 2
    count = down_residuals(net.config)
    added, added_names, added_dynamic = _added_conditions(net.config, rows, size)
    args = (torch.randn(rows, int(net.config.in_channels), size, size), torch.tensor([1.0] * rows),
            torch.randn(rows, 77, int(net.config.cross_attention_dim)), torch.rand(rows, 3, size * 8, size * 8),
            *added, torch.ones(rows))
    outputs = [f"down_block_res_sample_{i}" for i in range(count)] + ["mid_block_res_sample"]
    dynamic = {"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "batch"},
               "encoder_hidden_states": {0: "batch"}, "controlnet_cond": {0: "batch", 2: "pixels_h", 3: "pixels_w"},
               "conditioning_scale": {0: "batch"}, **added_dynamic,
               **_residual_dynamic(count, "down_block_res_sample", "mid_block_res_sample")}
    module = _ControlNetXL(net) if added else _ControlNet(net)
    export_graph(module, args, out / "model.onnx", ["sample", "timestep", "encoder_hidden_states", "controlnet_cond",
                                                    *added_names, "conditioning_scale"], outputs, dynamic)
    write_json(out / "config.json", {"_class_name": "ControlNetModel", **dict(net.config)})
    write_manifest(out, source)
    return out


def export_controlled_unet(unet: Any, out: Path) -> Path:
    """``unet`` (SD 1.x/2.x or SDXL) with the residual inputs, as ``out``/unet_controlnet/model.onnx (+ config.json)."""
    size, rows = 8, 2
    count = down_residuals(unet.config)
    residuals = [torch.randn(shape) for shape in _residual_shapes(unet.config, rows, size)]
    added, added_names, added_dynamic = _added_conditions(unet.config, rows, size)
    args = (torch.randn(rows, int(unet.config.in_channels), size, size), torch.tensor([1.0] * rows),
            torch.randn(rows, 77, int(unet.config.cross_attention_dim)), *added, *residuals)
    inputs = ["sample", "timestep", "encoder_hidden_states", *added_names,
              *[f"down_block_additional_residual_{i}" for i in range(count)], "mid_block_additional_residual"]
    dynamic = {"sample": {0: "batch", 2: "height", 3: "width"}, "timestep": {0: "steps"},
               "encoder_hidden_states": {0: "batch"}, "out_sample": {0: "batch", 2: "height", 3: "width"},
               **added_dynamic,
               **_residual_dynamic(count, "down_block_additional_residual", "mid_block_additional_residual")}
    target = out / "unet_controlnet"
    module = _ControlledUNetXL(unet) if added else _ControlledUNet(unet)
    export_graph(module, args, target / "model.onnx", inputs, ["out_sample"], dynamic)
    write_json(target / "config.json", dict(unet.config))
    if (out / MANIFEST).is_file():  # the folder's manifest covers the new files too (its other keys kept)
        kept = {k: v for k, v in read_manifest(out / MANIFEST).items() if k not in ("files", "format")}
        write_model_manifest(out, kept)
    return target


TINY_FAMILIES = ("sd1", "sdxl")
"""The families a tiny ControlNet is built for (the UNet it mirrors)."""


def tiny_family(model: Path) -> str:
    """The tiny family of the model folder ``model``: flux or flux-schnell for a FLUX.1 folder (its transformer's
    guidance_embeds), sdxl when its model_index.json names a second text encoder, else sd1 (``engines tiny
    --controlnet`` is refused for the other families before anything is built)."""
    index = json.loads((model / "model_index.json").read_text(encoding="utf-8"))
    if index.get("_class_name") == "OnnxFluxPipeline":  # FLUX.1: engines/build/controlnet_dit.py
        config = json.loads((model / "transformer" / "config.json").read_text(encoding="utf-8"))
        return "flux" if config.get("guidance_embeds") else "flux-schnell"
    return "sdxl" if index.get("text_encoder_2") else "sd1"


def build_tiny_controlnet(out: Path, model: Path | None = None, diffusers_out: Path | None = None,
                          family: str | None = None) -> Path:
    """The tiny ControlNet of ``family`` (default: the family of ``model``, else sd1) exported to ``out``; with
    ``model`` (that tiny model's folder) its UNet's residual variant is added there; ``diffusers_out``: the
    ControlNet's torch weights too (parity tests)."""
    family = family or (tiny_family(model) if model is not None else "sd1")
    from engines.build.controlnet_dit import TINY_FLUX_FAMILIES, build_tiny_flux_controlnet

    if family in TINY_FLUX_FAMILIES:
        return build_tiny_flux_controlnet(out, model, diffusers_out, family=family)
    net = make_tiny_controlnet(family=family)
    export_controlnet(net, out, {"kind": "tiny", "family": f"{family}-controlnet", "seed": SEED})
    if model is not None:
        from engines.build.tiny import make_family_components

        export_controlled_unet(make_family_components(family)["unet"], model)
    if diffusers_out is not None:
        net.save_pretrained(diffusers_out)
    return out


def export_controlnet_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers ControlNet folder (config.json with ``_class_name`` ControlNetModel, or
    FluxControlNetModel: engines/build/controlnet_dit.py, which alone takes a half ``dtype``)."""
    from diffusers import ControlNetModel

    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{src} is not a diffusers ControlNet folder (no config.json)")
    kind = json.loads(config_path.read_text(encoding="utf-8")).get("_class_name")
    if kind == "FluxControlNetModel":
        from engines.build.controlnet_dit import export_flux_controlnet_folder

        return export_flux_controlnet_folder(src, out, dtype)
    if dtype != "fp32":
        raise ValueError(f"{src}: an SD ControlNet exports in fp32 only, not {dtype}")
    if kind != "ControlNetModel":
        raise ValueError(f"{src}: config.json names {kind!r}, not ControlNetModel (an SD 1.x/2.x or SDXL "
                         "ControlNet)")
    return export_controlnet(ControlNetModel.from_pretrained(src).eval(), out,
                             {"kind": "diffusers-folder", "path_name": src.name})


def export_controlled_unet_folder(src: Path, out: Path) -> Path:
    """Add unet_controlnet/ to the exported model ``out`` from the diffusers SD folder ``src`` it came from."""
    from diffusers import UNet2DConditionModel

    return export_controlled_unet(UNet2DConditionModel.from_pretrained(src / "unet").eval(), out)
