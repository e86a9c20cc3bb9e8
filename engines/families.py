"""The family registry: what each model family sdserve serves is, in one place, read by everything else.

A family is a name over an architecture (its ``base``: the UNet of SD 1.x, SD 2.x or SDXL, or the transformer of
Flux.1, SD 3 or Qwen-Image). Detection reads a folder's JSON files, finds the base (engines/pipelines/unet_family.py for
the UNets, engines/pipelines/flow_family.py for the transformers), then asks the registry which family of that base
the folder is: the first registered family whose ``claim`` accepts the folder's configs, else the family named after
the base.
Everything a caller needs to know about a family beyond its base (request defaults, the SDXL-only request fields,
the OpenAI sizes, the A1111 config label, T5's length) is a field here; the server reads these fields through the
served model's name and never names a family itself.

Adding a family that serves through an existing pipeline is one ``register`` call (plus, optionally, its canary
table in configs/canaries.toml and SLO windows in configs/slo.toml): docs/architecture.md, "How to add a family".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Configs = Mapping[str, Mapping[str, Any]]
"""A folder's JSON configs by role: ``index`` (model_index.json), ``scheduler``, ``denoiser`` (the UNet's or the
transformer's config.json)."""


@dataclass(frozen=True)
class FamilyFacts:
    name: str
    bases: tuple[str, ...]
    """The architectures a folder of this family has: sd1, sd2, sdxl (UNet), flux, sd3, qwen-image (transformer)."""
    denoiser: Literal["unet", "transformer"]
    steps: int
    """Request default: denoising steps (diffusers' and the model cards' recommendations)."""
    guidance: float
    """Request default: guidance scale (0 or 1: no classifier-free guidance)."""
    description: str
    scheduler: str = "euler"
    """Request default: the sampler."""
    claim: Callable[[Configs], bool] | None = None
    """Whether a folder of one of ``bases`` is this family; None for the family named after its base, which takes
    every folder of that base no other family claims."""
    micro_conditioning: bool = False
    """SDXL's original_size and crop request fields apply."""
    trained_size: int = 512
    """The side its released weights were trained at (SD 1.x 512, SD 2.x 768, SDXL, Flux.1 and SD 3.x 1024): at
    1024 the family serves OpenAI's image sizes without resizing ([serving] openai_sizes); a smaller one serves them
    only through Hires fix ([serving] openai_sizes_hires)."""
    t5_length: int = 0
    """T5's ``max_sequence_length`` (transformer families; Qwen-Image: its text encoder's, the states kept)."""
    a1111_config: Callable[[int, str], str] = lambda encoders, prediction: ""
    """The A1111 ``config`` label of /sdapi/v1/sd-models, from (text encoders, prediction type); "" for none."""
    own_defaults: bool = False
    """Its request defaults are used instead of the profile's [defaults] (few-step and flow-matching families, for
    which the profile's SD defaults would be wrong); a profile's [family_defaults.<name>] overrides both."""
    lora_text_encoders: str = ""
    """Why a LoRA on this family's text encoders is refused (a file carrying such keys is listed refused with this
    reason); ``""``: they are adapted like the denoiser."""
    distilled_guidance: bool = False
    """The guidance scale is an input of the network, no classifier-free guidance (Flux.1 dev): Forge's
    ``distilled_cfg_scale`` sets it on the A1111 routes (docs/api.md)."""

    @property
    def openai_sizes(self) -> bool:
        """Trained at 1024x1024: serves OpenAI's image sizes without resizing ([serving] openai_sizes)."""
        return self.trained_size >= 1024


REGISTRY: dict[str, FamilyFacts] = {}
"""Family name -> facts, in registration order (claims are tried in this order)."""


def register(facts: FamilyFacts) -> FamilyFacts:
    """Add (or replace) a family. A claiming family must come after the base family it refines."""
    REGISTRY[facts.name] = facts
    return facts


