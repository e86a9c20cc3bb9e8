"""The embedded tiny models: architecturally faithful miniatures of each served family, built from a fixed seed,
no downloads.

sd1: CLIP text encoder (real 49,408-token vocabulary), cross-attention UNet, 4-level AutoencoderKL (VAE scale
factor 8 like real SD). sd2: the same scaled down from SD 2.x: OpenCLIP-style encoder (gelu, ``!`` padding, the
legacy eos id 2), linear-projection transformers, v-prediction, 768/512 native size ratio. sdxl: two text encoders
(the second with a pooled projection), ``text_time`` added conditioning, VAE scaling 0.13025 with force_upcast.
turbo: SD-Turbo (the SD 2.1 architecture distilled for 1-4 steps): trailing timestep spacing, epsilon. inpaint:
sd1 with a 9-channel inpainting UNet (latents + mask + masked-image latents, as stable-diffusion-inpainting). Every
family exports the VAE encoder too (edits). Their
weights are random: images are noise-like patterns, not pictures. They exist so the whole server, tests and
benchmarks run anywhere in seconds.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.build.clip_vocab import find_bpe_source, write_tokenizer
from engines.build.export import export_components

SEED = 0

TEXT_ENCODER = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=5,
                    vocab_size=49408, max_position_embeddings=77, hidden_act="quick_gelu",
                    bos_token_id=49406, eos_token_id=49407, pad_token_id=49407, projection_dim=32)
UNET = dict(block_out_channels=(32, 64), layers_per_block=2, sample_size=8, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=32)
VAE = dict(block_out_channels=(32, 64, 64, 64), in_channels=3, out_channels=3, latent_channels=4,
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
           sample_size=64, norm_num_groups=32)
SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 skip_prk_steps=True, steps_offset=1, set_alpha_to_one=False)

# SD 2.x: OpenCLIP ViT-H as transformers holds it (gelu; bos 0 / eos 2 / pad 1 are the legacy ids its config
# carries, which make the pooled output take the argmax token), linear projections, per-level head counts.
OPENCLIP = {**TEXT_ENCODER, "hidden_act": "gelu", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
UNET_SD2 = {**UNET, "attention_head_dim": (2, 4), "use_linear_projection": True, "upcast_attention": True}
SD2_SAMPLE = 12
"""SD 2.x's native 768 over SD 1.x's 512, on the tiny scale (8 latents = 64 px -> 12 = 96 px)."""
# SDXL: CLIP ViT-L (penultimate states) + OpenCLIP bigG with projection (penultimate + pooled), concatenated;
# text_time conditioning: 6 time ids x addition_time_embed_dim + the pooled projection width.
UNET_SDXL = {**UNET, "sample_size": 16, "attention_head_dim": (2, 4), "use_linear_projection": True,
             "transformer_layers_per_block": (1, 2), "cross_attention_dim": 64, "addition_embed_type": "text_time",
             "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 6 * 8 + 32}
VAE_SDXL = {**VAE, "scaling_factor": 0.13025, "force_upcast": True}
SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sd1": ("PNDMScheduler", {}),
    "sd2": ("DDIMScheduler", {"prediction_type": "v_prediction", "clip_sample": False}),
    "sdxl": ("EulerDiscreteScheduler", {"beta_schedule": "scaled_linear", "interpolation_type": "linear",
                                        "timestep_spacing": "leading"}),
    "turbo": ("EulerDiscreteScheduler", {"prediction_type": "epsilon", "timestep_spacing": "trailing"}),
}


@dataclass(frozen=True)
class TinyRecipe:
    """One UNet family's tiny build as data: its modules' configs, its scheduler and its tokenizers' padding."""

    text_encoder: dict[str, Any]
    unet: dict[str, Any]
    vae: dict[str, Any]
    scheduler: tuple[str, dict[str, Any]]
    """(diffusers class, overrides of SCHEDULER)."""
    text_encoder_2: dict[str, Any] | None = None
    """SDXL's OpenCLIP bigG, with projection; its tokenizer_2 pads with ``!``."""
    openclip_tokenizer: bool = False
    """The tokenizer pads with ``!`` (id 0) as OpenCLIP's does, not with the end token (SD 2.x)."""
    source_names_family: bool = True
    """The manifest's source names the family (the embedded sd1 model's does not)."""


