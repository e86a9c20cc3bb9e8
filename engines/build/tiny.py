"""The embedded tiny model: an architecturally faithful miniature SD 1.x built from a fixed seed, no downloads.

CLIP text encoder (real 49,408-token vocabulary), cross-attention UNet, 4-level AutoencoderKL (VAE scale
factor 8 like real SD). Its weights are random: images are noise-like patterns, not pictures. It exists so the
whole server, tests and benchmarks run anywhere in seconds.
"""

from __future__ import annotations

import tempfile
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


def make_components(seed: int = SEED) -> dict[str, Any]:
    """text_encoder, unet, vae and scheduler built deterministically on the CPU."""
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER)).eval()
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**UNET).eval()
    torch.manual_seed(seed)
    vae = AutoencoderKL(**VAE).eval()
    return {"text_encoder": text_encoder, "unet": unet, "vae": vae, "scheduler": PNDMScheduler(**SCHEDULER)}


def save_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path) -> Path:
    """The same weights as a diffusers folder, for parity tests, benchmarks and `engines export`."""
    from diffusers import StableDiffusionPipeline
    from transformers import CLIPTokenizer

    pipe = StableDiffusionPipeline(**components, tokenizer=CLIPTokenizer.from_pretrained(tokenizer_dir),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(out)
    return out


def build_tiny(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None) -> Path:
    """Build and export the tiny model to ``out`` (ONNX layout + manifest)."""
    components = make_components()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        write_tokenizer(find_bpe_source(bpe), tokenizer_dir)
        # DDIM reads clip_sample (default True in diffusers); SD configs set it False and so do we.
        scheduler_config = {"_class_name": "PNDMScheduler", **components["scheduler"].config,
                            "clip_sample": False}
        export_components(components["text_encoder"], components["unet"], components["vae"],
                          scheduler_config, tokenizer_dir, out, {"kind": "tiny", "seed": SEED})
        if diffusers_out is not None:  # after the export: save_pretrained rewrites the configs it saves
            save_diffusers(components, tokenizer_dir, diffusers_out)
    return out