def facts(name: str) -> FamilyFacts:
    """The facts of a registered family; KeyError naming the registered ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; registered: {', '.join(REGISTRY)}") from None


def names(denoiser: str | None = None) -> tuple[str, ...]:
    return tuple(n for n, f in REGISTRY.items() if denoiser is None or f.denoiser == denoiser)


def resolve(base: str, configs: Configs) -> FamilyFacts:
    """The family of a folder whose architecture is ``base``: the first family claiming it, else the base's own."""
    for family in REGISTRY.values():
        if base in family.bases and family.claim is not None and family.claim(configs):
            return family
    return facts(base)


def _sd_config(encoders: int, prediction: str) -> str:
    return "v2-inference-v.yaml" if prediction == "v_prediction" else "v2-inference.yaml"


def _trailing(configs: Configs) -> bool:
    return configs.get("scheduler", {}).get("timestep_spacing") == "trailing"


register(FamilyFacts("sd1", ("sd1",), "unet", 20, 7.5, "Stable Diffusion 1.x",
                     a1111_config=lambda encoders, prediction: "v1-inference.yaml"))
register(FamilyFacts("sd2", ("sd2",), "unet", 20, 7.5, "Stable Diffusion 2.x", trained_size=768,
                     a1111_config=_sd_config))
register(FamilyFacts("sdxl", ("sdxl",), "unet", 30, 5.0, "Stable Diffusion XL", micro_conditioning=True,
                     trained_size=1024, a1111_config=lambda encoders, prediction: "sd_xl_base.yaml"))
register(FamilyFacts("turbo", ("sd1", "sd2", "sdxl"), "unet", 1, 0.0, "SD-Turbo / SDXL-Turbo (trailing spacing)",
                     claim=_trailing, own_defaults=True,
                     a1111_config=lambda encoders, prediction: "sd_xl_turbo.yaml" if encoders == 2
                     else _sd_config(encoders, prediction)))
register(FamilyFacts("flux", ("flux",), "transformer", 28, 3.5, "FLUX.1 dev (guidance embedded)", t5_length=512,
                     own_defaults=True, trained_size=1024, distilled_guidance=True))
register(FamilyFacts("flux-schnell", ("flux",), "transformer", 4, 0.0, "FLUX.1 schnell (timestep-distilled)",
                     claim=lambda configs: not configs.get("denoiser", {}).get("guidance_embeds", False),
                     t5_length=256, own_defaults=True, trained_size=1024))
register(FamilyFacts("flux-kontext", ("flux-kontext",), "transformer", 28, 3.5,
                     "FLUX.1 Kontext [dev] (instruction edits, guidance embedded)", t5_length=512, own_defaults=True,
                     trained_size=1024, distilled_guidance=True))
register(FamilyFacts("sd3", ("sd3",), "transformer", 28, 7.0, "Stable Diffusion 3", t5_length=256,
                     own_defaults=True, trained_size=1024))
register(FamilyFacts("sd35", ("sd3",), "transformer", 28, 4.5, "Stable Diffusion 3.5 (QK norm / dual attention)",
                     claim=lambda configs: bool(configs.get("denoiser", {}).get("qk_norm"))
                     or bool(configs.get("denoiser", {}).get("dual_attention_layers")),
                     t5_length=256, own_defaults=True, trained_size=1024))
register(FamilyFacts("qwen-image", ("qwen-image",), "transformer", 50, 4.0,
                     "Qwen-Image (Qwen2.5-VL text encoder, true CFG with norm rescaling)", t5_length=512,
                     own_defaults=True, trained_size=1328,
                     lora_text_encoders="Qwen-Image LoRAs adapt the transformer only (diffusers' "
                     "QwenImageLoraLoaderMixin loads none into the Qwen2.5-VL text encoder): remove the text-encoder "
                     "keys from the file"))
"""Qwen-Image: diffusers' defaults (50 steps, ``true_cfg_scale`` 4.0, ``max_sequence_length`` 512: the text states
the transformer attends to, ``t5_length`` here); its model card's square size is 1328."""
register(FamilyFacts("qwen-image-edit", ("qwen-image-edit",), "transformer", 40, 4.0,
                     "Qwen-Image-Edit-Plus 2509/2511 (instruction edits with 1 to 3 input images, true CFG)",
                     t5_length=1024, own_defaults=True, trained_size=1024,
                     lora_text_encoders="Qwen-Image-Edit LoRAs adapt the transformer only (diffusers' "
                     "QwenImageLoraLoaderMixin loads none into the Qwen2.5-VL text encoder): remove the text-encoder "
                     "keys from the file"))
