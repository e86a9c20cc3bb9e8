"""FLUX.2 [klein] with reference images (diffusers' ``Flux2KleinPipeline`` ``image=``, 0.42): the VAE encoder the
served pipeline (engines/pipelines/flux2_refs.py) encodes the input images with, exported beside the txt2img folder
engines/build/flux2.py writes. Build-time only: imports torch and diffusers.

Nothing in the transformer changes: the reference tokens go through the exported transformer as more image tokens
(the serving loop lays them out as a one-row image after the noisy ones), so the export is engines/build/flux2.py's
plus ``vae_encoder``:

- ``vae_encoder``: ``sample`` [B, 3, H, W] in [-1, 1] -> ``latent_parameters`` [B, 2 × 128, H/16, W/16]: the latent
  distribution of ``AutoencoderKLFlux2`` 2×2-patchified (``_patchify_latents``) and in the batch-norm layout the
  transformer reads (``(x - mean) / sqrt(var + eps)``), mean first, then the log-variance in the same layout
  (``logvar - log(var + eps)``), as the other DiT encoders give their moments. The pipeline takes the mean
  (``sample_mode="argmax"``).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.build.dit_export import cast_model
from engines.build.dit_folder import ONNX, config_of, half_plan, with_io, write_json
from engines.build.export import write_manifest
from engines.build.flux2 import (
    SEED,
    TINY_NATIVE_SIZE,
    export_flux2,
    export_flux2_folder,
    export_rms,
    make_flux2_components,
    save_flux2_diffusers,
    write_flux2_tokenizer,
)

log = logging.getLogger(__name__)
ENCODER_OUTPUT = "latent_parameters"
"""The encoder's output, as every exported VAE encoder names it (engines/pipelines/unet_edits.py)."""


class _VaeEncoder(torch.nn.Module):
    """Pixels [B, 3, H, W] -> the patchified, batch-normalised moments [B, 2 × 4C, H/16, W/16]."""

    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae
        var = vae.bn.running_var.detach().clone().view(1, -1, 1, 1) + vae.config.batch_norm_eps
        self.register_buffer("mean", vae.bn.running_mean.detach().clone().view(1, -1, 1, 1))
        self.register_buffer("std", torch.sqrt(var))
        self.register_buffer("log_var", torch.log(var))

    @staticmethod
    def _patchify(z: torch.Tensor) -> torch.Tensor:
        """``_patchify_latents`` with the spatial halves split by ``unflatten`` (dynamic sizes in the trace)."""
        return z.unflatten(2, (-1, 2)).unflatten(4, (-1, 2)).permute(0, 1, 3, 5, 2, 4).flatten(1, 3)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        dist = self.vae.encode(sample, return_dict=False)[0]
        mean = (self._patchify(dist.mean) - self.mean) / self.std
        return torch.cat([mean, self._patchify(dist.logvar) - self.log_var], dim=1)


def export_flux2_encoder(vae: Any, out: Path, source: dict[str, Any], dtype: str = "fp32") -> Path:
    """Add ``vae_encoder/`` (graph and config) to the exported FLUX.2 folder ``out``, name it in model_index.json
    and write the manifest again (it hashes every file); ``dtype``: the VAE's export dtype (its ``half_plan``)."""
    spatial = {0: "batch", 2: "height", 3: "width"}
    export_rms(with_io(_VaeEncoder(vae), dtype), (torch.randn(1, int(vae.config.in_channels), 32, 32),),
               out / "vae_encoder" / "model.onnx", ["sample"], [ENCODER_OUTPUT],
               {"sample": spatial, ENCODER_OUTPUT: spatial})
    write_json(out / "vae_encoder" / "config.json", config_of(vae))
    index_path = out / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    write_json(index_path, {**index, "vae_encoder": ONNX})
    write_manifest(out, source)
    return out


def build_tiny_flux2_refs(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                          distilled: bool = True) -> Path:
    """The tiny FLUX.2 [klein] (engines/build/flux2.py's networks and seeds) exported to ``out`` with its VAE
    encoder (reference images); ``diffusers_out``: the same weights as a Flux2KleinPipeline folder."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        components = make_flux2_components(write_flux2_tokenizer(tokenizer_dir, bpe), distilled)
        source = {"kind": "tiny", "family": "flux2-klein" if distilled else "flux2-klein-base", "seed": SEED}
        export_flux2(components, tokenizer_dir, out, source, native_size=TINY_NATIVE_SIZE)
        export_flux2_encoder(components["vae"], out, source)
        if diffusers_out is not None:
            save_flux2_diffusers(components, tokenizer_dir, diffusers_out)
    log.info("tiny FLUX.2 [klein] model with its VAE encoder in %s", out)
    return out


def export_flux2_refs_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers ``Flux2KleinPipeline`` folder (engines/build/flux2.py ``export_flux2_folder``) and
    its VAE encoder, the VAE loaded in fp32 and cast by the same plan."""
    from diffusers import AutoencoderKLFlux2

    export_flux2_folder(src, out, dtype)
    source = json.loads((out / "manifest.json").read_text(encoding="utf-8")).get("source", {})
    vae = AutoencoderKLFlux2.from_pretrained(src / "vae").eval()
    vae_dtype = half_plan(dtype, config_of(vae))["vae"]
    cast_model(vae, vae_dtype)
    return export_flux2_encoder(vae, out, source, vae_dtype)
