"""The architecture registry: which pipeline class serves a model folder, and what the memory plan, the TensorRT
plan and the export need to know of its architecture, in one row each.

An *architecture* is a denoiser and the pipeline around it (the UNet of SD 1.x/2.x/XL, the transformers of Flux.1,
SD 3 and Qwen-Image); a *family* (engines/families.py) is a name over an architecture with its request defaults.
A folder is told by its ``model_index.json`` ``_class_name``: the first row whose ``classes`` holds it, else the
UNet row (``classes`` empty: the folders no other row claims). The family is then the registry's, as before.

The row names code by ``"module:attribute"`` strings, imported when a folder of it is loaded, so this module sits at
the bottom of ``engines/`` (it imports nothing of sdserve but the errors) and nothing above it branches on a family
or architecture name: engines/engine.py asks ``pipeline_class()``, engines/health/memory_plan.py reads
``memory_parts``, engines/build/trtplan_dit.py the ``t5`` and ``trt_*`` fields, engines/build/dit_export.py calls
``export``.

Adding an architecture is one pipeline file (a subclass of engines/pipelines/flow.py's ``FlowPipeline`` overriding
the hooks it needs), its build/export module and one ``register`` call here (plus its family rows):
docs/architecture.md, "How to add an architecture".
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from engines.errors import ModelLoadError

ENGINE_PRECISION: dict[str, str] = {"text_encoder": "fp16", "text_encoder_2": "fp16", "text_encoder_3": "bf16",
                                    "transformer": "bf16", "vae_decoder": "bf16", "vae_encoder": "bf16"}
"""The transformer families' engine precision per component (a row's T5 and ``precision`` come first): the CLIP
encoders in fp16, T5, the transformer and the VAE in bf16 (engines/build/trtplan_dit.py's docstring says why)."""


@dataclass(frozen=True)
class Architecture:
    name: str
    """The base its families name (engines/families.py ``bases``): ``unet`` serves sd1, sd2 and sdxl."""
    denoiser: Literal["unet", "transformer"]
    pipeline: str
    """``"module:Class"`` of the pipeline serving it (constructor ``(folder, runtime, label, sources)``)."""
    classes: frozenset[str] = frozenset()
    """model_index.json ``_class_name`` values of its folders (diffusers' and exported); empty: the fallback row."""
    transformer_class: str = ""
    """The ``_class_name`` its transformer config must carry ("" when not checked)."""
    packed: bool = False
    """Latents go into the transformer 2x2-packed into tokens with position ids (Flux.1, Qwen-Image)."""
    cfg: bool = False
    """Classifier-free guidance with negative prompts (the denoiser's rows doubled), else none (Flux)."""
    guidance_embeds: bool = False
    """Its transformer config's ``guidance_embeds`` says whether the guidance scale is a network input."""
    variant_keys: tuple[str, ...] = ()
    """Transformer config switches of variants that are not served (refused by name at load)."""
    components: tuple[str, ...] = ()
    """The ONNX components an exported folder must hold (besides an optional vae_encoder)."""
    t5: str = ""
    """The component of its T5 encoder ("" without one)."""
    memory_parts: Mapping[str, str] = field(default_factory=dict)
    """Component -> parameter-count formula (engines/health/param_counts.py) of the memory plan; VAE halves added."""
    vae_formulas: str = ""
    """Prefix of its VAE halves' formulas ("qwen_": the causal 3D VAE)."""
    precision: Mapping[str, str] = field(default_factory=dict)
    """TensorRT engine precision per component where it differs from ``ENGINE_PRECISION`` (its T5: bf16)."""
    text_tokens: str = "t5"
    """What the transformer's text sequence is: ``t5`` (T5's states), ``clip+t5`` (SD 3: CLIP's 77, then T5's) or
    ``fixed`` (the family's max_sequence_length, a key mask past each prompt: Qwen-Image)."""
    text_ids: str = ""
    """How a ``fixed`` family's text encoder is fed ids (engines/build/trtplan_dit.py ``text_dims`` plans its
    lengths from it): ``padded`` (every row padded to max_sequence_length, an attention mask beside: one length),
    ``longest`` (each batch's rows padded to its longest templated prompt, cut at max_sequence_length: variable) or
    ``longest+prefix`` (the same, plus a system prefix the encoder reads and the pipeline drops: Qwen-Image); ""
    where the text encoders' lengths are their tokenizers' (T5, CLIP)."""
    export: str = ""
    """``"module:function"`` exporting a diffusers folder of it, ``(src, out, dtype, ...)``."""

    def engine_precision(self, component: str) -> str:
        """The TensorRT engine precision of a component (engines/build/trtplan_dit.py builds it, the memory plan
        counts its bytes): the row's own, else bf16 for its T5, else ``ENGINE_PRECISION``'s."""
        if component in self.precision:
            return self.precision[component]
        return "bf16" if component == self.t5 else ENGINE_PRECISION.get(component, "bf16")

    def load(self, what: str) -> Any:
        """The object a ``"module:attribute"`` field names."""
        module, _, attr = what.partition(":")
        return getattr(importlib.import_module(module), attr)

    def pipeline_class(self) -> Callable[..., Any]:
        return self.load(self.pipeline)  # type: ignore[no-any-return]


REGISTRY: dict[str, Architecture] = {}
"""Architecture name -> row, in registration order (rows claiming class names are tried in this order)."""


def register(row: Architecture) -> Architecture:
    """Add (or replace) an architecture."""
    REGISTRY[row.name] = row
    return row


def get(name: str) -> Architecture:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown architecture {name!r}; registered: {', '.join(REGISTRY)}") from None


def class_name(folder: Path) -> str:
    path = folder / "model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is unreadable: {exc}") from exc
    return str(index.get("_class_name", "")) if isinstance(index, dict) else ""