"""Qwen-Image-Edit-Plus: diffusers' defaults (40 steps, ``true_cfg_scale`` 4.0, the 1024-token text budget the
template with its image tokens takes); output 1024² at the last input's aspect."""
ZIMAGE_TEXT_LORA = ("Z-Image LoRAs adapt the transformer only (diffusers' ZImageLoraLoaderMixin loads none into the "
                    "Qwen3 text encoder): remove the text-encoder keys from the file")
FLUX2_TEXT_LORA = ("FLUX.2 [klein] LoRAs adapt the transformer only (diffusers' Flux2LoraLoaderMixin loads none into "
                   "the Qwen3 text encoder): remove the text-encoder keys from the file")
register(FamilyFacts("z-image", ("z-image",), "transformer", 50, 5.0,
                     "Z-Image (Qwen3 text encoder, CFG with negative prompts)", t5_length=512, own_defaults=True,
                     trained_size=1024, lora_text_encoders=ZIMAGE_TEXT_LORA))
register(FamilyFacts("z-image-turbo", ("z-image",), "transformer", 8, 0.0,
                     "Z-Image-Turbo (distilled: 8 steps, no CFG)",
                     claim=lambda configs: configs.get("scheduler", {}).get("shift") == 3.0, t5_length=512,
                     own_defaults=True, trained_size=1024, lora_text_encoders=ZIMAGE_TEXT_LORA))
"""Z-Image: diffusers' ``ZImagePipeline`` defaults (50 steps, guidance 5.0, ``max_sequence_length`` 512); Turbo's
model card: 8 transformer evaluations at guidance 0. A folder whose scheduler shifts by 3.0 (Turbo's released
config) is ``z-image-turbo`` (engines/pipelines/flow_family.py ``detect_dit`` hands the claims the scheduler config
beside the index and the transformer's)."""
register(FamilyFacts("flux2-klein", ("flux2-klein",), "transformer", 4, 1.0,
                     "FLUX.2 [klein] (Qwen3 text encoder, step-distilled: no CFG)", t5_length=512,
                     own_defaults=True, trained_size=1024, lora_text_encoders=FLUX2_TEXT_LORA))
register(FamilyFacts("flux2-klein-base", ("flux2-klein",), "transformer", 50, 4.0,
                     "FLUX.2 [klein] base (Qwen3 text encoder, CFG)",
                     claim=lambda configs: not configs.get("index", {}).get("is_distilled", False), t5_length=512,
                     own_defaults=True, trained_size=1024, lora_text_encoders=FLUX2_TEXT_LORA))
"""FLUX.2 [klein]: diffusers' ``Flux2KleinPipeline`` defaults (``max_sequence_length`` 512: the text states the
transformer attends to, ``t5_length`` here); the distilled checkpoints' model cards use 4 steps, the base ones 50
steps at guidance 4.0. A folder whose model_index.json says ``is_distilled`` is ``flux2-klein``."""
register(FamilyFacts("flux2-dev", ("flux2-dev",), "transformer", 50, 4.0,
                     "FLUX.2 [dev] (Mistral Small 3.1 text encoder, guidance embedded)", t5_length=512,
                     own_defaults=True, trained_size=1024, distilled_guidance=True,
                     lora_text_encoders="FLUX.2 [dev] LoRAs adapt the transformer only (diffusers' "
                     "Flux2LoraLoaderMixin loads none into the Mistral text encoder): remove the text-encoder keys "
                     "from the file"))
"""FLUX.2 [dev]: diffusers' ``Flux2Pipeline`` defaults (50 steps, ``guidance_scale`` 4.0 embedded in the transformer,
``max_sequence_length`` 512)."""
