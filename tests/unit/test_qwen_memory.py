"""Qwen-Image in the memory plan (engines/health/memory_plan.py, param_counts.py) and admission's estimate
(request_memory.py): every formula against the module torch builds from the same config (the tiny build's configs
of engines/build/qwen.py and the released ones, on the meta device), the exported tiny folder against torch, and
the plan of a config-only folder of the released model (tests/data/qwen_image_configs.json) at its released
precision against an H200, an 80 GB and a 24 GB card."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.build.qwen import TEXT, TRANSFORMER, VAE, VISION
from engines.health import memory_plan as mp
from engines.health import param_counts as pc
from engines.health.request_memory import for_folder

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "qwen_image_configs.json").read_text())
RELEASED = DATA["qwen-image"]
GIB = 1 << 30
TRANSFORMER_PARAMS, TEXT_PARAMS = 20_430_401_088, 7_070_619_136
"""QwenImageTransformer2DModel and the Qwen2.5-VL language model from the released configs (torch, meta device)."""
CARDS = {"H200": 140 * GIB, "80 GB": 80 * GIB, "24 GB": 24 * GIB}


def config_folder(root: Path) -> Path:
    """A config-only Qwen-Image folder: the released JSON files, no weights."""
    for rel, body in RELEASED.items():
        (root / "qwen-image" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "qwen-image" / rel).write_text(json.dumps(body), encoding="utf-8")
    return root / "qwen-image"


def _counts(modules: list[torch.nn.Module]) -> tuple[int, int]:
    """(parameters, Linear/Conv weight elements)."""
    params = sum(p.numel() for m in modules for p in m.parameters())
    weights = sum(sub.weight.numel() for m in modules for sub in m.modules()
                  if isinstance(sub, torch.nn.Linear | torch.nn.Conv2d | torch.nn.Conv3d))
    return params, weights


def _released(name: str) -> dict[str, Any]:
    return {k: v for k, v in RELEASED[name].items() if not k.startswith("_") and k != "pooled_projection_dim"}


def _language_model(text: dict[str, Any]) -> Any:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=VISION))
    return model.model.language_model


RELEASED_TEXT = {k: v for k, v in RELEASED["text_encoder/config.json"].items()
                 if k not in ("architectures", "vision_config", "model_type")}


@pytest.mark.parametrize("config", [TRANSFORMER, _released("transformer/config.json")], ids=["tiny", "released"])
def test_the_transformer_formula_counts_what_torch_builds(config: dict[str, Any]) -> None:
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**config)
    tally = pc.qwen_transformer(dict(model.config))
    assert (tally.params, tally.adaptable) == _counts([model])


@pytest.mark.parametrize("text", [{**TEXT, "vocab_size": 8256}, RELEASED_TEXT], ids=["tiny", "released"])
def test_the_text_formula_counts_the_language_model(text: dict[str, Any]) -> None:
    """What the pipeline runs and the export writes: the language model, not the vision tower nor the LM head; the
    config read at its top level (the released layout) or from ``text_config``, alike."""
    with torch.device("meta"):
        model = _language_model(text)
    tally = pc.qwen_text(text)
    assert (tally.params, tally.adaptable) == _counts([model])
    assert pc.qwen_text({"text_config": text, "vocab_size": 1}).params == tally.params


@pytest.mark.parametrize("config", [
    VAE, _released("vae/config.json"),
    {**VAE, "attn_scales": [1.0, 0.5], "temperal_downsample": [True, False, True], "num_res_blocks": 2},
], ids=["tiny", "released", "attention levels, another temporal layout"])
def test_the_vae_halves(config: dict[str, Any]) -> None:
    from diffusers import AutoencoderKLQwenImage

    with torch.device("meta"):
        vae = AutoencoderKLQwenImage(**config)
    assert pc.qwen_vae_decoder(dict(vae.config)).params == _counts([vae.post_quant_conv, vae.decoder])[0]
    assert pc.qwen_vae_encoder(dict(vae.config)).params == _counts([vae.encoder, vae.quant_conv])[0]


def test_the_released_folder_is_laid_out_as_qwen_image(tmp_path: Path) -> None:
    folder = config_folder(tmp_path)
    lay = mp.layout(folder)
    assert lay.parts == {"text_encoder": "qwen_text", "transformer": "qwen_image",
                         "vae_decoder": "qwen_vae_decoder", "vae_encoder": "qwen_vae_encoder"}
    assert (lay.family, lay.cfg, lay.text_tokens, lay.factor) == ("qwen-image", True, 512, 8)
    plan = mp.plan(folder, mp.Served(1024, 1024, 1))
    parts = {c["name"]: c for c in plan["components"]}
    assert (parts["transformer"]["params"], parts["text_encoder"]["params"]) == (TRANSFORMER_PARAMS, TEXT_PARAMS)
    assert parts["vae_decoder"]["params"] + parts["vae_encoder"]["params"] == 73_295_603 + 53_596_928
    assert {c["dtype"] for c in parts.values()} == {"bf16"}  # the released precision, the text encoder's too
    assert all(c["source"] == "config" for c in parts.values()) and plan["missing"] == []


def test_activations_follow_the_formula(tmp_path: Path) -> None:
    """1024x1024 under true CFG: two rows of 512 text + 64x64 packed tokens, width 3072, 24 heads, bf16; the text
    encoder reads the template's 39 tokens around the 512 kept ones."""
    plan = mp.plan(config_folder(tmp_path), mp.Served(1024, 1024, 1))
    act = {c["name"]: c["activations"] for c in plan["components"]}
    tokens = 512 + 64 * 64
    assert plan["served"]["rows"] == 2
    assert act["transformer"] == 2 * (tokens * 3072 * 20 * 2 + 24 * tokens**2 * 4)
    text = 39 + 512
    assert act["text_encoder"] == 2 * (text * 3584 * 20 * 2 + 28 * text**2 * 4 + text * (4 * 18944 - 8 * 3584) * 2)
    # the decoder's full-size level: 96 channels x 8 tensors (the causal pad's two frames), + 128^2 latent scores
    assert act["vae_decoder"] == 1024 * 1024 * 96 * 8 * 2 + (128 * 128) ** 2 * 4


