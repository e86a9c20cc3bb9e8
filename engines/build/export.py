"""Export a diffusers Stable Diffusion 1.x/2.x folder to the ONNX layout optimum uses, plus a manifest.

Build-time only: imports torch and diffusers. Output layout::

    text_encoder/model.onnx  unet/model.onnx  vae_decoder/model.onnx  (+ config.json each)
    tokenizer/  scheduler/scheduler_config.json  model_index.json  manifest.json
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from engines.artifacts import sha256_file

log = logging.getLogger(__name__)
OPSET = 17


class _TextEncoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, return_dict=False)[0]


class _UNet(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.model(sample, timestep, hidden, return_dict=False)[0]


class _VaeDecoder(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        return self.model.decode(latent_sample, return_dict=False)[0]


def _export(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The tracer warns about every Python branch on shapes in diffusers/transformers: expected, and noise here.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(module.eval(), args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)


def _write_json(path: Path, data: Any) -> None:
    if isinstance(data, dict) and isinstance(data.get("_use_default_values"), list):
        # diffusers fills this list from a set: its order changes with the process's hash seed.
        data = {**data, "_use_default_values": sorted(data["_use_default_values"])}
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")


def export_components(text_encoder: Any, unet: Any, vae: Any, scheduler_config: dict[str, Any],
                      tokenizer_dir: Path, out: Path, source: dict[str, Any]) -> Path:
    """Export the three networks, copy tokenizer and scheduler config, and write model_index and manifest."""
    out.mkdir(parents=True, exist_ok=True)
    hidden = int(text_encoder.config.hidden_size)
    channels = int(unet.config.in_channels)
    latent_channels = int(vae.config.latent_channels)
    sample = int(unet.config.sample_size) if isinstance(unet.config.sample_size, int) else 8
    _export(_TextEncoder(text_encoder), (torch.zeros(1, 77, dtype=torch.int64),),
            out / "text_encoder" / "model.onnx", ["input_ids"], ["last_hidden_state"],
            {"input_ids": {0: "batch"}, "last_hidden_state": {0: "batch"}})
    _export(_UNet(unet), (torch.randn(2, channels, sample, sample), torch.tensor([1.0]), torch.randn(2, 77, hidden)),
            out / "unet" / "model.onnx", ["sample", "timestep", "encoder_hidden_states"], ["out_sample"],
            {"sample": {0: "batch", 2: "height", 3: "width"}, "encoder_hidden_states": {0: "batch"},
             "out_sample": {0: "batch", 2: "height", 3: "width"}})
    _export(_VaeDecoder(vae), (torch.randn(1, latent_channels, sample, sample),),
            out / "vae_decoder" / "model.onnx", ["latent_sample"], ["sample"],
            {"latent_sample": {0: "batch", 2: "height", 3: "width"}, "sample": {0: "batch", 2: "height", 3: "width"}})
    for name, model in (("text_encoder", text_encoder), ("unet", unet), ("vae_decoder", vae)):
        config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(model.config)
        _write_json(out / name / "config.json", config)
    if (out / "tokenizer").exists():
        shutil.rmtree(out / "tokenizer")
    shutil.copytree(tokenizer_dir, out / "tokenizer")
    (out / "scheduler").mkdir(exist_ok=True)
    _write_json(out / "scheduler" / "scheduler_config.json", scheduler_config)
    _write_json(out / "model_index.json", {
        "_class_name": "OnnxStableDiffusionPipeline",
        "scheduler": ["diffusers", scheduler_config.get("_class_name", "PNDMScheduler")],
        "text_encoder": ["diffusers", "OnnxRuntimeModel"], "unet": ["diffusers", "OnnxRuntimeModel"],
        "vae_decoder": ["diffusers", "OnnxRuntimeModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
    })
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
    """manifest.json: sha256 of every file and the versions that built them (no timestamps: same inputs and
    versions give the same manifest)."""
    files = {p.relative_to(out).as_posix(): sha256_file(p)
             for p in sorted(out.rglob("*")) if p.is_file() and p.name != "manifest.json"}
    _write_json(out / "manifest.json", {"format": 1, "opset": OPSET, "source": source,
                                        "built_with": build_versions(), "files": files})


def export_folder(src: Path, out: Path) -> Path:
    """Export a local diffusers Stable Diffusion folder (SD 1.x/2.x: CLIP text encoder, UNet, AutoencoderKL)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    if not (src / "model_index.json").is_file():
        raise FileNotFoundError(f"{src} is not a diffusers folder (no model_index.json)")
    text_encoder = CLIPTextModel.from_pretrained(src / "text_encoder")
    unet = UNet2DConditionModel.from_pretrained(src / "unet")
    vae = AutoencoderKL.from_pretrained(src / "vae")
    scheduler_config = json.loads((src / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
    log.info("exporting %s to %s", src, out)
    return export_components(text_encoder, unet, vae, scheduler_config, src / "tokenizer", out,
                             {"kind": "diffusers-folder", "path_name": src.name})