def claimed(name: str) -> Architecture | None:
    """The row whose folders carry this model_index class name, or None."""
    for row in REGISTRY.values():
        if name in row.classes:
            return row
    return None


def of(folder: Path) -> Architecture:
    """The architecture of a folder: the row claiming its class name, else the fallback (UNet) row."""
    return claimed(class_name(folder)) or next(row for row in REGISTRY.values() if not row.classes)


register(Architecture(
    "unet", "unet", "engines.pipelines.unet:StableDiffusionOnnx", memory_parts={"text_encoder": "clip"},
    export="engines.build.export:export_folder"))
register(Architecture(
    "flux", "transformer", "engines.pipelines.flux:FluxPipeline",
    frozenset({"FluxPipeline", "OnnxFluxPipeline", "ORTFluxPipeline"}), "FluxTransformer2DModel",
    packed=True, guidance_embeds=True, components=("text_encoder", "text_encoder_2", "transformer", "vae_decoder"),
    t5="text_encoder_2",
    memory_parts={"text_encoder": "clip", "text_encoder_2": "t5", "transformer": "flux_transformer"},
    export="engines.build.dit_export:export_dit_folder"))
register(Architecture(
    "flux-kontext", "transformer", "engines.pipelines.kontext:KontextPipeline",
    frozenset({"FluxKontextPipeline", "OnnxFluxKontextPipeline"}), "FluxTransformer2DModel",
    packed=True, guidance_embeds=True, components=("text_encoder", "text_encoder_2", "transformer", "vae_decoder"),
    t5="text_encoder_2",
    memory_parts={"text_encoder": "clip", "text_encoder_2": "t5", "transformer": "flux_transformer"},
    export="engines.build.kontext:export_kontext_folder"))
"""FLUX.1 Kontext [dev] (instruction edits: the reference image's tokens after the noisy ones): Flux.1's networks,
engines/pipelines/kontext.py."""
register(Architecture(
    "sd3", "transformer", "engines.pipelines.sd3:SD3Pipeline",
    frozenset({"StableDiffusion3Pipeline", "OnnxStableDiffusion3Pipeline", "ORTStableDiffusion3Pipeline"}),
    cfg=True, components=("text_encoder", "text_encoder_3", "transformer", "vae_decoder", "text_encoder_2"),
    t5="text_encoder_3", memory_parts={"text_encoder": "clip_projection", "text_encoder_2": "clip_projection",
                                       "text_encoder_3": "t5", "transformer": "sd3_transformer"},
    text_tokens="clip+t5", export="engines.build.dit_export:export_dit_folder"))
