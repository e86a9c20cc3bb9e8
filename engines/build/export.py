"""Export a diffusers Stable Diffusion folder (SD 1.x, 2.x, SDXL, Turbo) to the ONNX layout optimum uses, plus a
manifest.

Build-time only: imports torch and diffusers. Output layout::

    text_encoder/model.onnx  unet/model.onnx  vae_decoder/model.onnx  vae_encoder/model.onnx  (+ config.json each)
    tokenizer/  scheduler/scheduler_config.json  model_index.json  manifest.json
    SDXL also: text_encoder_2/model.onnx (+ config.json)  tokenizer_2/

SDXL text encoders are exported with the outputs optimum gives them, named alike (``last_hidden_state``,
``text_embeds`` of the second), but of ``hidden_states.<i>`` only the penultimate one the pipeline reads
(``hidden_states.<num_hidden_layers - 1>``): optimum exports every layer's, which loads too.

The VAE encoder (edits: img2img, inpainting) outputs ``latent_parameters``, the moments (mean and log-variance
concatenated on channels, before diffusers' clamp) as optimum names them: the serving pipeline samples the latent
distribution itself with each request's seed, as diffusers' ``DiagonalGaussianDistribution.sample`` does.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from engines.artifacts import write_model_manifest

log = logging.getLogger(__name__)
OPSET = 17


class _TextEncoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, return_dict=False)[0]


class _TextEncoderXL(torch.nn.Module):
    """SDXL's encoders: ([text_embeds,] last_hidden_state, penultimate hidden state)."""

    def __init__(self, model: torch.nn.Module, pooled: bool) -> None:
        super().__init__()
        self.model = model
        self.pooled = pooled

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids, output_hidden_states=True)
        states = (out.last_hidden_state, out.hidden_states[-2])
        return (out.text_embeds, *states) if self.pooled else states


