"""FLUX.1 Kontext [dev] (diffusers' ``FluxKontextPipeline``, 0.42): the tiny faithful model and the ONNX export of
local diffusers folders (`sdserve engines export --from`). Build-time only: imports torch and diffusers.

Kontext's networks are Flux.1 dev's: ``FluxTransformer2DModel`` with the guidance embedding (the pipeline feeds the
reference tokens through the same transformer, after the noisy ones, with their own position ids: nothing in the
network changes), CLIP-L and T5, and Flux.1's 16-channel VAE, whose encoder is exported too (the reference
image's latents). So the tiny model is the tiny Flux.1 dev (engines/build/dit.py, its seeds) and the export is
dit_export's Flux.1 path; only the folder's ``model_index.json`` class names Kontext (``OnnxFluxKontextPipeline``,
claimed by the ``flux-kontext`` registry row).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from engines.build.dit_export import export_dit, write_json
from engines.build.export import write_manifest

log = logging.getLogger(__name__)
CLASS_NAME = "OnnxFluxKontextPipeline"
"""model_index.json ``_class_name`` of an exported folder."""
DIFFUSERS_CLASS = "FluxKontextPipeline"


def _rename(folder: Path, class_name: str, source: dict[str, Any] | None = None) -> None:
    """model_index.json's class set to ``class_name``; ``source``: the manifest written again (it hashes the
    index)."""
    path = folder / "model_index.json"
    write_json(path, {**json.loads(path.read_text(encoding="utf-8")), "_class_name": class_name})
    if source is not None:
        write_manifest(folder, source)


def build_tiny_kontext(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                       vae_encoder: bool = True, first_block: bool = False) -> Path:
    """The tiny Kontext model (the tiny Flux.1 dev's networks and seeds) exported to ``out`` with its VAE encoder;
    ``diffusers_out``: the same weights as a FluxKontextPipeline folder."""
    from engines.build.dit import SEED, TINY_NATIVE_SIZE, make_dit_components, save_dit_diffusers, write_tokenizers

    if first_block or not vae_encoder:
        raise ValueError("FLUX.1 Kontext is exported with its VAE encoder and without the first-block parts")
    components = make_dit_components("flux", bpe=bpe)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dirs = write_tokenizers("flux", Path(tmp), bpe)
        source = {"kind": "tiny", "family": "flux-kontext", "seed": SEED}
        export_dit(components, tokenizer_dirs, out, source, vae_encoder=True, native_size=TINY_NATIVE_SIZE)
        _rename(out, CLASS_NAME, source)
        if diffusers_out is not None:
            save_dit_diffusers("flux", components, tokenizer_dirs, diffusers_out)
            _rename(diffusers_out, DIFFUSERS_CLASS)
    log.info("tiny flux-kontext model in %s", out)
    return out


def export_kontext_folder(src: Path, out: Path) -> Path:
    """Export a local diffusers FluxKontextPipeline folder (fp32) through dit_export's Flux.1 path."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    from engines.errors import ModelLoadError
    from engines.pipelines.flow_family import detect_dit

    family = detect_dit(src)
    if (src / "manifest.json").exists() or (src / "transformer" / "model.onnx").exists():
        raise ModelLoadError(f"--from {src}: this is an sdserve ONNX model folder already; export reads a diffusers "
                             "folder (transformer/, vae/, text encoders with their config.json and weights)")
    parts: dict[str, Any] = {
        "vae": AutoencoderKL.from_pretrained(src / "vae"),
        "scheduler": FlowMatchEulerDiscreteScheduler.from_pretrained(src / "scheduler"),
        "transformer": FluxTransformer2DModel.from_pretrained(src / "transformer"),
        "text_encoder": CLIPTextModel.from_pretrained(src / "text_encoder"),
        "text_encoder_2": T5EncoderModel.from_pretrained(src / "text_encoder_2"),
    }
    tokenizers = {n: src / n for n in ("tokenizer", "tokenizer_2") if (src / n).is_dir()}
    log.info("exporting %s (%s) to %s", src, family.name, out)
    source = {"kind": "diffusers-folder", "family": family.name, "path_name": src.name}
    export_dit(parts, tokenizers, out, source, vae_encoder=True)
    _rename(out, CLASS_NAME, source)
    return out
