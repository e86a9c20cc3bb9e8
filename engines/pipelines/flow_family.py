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

Refused by name: Flux.1 Kontext (image-conditioned editing: reference-image tokens in the sequence), Flux.2
(another transformer, text encoder and VAE), the Flux tools (Fill, Canny/Depth control, Redux) and ControlNets;
the Qwen-Image variants other than text-to-image and img2img (Edit / Edit Plus, Layered, inpainting, ControlNet,
Qwen-Image 2.1): a folder of one of them raises ModelLoadError saying what it is and what is served.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines import families
from engines.pipelines.unet_family import read_json
from engines.errors import ModelLoadError

DIT_FAMILIES = families.names("transformer")
SERVED = ("sdserve serves Flux.1 dev/schnell (FluxPipeline), SD 3 / 3.5 (StableDiffusion3Pipeline) and Qwen-Image "
          "(QwenImagePipeline) DiT folders")
FLUX_CLASSES = frozenset({"FluxPipeline", "OnnxFluxPipeline", "ORTFluxPipeline"})
SD3_CLASSES = frozenset({"StableDiffusion3Pipeline", "OnnxStableDiffusion3Pipeline", "ORTStableDiffusion3Pipeline"})
QWEN_CLASSES = frozenset({"QwenImagePipeline", "QwenImageImg2ImgPipeline", "OnnxQwenImagePipeline"})
"""A Qwen-Image img2img folder holds the text-to-image weights: served as both."""
REFUSED: dict[str, str] = {
    "FluxKontext": "Flux.1 Kontext (image-conditioned editing)",
    "Flux2": "Flux.2 (a different transformer, text encoder and VAE)",
    "FluxFill": "Flux.1 Fill (inpainting/outpainting tool)",
    "FluxControl": "Flux.1 Canny/Depth control",
    "FluxPriorRedux": "Flux.1 Redux (image variation)",
    "StableDiffusion3ControlNet": "an SD 3 ControlNet pipeline",
    "QwenImageEdit": "Qwen-Image-Edit (image-conditioned editing: reference-image tokens in the sequence)",
    "QwenImageLayered": "Qwen-Image-Layered (layer decomposition)",
    "QwenImageInpaint": "Qwen-Image inpainting (masks are not served for the DiT families)",
    "QwenImageControlNet": "a Qwen-Image ControlNet pipeline",
    "QwenImage21": "Qwen-Image 2.1 (another transformer and text encoder)",
}
"""Class-name prefixes of folders recognised and refused, with what they are (longest prefix first when matching)."""


@dataclass(frozen=True)
class DitFamily:
    """What a DiT folder is: the family name, its base architecture and the facts the pipeline branches on."""

    name: str
    base: str
    """``flux``, ``sd3`` or ``qwen-image``."""
    guidance_embeds: bool
    """Flux dev: the guidance scale is a transformer input; no classifier-free guidance."""
    steps: int
    guidance: float
    max_sequence_length: int

    @property
    def cfg(self) -> bool:
        """Classifier-free guidance with a negative prompt (SD 3 / 3.5, Qwen-Image's true CFG); Flux never doubles
        the batch."""
        return self.base in ("sd3", "qwen-image")


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


QWEN_VARIANT_KEYS = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
"""QwenImageTransformer2DModel config switches of the Edit (2511) and Layered transformers."""


def _qwen_transformer(folder: Path) -> dict[str, Any]:
    config = _transformer_config(folder)
    if str(config.get("_class_name", "QwenImageTransformer2DModel")) != "QwenImageTransformer2DModel":
        raise ModelLoadError(f"{folder}: transformer {config.get('_class_name')} is not Qwen-Image's; {SERVED}")
    variant = [key for key in QWEN_VARIANT_KEYS if config.get(key)]
    if variant:
        raise ModelLoadError(f"{folder}: its transformer sets {', '.join(variant)} (a Qwen-Image Edit or Layered "
                             f"transformer): not supported; {SERVED}")
    return config


def _make(base: str, configs: families.Configs) -> DitFamily:
    found = families.resolve(base, configs)
    guided = bool(configs["denoiser"].get("guidance_embeds", False)) if base == "flux" else False
    return DitFamily(found.name, base, guided, found.steps, found.guidance, found.t5_length)


def is_dit_folder(folder: Path) -> bool:
    """Whether the folder's model_index.json names a DiT pipeline (served or refused), so the UNet detection
    should not try it."""
    class_name = str(read_json(folder / "model_index.json").get("_class_name", ""))
    return class_name in FLUX_CLASSES | SD3_CLASSES | QWEN_CLASSES or refused_reason(class_name) is not None


def detect_dit(folder: Path) -> DitFamily:
    """The DiT family of a diffusers or exported folder; ModelLoadError naming what was found when unsupported."""
    index = read_json(folder / "model_index.json")
    class_name = str(index.get("_class_name", ""))
    reason = refused_reason(class_name)
    if reason is not None:
        raise ModelLoadError(f"{folder} is {reason} ({class_name}): not supported; {SERVED}")
    if class_name in FLUX_CLASSES:
        config = _transformer_config(folder)
        if str(config.get("_class_name", "FluxTransformer2DModel")) != "FluxTransformer2DModel":
            raise ModelLoadError(f"{folder}: transformer {config.get('_class_name')} is not Flux.1's; {SERVED}")
        return _make("flux", {"index": index, "denoiser": config})
    if class_name in SD3_CLASSES:
        return _make("sd3", {"index": index, "denoiser": _transformer_config(folder)})
    if class_name in QWEN_CLASSES:
        return _make("qwen-image", {"index": index, "denoiser": _qwen_transformer(folder)})
    raise ModelLoadError(f"{folder}: pipeline class {class_name or '(none)'} is not a DiT family; {SERVED}")