class _UNet(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.model(sample, timestep, hidden, return_dict=False)[0]


class _UNetXL(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor, text_embeds: torch.Tensor,
                time_ids: torch.Tensor) -> torch.Tensor:
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.model(sample, timestep, hidden, added_cond_kwargs=added, return_dict=False)[0]


class VaeDecoderExport(torch.nn.Module):
    """Latents (already divided by the scaling factor) -> the decoded image in [-1, 1] (every family's VAE)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        return self.model.decode(latent_sample, return_dict=False)[0]


class VaeEncoderExport(torch.nn.Module):
    """Image in [-1, 1] -> the latent distribution's moments (``AutoencoderKL.encode(x).latent_dist.parameters``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.model.encode(sample, return_dict=False)[0].parameters


def export_graph(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The tracer warns about every Python branch on shapes in diffusers/transformers: expected, and noise here.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)


def write_json(path: Path, data: Any) -> None:
    if isinstance(data, dict) and isinstance(data.get("_use_default_values"), list):
        # diffusers fills this list from a set: its order changes with the process's hash seed.
        data = {**data, "_use_default_values": sorted(data["_use_default_values"])}
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def _export_text_encoders(text_encoder: Any, text_encoder_2: Any | None, out: Path) -> None:
    ids = (torch.zeros(1, 77, dtype=torch.int64),)
    if text_encoder_2 is None:
        export_graph(_TextEncoder(text_encoder), ids, out / "text_encoder" / "model.onnx", ["input_ids"],
                ["last_hidden_state"], {"input_ids": {0: "batch"}, "last_hidden_state": {0: "batch"}})
        return
    for name, model, pooled in (("text_encoder", text_encoder, False), ("text_encoder_2", text_encoder_2, True)):
        penultimate = f"hidden_states.{int(model.config.num_hidden_layers) - 1}"
        names = [*(["text_embeds"] if pooled else []), "last_hidden_state", penultimate]
        export_graph(_TextEncoderXL(model, pooled), ids, out / name / "model.onnx", ["input_ids"], names,
                {n: {0: "batch"} for n in ["input_ids", *names]})


def _export_unet(unet: Any, hidden: int, out: Path, pooled: int | None) -> None:
    channels = int(unet.config.in_channels)
    sample = int(unet.config.sample_size) if isinstance(unet.config.sample_size, int) else 8
    # One timestep per row (diffusers expands a [1] or [B] timestep to the sample's batch): rows at different
    # steps share one call under step-level batching (server/stepper.py). A [1] timestep still broadcasts.
    args = [torch.randn(2, channels, sample, sample), torch.tensor([1.0, 1.0]), torch.randn(2, 77, hidden)]
    names = ["sample", "timestep", "encoder_hidden_states"]
    dynamic = {"sample": {0: "batch", 2: "height", 3: "width"}, "encoder_hidden_states": {0: "batch"},
               "timestep": {0: "steps"},
               "out_sample": {0: "batch", 2: "height", 3: "width"}}
    module: torch.nn.Module = _UNet(unet)
    if pooled is not None:  # SDXL's added conditioning: pooled text embeddings and the six time ids
        module = _UNetXL(unet)
        args += [torch.randn(2, pooled), torch.tensor([[float(sample * 8)] * 2 + [0.0] * 2 + [sample * 8.0] * 2] * 2)]
        names += ["text_embeds", "time_ids"]
        dynamic |= {"text_embeds": {0: "batch"}, "time_ids": {0: "batch"}}
    export_graph(module, tuple(args), out / "unet" / "model.onnx", names, ["out_sample"], dynamic)


def export_components(text_encoder: Any, unet: Any, vae: Any, scheduler_config: dict[str, Any],
                      tokenizer_dir: Path, out: Path, source: dict[str, Any], text_encoder_2: Any | None = None,
                      tokenizer_2_dir: Path | None = None, force_zeros_for_empty_prompt: bool = True) -> Path:
    """Export the networks, copy tokenizer(s) and scheduler config, and write model_index and manifest. With
    ``text_encoder_2`` (SDXL) the UNet takes text_embeds and time_ids too."""
    out.mkdir(parents=True, exist_ok=True)
    xl = text_encoder_2 is not None
    hidden = int(unet.config.cross_attention_dim) if xl else int(text_encoder.config.hidden_size)
    latent_channels = int(vae.config.latent_channels)
    sample = int(unet.config.sample_size) if isinstance(unet.config.sample_size, int) else 8
    _export_text_encoders(text_encoder, text_encoder_2, out)
    _export_unet(unet, hidden, out, int(text_encoder_2.config.projection_dim) if xl else None)
    export_graph(VaeDecoderExport(vae), (torch.randn(1, latent_channels, sample, sample),),
            out / "vae_decoder" / "model.onnx", ["latent_sample"], ["sample"],
            {"latent_sample": {0: "batch", 2: "height", 3: "width"}, "sample": {0: "batch", 2: "height", 3: "width"}})
    pixels = sample * 2 ** (len(vae.config.block_out_channels) - 1)
    export_graph(VaeEncoderExport(vae), (torch.randn(1, int(vae.config.in_channels), pixels, pixels),),
            out / "vae_encoder" / "model.onnx", ["sample"], ["latent_parameters"],
            {"sample": {0: "batch", 2: "height", 3: "width"},
             "latent_parameters": {0: "batch", 2: "height", 3: "width"}})
    parts = [("text_encoder", text_encoder), ("unet", unet), ("vae_decoder", vae), ("vae_encoder", vae)]
    for name, model in parts + ([("text_encoder_2", text_encoder_2)] if xl else []):
        config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
        write_json(out / name / "config.json", config)
    for name, folder in (("tokenizer", tokenizer_dir), ("tokenizer_2", tokenizer_2_dir)):
        if folder is None:
            continue
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(folder, out / name)
    (out / "scheduler").mkdir(exist_ok=True)
    write_json(out / "scheduler" / "scheduler_config.json", scheduler_config)
    index: dict[str, Any] = {
        "_class_name": "OnnxStableDiffusionPipeline",
        "scheduler": ["diffusers", scheduler_config.get("_class_name", "PNDMScheduler")],
        "text_encoder": ["diffusers", "OnnxRuntimeModel"], "unet": ["diffusers", "OnnxRuntimeModel"],
        "vae_decoder": ["diffusers", "OnnxRuntimeModel"], "vae_encoder": ["diffusers", "OnnxRuntimeModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
    }
    if int(unet.config.in_channels) == 9:  # masked-image latents + mask concatenated to the latents
        index["_class_name"] = "OnnxStableDiffusionInpaintPipeline"
    
    if xl:
        index |= {"_class_name": "OnnxStableDiffusionXLPipeline", "text_encoder_2": ["diffusers", "OnnxRuntimeModel"],
                  "tokenizer_2": ["transformers", "CLIPTokenizer"],
                  "force_zeros_for_empty_prompt": force_zeros_for_empty_prompt}
    write_json(out / "model_index.json", index)
    write_manifest(out, source)
    return out


def build_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("sdserve", "torch", "diffusers", "transformers", "onnx", "tokenizers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "absent"
    return found


def write_manifest(out: Path, source: dict[str, Any]) -> None:
    """manifest.json: sha256 and size of every file and the versions that built them (no timestamps: same inputs
    and versions give the same manifest)."""
    write_model_manifest(out, {"opset": OPSET, "source": source, "built_with": build_versions()})


def export_folder(src: Path, out: Path) -> Path:
    """Export a local diffusers folder: SD 1.x/2.x/Turbo (CLIP text encoder, UNet, AutoencoderKL) or SDXL (a second,
    projecting text encoder and tokenizer_2)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    if not (src / "model_index.json").is_file():
        raise FileNotFoundError(f"{src} is not a diffusers folder (no model_index.json)")
    index = json.loads((src / "model_index.json").read_text(encoding="utf-8"))
    xl = (src / "text_encoder_2").is_dir()
    text_encoder = CLIPTextModel.from_pretrained(src / "text_encoder")
    text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(src / "text_encoder_2") if xl else None
    unet = UNet2DConditionModel.from_pretrained(src / "unet")
    vae = AutoencoderKL.from_pretrained(src / "vae")
    scheduler_config = json.loads((src / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
    log.info("exporting %s (%s) to %s", src, index.get("_class_name", "?"), out)
    return export_components(text_encoder, unet, vae, scheduler_config, src / "tokenizer", out,
                             {"kind": "diffusers-folder", "path_name": src.name}, text_encoder_2,
                             src / "tokenizer_2" if xl else None,
                             bool(index.get("force_zeros_for_empty_prompt", True)))