register(Architecture(
    "qwen-image", "transformer", "engines.pipelines.qwen:QwenPipeline",
    frozenset({"QwenImagePipeline", "QwenImageImg2ImgPipeline", "OnnxQwenImagePipeline"}),
    "QwenImageTransformer2DModel", packed=True, cfg=True,
    variant_keys=("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"),
    components=("text_encoder", "transformer", "vae_decoder"),
    memory_parts={"text_encoder": "qwen_text", "transformer": "qwen_image"}, vae_formulas="qwen_",
    precision={"text_encoder": "bf16"}, text_tokens="fixed", text_ids="longest+prefix",
    export="engines.build.qwen_export:export_qwen_folder"))
"""Qwen-Image: an img2img folder (QwenImageImg2ImgPipeline) holds the text-to-image weights: served as both."""
register(Architecture(
    "qwen-image-edit", "transformer", "engines.pipelines.qwen_edit:QwenEditPipeline",
    frozenset({"QwenImageEditPlusPipeline", "OnnxQwenImageEditPlusPipeline"}), "QwenImageTransformer2DModel",
    packed=True, cfg=True, variant_keys=("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope"),
    components=("text_encoder", "vision", "transformer", "vae_decoder"),
    memory_parts={"text_encoder": "qwen_text", "transformer": "qwen_image"}, vae_formulas="qwen_",
    precision={"text_encoder": "bf16"}, text_tokens="fixed", text_ids="longest+prefix"))
"""Qwen-Image-Edit-Plus 2509 (instruction edits: the Qwen2.5-VL vision tower on the input images, their latents
after the noisy tokens): engines/pipelines/qwen_edit.py. 2511 (``zero_cond_t``: the reference tokens modulated at
timestep 0) is the same row, its exported transformer taking ``modulate_index``."""
register(Architecture(
    "z-image", "transformer", "engines.pipelines.zimage:ZImagePipeline",
    frozenset({"ZImagePipeline", "ZImageImg2ImgPipeline", "OnnxZImagePipeline"}), "ZImageTransformer2DModel",
    cfg=True, components=("text_encoder", "transformer", "vae_decoder"), precision={"text_encoder": "bf16"},
    memory_parts={"text_encoder": "qwen3_text", "transformer": "zimage_transformer"},
    text_tokens="fixed", text_ids="longest", export="engines.build.zimage:export_zimage_folder"))
"""Z-Image (Turbo and base; Qwen3 text encoder, single-stream transformer): engines/pipelines/zimage.py. Latents run
unpacked ([B, 16, h, w]: the transformer patchifies them itself); the caption is a fixed length with a token mask."""
register(Architecture(
    "flux2-klein", "transformer", "engines.pipelines.flux2:Flux2Pipeline",
    frozenset({"Flux2KleinPipeline", "OnnxFlux2KleinPipeline"}), "Flux2Transformer2DModel", cfg=True,
    variant_keys=("guidance_embeds",), components=("text_encoder", "transformer", "vae_decoder"),
    memory_parts={"text_encoder": "qwen3_text", "transformer": "flux2_transformer"},
    precision={"text_encoder": "bf16"}, text_tokens="fixed", text_ids="padded",
    export="engines.build.flux2_refs:export_flux2_refs_folder"))
"""FLUX.2 [klein] (Qwen3 text encoder; the step-distilled and the base checkpoints, ``is_distilled`` telling them
apart): engines/pipelines/flux2.py. Latents run unpacked ([B, 128, h, w]: the transformer flattens them itself).
Memory plan: the Qwen3 encoder's and FLUX.2 transformer's own formulas; the VAE (AutoencoderKLFlux2) is
AutoencoderKL's halves (its batch norm holds buffers only)."""
register(Architecture(
    "flux2-dev", "transformer", "engines.pipelines.flux2_dev:Flux2DevPipeline",
    frozenset({"Flux2Pipeline", "OnnxFlux2Pipeline"}), "Flux2Transformer2DModel", guidance_embeds=True,
    components=("text_encoder", "transformer", "vae_decoder"),
    memory_parts={"text_encoder": "mistral3_text", "transformer": "flux2_transformer"},
    precision={"text_encoder": "bf16"}, text_tokens="fixed", text_ids="padded",
    export="engines.build.mistral3:export_flux2_dev_folder"))
"""FLUX.2 [dev] (Mistral Small 3.1 text encoder, the guidance embedded): engines/pipelines/flux2_dev.py on klein's
loop. Memory plan: the Mistral language model as far as the pipeline reads it (layers 1-30) and FLUX.2's
transformer formula."""