RECIPES: dict[str, TinyRecipe] = {
    "sd1": TinyRecipe(TEXT_ENCODER, UNET, VAE, SCHEDULERS["sd1"], source_names_family=False),
    "sd2": TinyRecipe(OPENCLIP, {**UNET_SD2, "sample_size": SD2_SAMPLE}, VAE, SCHEDULERS["sd2"],
                      openclip_tokenizer=True),
    "sdxl": TinyRecipe(TEXT_ENCODER, UNET_SDXL, VAE_SDXL, SCHEDULERS["sdxl"], text_encoder_2=OPENCLIP),
    # SD-Turbo is SD 2.1 base: native 512 px, SD 1.x's tiny size.
    "turbo": TinyRecipe(OPENCLIP, {**UNET_SD2, "sample_size": 8}, VAE, SCHEDULERS["turbo"], openclip_tokenizer=True),
    "inpaint": TinyRecipe(TEXT_ENCODER, {**UNET, "in_channels": 9}, VAE, SCHEDULERS["sd1"]),
}
FAMILIES = tuple(RECIPES)


def tiny_recipe(family: str) -> TinyRecipe:
    """The recipe of ``family`` (one of FAMILIES); ValueError for any other name."""
    try:
        return RECIPES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}") from None


def make_components(seed: int = SEED) -> dict[str, Any]:
    """text_encoder, unet, vae and scheduler of the SD 1.x tiny model, built deterministically on the CPU."""
    return make_family_components("sd1", seed)


def make_family_components(family: str, seed: int = SEED) -> dict[str, Any]:
    """The tiny model of ``family`` (one of FAMILIES) from its recipe, each module seeded alike."""
    import diffusers
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    recipe = tiny_recipe(family)
    torch.manual_seed(seed)
    components: dict[str, Any] = {"text_encoder": CLIPTextModel(CLIPTextConfig(**recipe.text_encoder)).eval()}
    if recipe.text_encoder_2 is not None:
        torch.manual_seed(seed + 1)  # not the first encoder's weights again
        components["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**recipe.text_encoder_2)).eval()
    torch.manual_seed(seed)
    components["unet"] = UNet2DConditionModel(**recipe.unet).eval()
    torch.manual_seed(seed)
    components["vae"] = AutoencoderKL(**recipe.vae).eval()
    name, extra = recipe.scheduler
    # from_config drops the keys a class does not take (skip_prk_steps is PNDM's), as loading a real folder does.
    components["scheduler"] = getattr(diffusers, name).from_config({**SCHEDULER, **extra})
    return components


def _pad_with_bang(tokenizer_dir: Path) -> None:
    """OpenCLIP's tokenizer folders pad with ``!`` (id 0), not the end token: SD 2.x and SDXL's tokenizer_2."""
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = tokenizer_dir / name
        config = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({**config, "pad_token": "!"}, indent=2), encoding="utf-8")


def save_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path,
                   tokenizer_2_dir: Path | None = None) -> Path:
    """The same weights as a diffusers folder, for parity tests, benchmarks and `engines export`."""
    from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(tokenizer_dir)
    if "text_encoder_2" in components:
        pipe: Any = StableDiffusionXLPipeline(**components, tokenizer=tokenizer,
                                              tokenizer_2=CLIPTokenizer.from_pretrained(tokenizer_2_dir))
    else:
        kind = StableDiffusionInpaintPipeline if components["unet"].config.in_channels == 9 else StableDiffusionPipeline
        pipe = kind(**components, tokenizer=tokenizer, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out)
    return out


def build_tiny(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None, family: str = "sd1") -> Path:
    """Build and export the tiny model of ``family`` to ``out`` (ONNX layout + manifest)."""
    recipe = tiny_recipe(family)
    components = make_family_components(family)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        write_tokenizer(find_bpe_source(bpe), tokenizer_dir)
        tokenizer_2_dir = None
        if recipe.openclip_tokenizer:
            _pad_with_bang(tokenizer_dir)
        if recipe.text_encoder_2 is not None:
            tokenizer_2_dir = Path(tmp) / "tokenizer_2"
            write_tokenizer(find_bpe_source(bpe), tokenizer_2_dir)
            _pad_with_bang(tokenizer_2_dir)
        # DDIM reads clip_sample (default True in diffusers); SD configs set it False and so do we.
        scheduler = components["scheduler"]
        scheduler_config = {"_class_name": type(scheduler).__name__, **scheduler.config, "clip_sample": False}
        named = {"family": family} if recipe.source_names_family else {}
        source: dict[str, Any] = {"kind": "tiny", **named, "seed": SEED}
        export_components(components["text_encoder"], components["unet"], components["vae"],
                          scheduler_config, tokenizer_dir, out, source,
                          text_encoder_2=components.get("text_encoder_2"), tokenizer_2_dir=tokenizer_2_dir)
        if diffusers_out is not None:  # after the export: save_pretrained rewrites the configs it saves
            save_diffusers(components, tokenizer_dir, diffusers_out, tokenizer_2_dir)
    return out
