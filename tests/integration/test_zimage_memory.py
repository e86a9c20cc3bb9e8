"""Z-Image's memory plan (engines/health/memory_plan.py) from real parameter counts: the registry row's formulas
(engines/health/param_counts.py ``zimage_transformer``, ``qwen3_text``) equal the parameter counts of the real
diffusers ``ZImageTransformer2DModel`` and transformers ``Qwen3Model`` at two configurations each, and the plan of
the tiny exported folder charges every component (before: no denoiser part, so a request's memory estimate raised
StopIteration and the boot failed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engines.health import memory_plan as mp
from engines.health.param_counts import qwen3_text, zimage_transformer

TRANSFORMERS: list[dict[str, Any]] = [
    {"dim": 32, "n_heads": 2, "n_layers": 2, "n_refiner_layers": 1, "cap_feat_dim": 32, "axes_dims": [8, 4, 4]},
    {"dim": 96, "n_heads": 3, "n_layers": 3, "n_refiner_layers": 2, "cap_feat_dim": 40, "axes_dims": [16, 8, 8]},
]
TEXT: list[dict[str, Any]] = [
    {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
     "intermediate_size": 37, "vocab_size": 8256},
    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 16,
     "intermediate_size": 100, "vocab_size": 1000},
]


@pytest.mark.parametrize("config", TRANSFORMERS)
def test_the_transformer_formula_is_the_real_modules_count(config: dict[str, Any]) -> None:
    from diffusers import ZImageTransformer2DModel

    real = sum(p.numel() for p in ZImageTransformer2DModel(**config).parameters())
    assert zimage_transformer(config).params == real


@pytest.mark.parametrize("config", TEXT)
def test_the_qwen3_formula_is_the_real_modules_count(config: dict[str, Any]) -> None:
    from transformers import Qwen3Config, Qwen3Model

    real = sum(p.numel() for p in Qwen3Model(Qwen3Config(**config)).parameters())
    assert qwen3_text(config).params == real


def test_the_plan_of_the_tiny_export_charges_every_component(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    folder = dit_build("z-image")[0]
    plan = mp.plan(folder, mp.Served(64, 64, 2, tensorrt=False))
    parts = {c["name"]: c for c in plan["components"]}
    assert {"text_encoder", "transformer", "vae_decoder"} <= set(parts)
    assert parts["transformer"]["kind"] == "zimage_transformer" and parts["text_encoder"]["kind"] == "qwen3_text"
    assert all(parts[n]["weights"] > 0 and parts[n]["activations"] > 0 for n in ("text_encoder", "transformer"))