@pytest.mark.parametrize(("size", "sizes", "fits"), [
    ((1024, 1024), 1, {"H200": True, "80 GB": True, "24 GB": False}),
    ((1328, 1328), 1, {"H200": True, "80 GB": True, "24 GB": False}),
    ((1024, 1024), 2, {"H200": True, "80 GB": False, "24 GB": False}),
], ids=["1024, one size", "1328 (the card's square), one size", "1024, two served sizes"])
def test_what_fits_which_card(tmp_path: Path, size: tuple[int, int], sizes: int, fits: dict[str, bool]) -> None:
    """The bf16 weights alone are 51.5 GiB: no 24 GB card; one engine per served size doubles them under TensorRT.
    LoRA's variant is the fp32 export's second copy of the transformer (76 GiB): it fits no card."""
    folder = config_folder(tmp_path)
    for card, have in CARDS.items():
        plan = mp.plan(folder, mp.Served(*size, 1, sizes=sizes), budgets=mp.Budgets(have, card))
        verdicts = plan["device"]["verdicts"]
        assert verdicts["base"]["fits"] == fits[card], (card, plan["device"]["base"] / GIB)
        assert not verdicts["lora_denoiser"]["fits"]
    weights = mp.plan(folder, mp.Served(*size, 1, sizes=sizes))["device"]["weights"]
    assert weights == 2 * sizes * (TRANSFORMER_PARAMS + TEXT_PARAMS + 73_295_603 + 53_596_928)


def test_the_cuda_policy_at_the_released_precision(tmp_path: Path) -> None:
    """Without TensorRT the files' dtype serves (fp32 from `engines export`: 102 GiB of weights); `--plan-dtype bf16`
    shows the released precision, one shared arena."""
    folder = config_folder(tmp_path)
    fp32 = mp.plan(folder, mp.Served(1024, 1024, 1, tensorrt=False))
    bf16 = mp.plan(folder, mp.Served(1024, 1024, 1, tensorrt=False), "bf16")
    assert fp32["device"]["weights"] == 2 * bf16["device"]["weights"]
    parts = {c["name"]: c for c in bf16["components"]}
    assert bf16["device"]["activations"] == max(c["activations"] for c in parts.values()) == \
        parts["transformer"]["activations"]


def test_admission_estimates_a_qwen_request(tmp_path: Path) -> None:
    """request_memory.for_folder reads the Qwen layout: the denoiser stage at 1024x1024 is its measured-rule
    activations at the files' fp32, and it grows with the images a call carries."""
    memory = for_folder(config_folder(tmp_path))
    assert memory is not None and memory.factor == 8
    one, two = memory.need(1024, 1024, 1, 1), memory.need(1024, 1024, 2, 2)
    stages = dict(one.stages)
    expected = mp.activations("qwen_image", RELEASED["transformer/config.json"], mp.Served(1024, 1024, 1),
                              memory.lay, 4, measured=True)
    assert stages["denoiser"] == int(expected * 1.4) and one.stage == "denoiser"
    assert dict(two.stages)["denoiser"] > stages["denoiser"] and stages["text encoder"] > 0


def test_the_exported_tiny_folder_matches_torch(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    """The files' counts (ONNX headers) against the diffusers folder's modules. The transformer's export drops the
    last block's text-stream tail (its MLP and ``to_add_out``: only the image stream reaches the output; 0.4% of
    the released transformer, so the config's count is an upper bound); otherwise within 1% (the exporter shares
    the tiny model's identical all-ones norm weights), and the Linear weights LoRA may adapt one for one."""
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    onnx_dir, diffusers_dir = dit_build("qwen-image")
    plan = mp.plan(onnx_dir, mp.Served(64, 64, 1))
    parts = {c["name"]: c for c in plan["components"]}
    assert plan["family"] == "qwen-image" and all(c["source"] == "onnx" for c in parts.values())
    transformer = QwenImageTransformer2DModel.from_pretrained(diffusers_dir / "transformer")
    last = transformer.transformer_blocks[-1]
    text = Qwen2_5_VLForConditionalGeneration.from_pretrained(diffusers_dir / "text_encoder").model.language_model
    for name, model, dead in (("transformer", transformer, [last.txt_mlp, last.attn.to_add_out]),
                              ("text_encoder", text, [])):
        params, weights = _counts([model])
        tally = mp.count(parts[name]["kind"], json.loads((onnx_dir / name / "config.json").read_text()))
        assert (tally.params, tally.adaptable) == (params, weights), name
        dead_params, dead_weights = _counts(dead)
        assert abs(parts[name]["params"] - (params - dead_params)) <= params / 100, name
        assert parts[name]["adaptable_bytes"] == 4 * (weights - dead_weights), name
