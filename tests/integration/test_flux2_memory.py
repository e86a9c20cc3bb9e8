"""FLUX.2 [klein]'s memory plan (engines/health/memory_plan.py) from real parameter counts: the registry row's
transformer formula (engines/health/param_counts.py ``flux2_transformer``) equals the parameter count of the real
diffusers ``Flux2Transformer2DModel`` at two configurations (before: Flux.1's formula, which over-counts FLUX.2's shared
modulation and SwiGLU MLPs), the VAE halves' formulas equal the real ``AutoencoderKLFlux2``'s (its decoder's own
``decoder_block_out_channels`` included), and the plan of the tiny exported folder charges every component."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engines.health import memory_plan as mp
from engines.health.param_counts import flux2_transformer, flux_transformer, vae_decoder, vae_encoder

TRANSFORMERS: list[dict[str, Any]] = [
    {"patch_size": 1, "in_channels": 128, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
     "num_attention_heads": 2, "joint_attention_dim": 48, "timestep_guidance_channels": 32,
     "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": False},
    {"patch_size": 2, "in_channels": 16, "out_channels": 8, "num_layers": 2, "num_single_layers": 3,
     "attention_head_dim": 8, "num_attention_heads": 3, "joint_attention_dim": 40, "mlp_ratio": 2.5,
     "timestep_guidance_channels": 64, "axes_dims_rope": (2, 2, 2, 2), "guidance_embeds": True},
]
VAES: list[dict[str, Any]] = [
    {"block_out_channels": (16, 32, 32, 32), "layers_per_block": 1, "latent_channels": 32, "norm_num_groups": 8},
    {"block_out_channels": (16, 32, 48, 48), "decoder_block_out_channels": (8, 16, 32, 32), "layers_per_block": 2,
     "latent_channels": 8, "norm_num_groups": 8, "mid_block_add_attention": False},
]


def _count(*modules: Any) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


@pytest.mark.parametrize("config", TRANSFORMERS)
def test_the_transformer_formula_is_the_real_modules_count(config: dict[str, Any]) -> None:
    from diffusers import Flux2Transformer2DModel

    real = _count(Flux2Transformer2DModel(**config))
    assert flux2_transformer(config).params == real
    assert flux_transformer(config).params != real  # the formula the row borrowed before


@pytest.mark.parametrize("config", VAES)
def test_the_vae_formulas_are_the_real_modules_counts(config: dict[str, Any]) -> None:
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(**config)
    assert vae_decoder(dict(vae.config)).params == _count(vae.post_quant_conv, vae.decoder)
    assert vae_encoder(dict(vae.config)).params == _count(vae.encoder, vae.quant_conv)
    assert _count(vae.bn) == 0  # the batch norm's statistics are buffers: nothing to count


def test_the_plan_of_the_tiny_export_charges_every_component(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    folder = dit_build("flux2-klein")[0]
    plan = mp.plan(folder, mp.Served(64, 64, 2, tensorrt=False))
    parts = {c["name"]: c for c in plan["components"]}
    assert {"text_encoder", "transformer", "vae_decoder"} <= set(parts)
    assert parts["transformer"]["kind"] == "flux2_transformer" and parts["text_encoder"]["kind"] == "qwen3_text"
    assert all(parts[n]["weights"] > 0 and parts[n]["activations"] > 0 for n in parts)
