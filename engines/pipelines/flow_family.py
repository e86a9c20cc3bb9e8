"""The flow-matching DiT families: Flux.1 (dev-like and schnell-like) and Stable Diffusion 3 / 3.5, told from a
folder's ``model_index.json`` and component configs before any session runs.

- ``flux``: FLUX.1 [dev]-like: CLIP-L pooled output + T5 states, a guidance-distilled transformer
  (``guidance_embeds``: the guidance scale is an input of the network, no CFG), resolution-dependent shift (``mu``).
- ``flux-schnell``: FLUX.1 [schnell]-like: no guidance embedding, few steps, no shift.
- ``sd3``: SD 3: CLIP-L + CLIP-G (penultimate states and pooled projections) + T5, CFG with a negative prompt,
  static shift.
- ``sd35``: SD 3.5: the same with ``qk_norm`` (and, for 3.5 Medium, dual attention layers).
- ``qwen-image``: Qwen-Image: a Qwen2.5-VL text encoder's last states (a chat template, its system prefix dropped),
  2×2-packed latents with centred rotary positions, true CFG with a negative prompt and norm rescaling
  (engines/pipelines/qwen.py).
- ``flux2-klein`` / ``flux2-klein-base``: FLUX.2 [klein] step-distilled / base (engines/pipelines/flux2.py).
- ``flux2-dev``: FLUX.2 [dev]: a Mistral Small 3.1 text encoder, the guidance embedded
  (engines/pipelines/flux2_dev.py).

- ``flux-kontext``: FLUX.1 Kontext [dev]: Flux.1 dev with a reference image's tokens in the sequence (instruction
  edits, engines/pipelines/kontext.py).
- ``qwen-image-edit``: Qwen-Image-Edit-Plus 2509/2511: Qwen-Image with the input images through the vision tower and
  their latents in the sequence (instruction edits, engines/pipelines/qwen_edit.py).

Refused by name: Flux.1 Kontext inpainting, FLUX.2 [klein] inpainting and KV-cached editing, the Flux tools
(Fill, Canny/Depth control, Redux) and ControlNets; the Qwen-Image variants other than text-to-image, img2img and
Edit Plus 2509/2511 (the first Edit, Layered, inpainting, ControlNet, Qwen-Image 2.1): a folder of one of them
raises ModelLoadError saying what it is and what is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines import architectures, families
from engines.errors import ModelLoadError
from engines.pipelines.unet_family import read_json

DIT_FAMILIES = families.names("transformer")
SERVED = ("sdserve serves Flux.1 dev/schnell (FluxPipeline), SD 3 / 3.5 (StableDiffusion3Pipeline), Qwen-Image "
          "(QwenImagePipeline), Z-Image (ZImagePipeline), FLUX.2 [klein] (Flux2KleinPipeline), FLUX.2 [dev] "
          "(Flux2Pipeline) and FLUX.1 Kontext [dev] (FluxKontextPipeline), Qwen-Image-Edit-Plus 2509/2511 "
          "(QwenImageEditPlusPipeline) DiT folders")
REFUSED: dict[str, str] = {
    "FluxKontextInpaint": "Flux.1 Kontext inpainting (masks are not served for the DiT families)",
    "Flux2KleinInpaint": "FLUX.2 [klein] inpainting (masks are not served for the DiT families)",
    "Flux2KleinKV": "FLUX.2 [klein] with a reference-image KV cache (image-conditioned editing)",
    "FluxFill": "Flux.1 Fill (inpainting/outpainting tool)",
    "FluxControl": "Flux.1 Canny/Depth control",
    "FluxPriorRedux": "Flux.1 Redux (image variation)",
    "StableDiffusion3ControlNet": "an SD 3 ControlNet pipeline",
    "QwenImageEditPipeline": "Qwen-Image-Edit (the first release: one input image, its own template; Qwen-Image-"
                             "Edit-Plus 2509, QwenImageEditPlusPipeline, is served)",
    "QwenImageEditInpaint": "Qwen-Image-Edit inpainting (masks are not served for the DiT families)",
    "QwenImageLayered": "Qwen-Image-Layered (layer decomposition)",
    "QwenImageInpaint": "Qwen-Image inpainting (masks are not served for the DiT families)",
    "QwenImageControlNet": "a Qwen-Image ControlNet pipeline",
    "QwenImage21": "Qwen-Image 2.1 (another transformer and text encoder)",
}
"""Class-name prefixes of folders recognised and refused, with what they are (longest prefix first when matching)."""


@dataclass(frozen=True)
class DitFamily:
    """What a DiT folder is: the family name, its base architecture and the facts the pipeline reads."""

    name: str
    base: str
    """The architecture (engines/architectures.py): ``flux``, ``sd3`` or ``qwen-image``."""
    guidance_embeds: bool
    """Flux dev: the guidance scale is a transformer input; no classifier-free guidance."""
    steps: int
    guidance: float
    max_sequence_length: int
    cfg: bool = False
    """Classifier-free guidance with a negative prompt (SD 3 / 3.5, Qwen-Image's true CFG); Flux never doubles
    the batch."""


def refused_reason(class_name: str) -> str | None:
    """What a recognised but unsupported pipeline class is, or None."""
    for prefix in sorted(REFUSED, key=len, reverse=True):
        if class_name.startswith(prefix) or class_name.startswith(f"Onnx{prefix}"):
            return REFUSED[prefix]
    return None


def _transformer_config(folder: Path) -> dict[str, Any]:
    config = read_json(folder / "transformer" / "config.json")
    if not config:
        raise ModelLoadError(f"{folder} has no transformer/config.json: not a DiT folder ({SERVED})")
    return config


def _checked(folder: Path, row: architectures.Architecture) -> dict[str, Any]:
    """The transformer config of a folder of ``row``: its class and no variant switch that is not served."""
    config = _transformer_config(folder)
    expected = row.transformer_class
    if expected and str(config.get("_class_name", expected)) != expected:
        raise ModelLoadError(f"{folder}: transformer {config.get('_class_name')} is not {expected}; {SERVED}")
    variant = [key for key in row.variant_keys if config.get(key)]
    if variant:
        raise ModelLoadError(f"{folder}: its transformer sets {', '.join(variant)} (a variant of the {row.name} "
                             f"transformer, e.g. Qwen-Image Edit or Layered): not supported; {SERVED}")
    return config


def is_dit_folder(folder: Path) -> bool:
    """Whether the folder's model_index.json names a DiT pipeline (served or refused), so the UNet detection
    should not try it."""
    class_name = architectures.class_name(folder)
    row = architectures.claimed(class_name)
    return (row is not None and row.denoiser == "transformer") or refused_reason(class_name) is not None


def detect_dit(folder: Path) -> DitFamily:
    """The DiT family of a diffusers or exported folder; ModelLoadError naming what was found when unsupported."""
    index = read_json(folder / "model_index.json")
    class_name = str(index.get("_class_name", ""))
    reason = refused_reason(class_name)
    if reason is not None:
        raise ModelLoadError(f"{folder} is {reason} ({class_name}): not supported; {SERVED}")
    row = architectures.claimed(class_name)
    if row is None or row.denoiser != "transformer":
        raise ModelLoadError(f"{folder}: pipeline class {class_name or '(none)'} is not a DiT family; {SERVED}")
    config = _checked(folder, row)
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")
    found = families.resolve(row.name, {"index": index, "denoiser": config, "scheduler": scheduler})
    guided = bool(config.get("guidance_embeds", False)) if row.guidance_embeds else False
    return DitFamily(found.name, row.name, guided, found.steps, found.guidance, found.t5_length, row.cfg)
