"""Qwen-Image LoRA naming, without a model: the module scopes its export writes, the prefixes its LoRA files use,
the last block's pruned text stream, and the text encoder refused by the family's facts."""

from __future__ import annotations

import numpy as np
import pytest

from engines.lora import keys, library, targets
from engines.lora.safetensors import Header, LoraFileError, TensorEntry
from engines.lora.targets import Target


def test_a_sequential_child_scope_is_the_module_diffusers_names() -> None:
    assert targets.module_of("/model/transformer_blocks.0/img_mod/img_mod.1/Gemm") == "transformer_blocks.0.img_mod.1"
    assert targets.module_of("/model/transformer_blocks.0/img_mlp/net.0/proj/MatMul") == \
        "transformer_blocks.0.img_mlp.net.0.proj"
    assert targets.module_of("/model/down_blocks.1/attentions.0/proj_in/Conv") == "down_blocks.1.attentions.0.proj_in"


@pytest.mark.parametrize("key", ["diffusion_model.transformer_blocks.3.attn.to_q.lora_A.weight",
                                 "transformer.transformer_blocks.3.attn.to_q.lora_A.weight",
                                 "transformer_blocks.3.attn.to_q.lora_A.default.weight",
                                 "diffusion_model.transformer_blocks.3.attn.to_q.lora_down.weight"])
def test_every_qwen_convention_names_the_denoiser_module(key: str) -> None:
    up = key.replace("lora_A", "lora_B").replace("lora_down", "lora_up")
    [module] = keys.parse("f", [key, up])
    assert (module.component, keys.normalize(module.path), module.kohya) == \
        (keys.DENOISER, "transformer_blocks.3.attn.to_q", False)


def _target(module: str) -> Target:
    return Target(module, f"w.{module}", "transposed", (32, 32), np.float32)


INDEX = targets.kohya_index({m: _target(m) for m in (
    "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.txt_mlp.net.2", "transformer_blocks.1.attn.to_q",
    "transformer_blocks.2.attn.to_q", "proj_out")})


@pytest.mark.parametrize(("flat", "sibling"), [
    ("transformer_blocks_2_attn_to_add_out", "transformer_blocks.0.attn.to_add_out"),  # the last block: pruned
    ("transformer_blocks_2_txt_mlp_net_2", "transformer_blocks.0.txt_mlp.net.2"),
    ("transformer_blocks_1_attn_to_add_out", None),  # not the last block: a missing module is a real mismatch
    ("transformer_blocks_3_attn_to_q", None),  # past the last block: a bigger model's LoRA
    ("transformer_blocks_2_attn_to_zz", None),  # a module no block has
    ("proj_in", None)])
def test_only_the_last_blocks_modules_that_earlier_blocks_have_are_pruned(flat: str, sibling: str | None) -> None:
    assert targets.pruned_sibling(flat, INDEX) == sibling


def _header(names: list[str]) -> Header:
    tensors = {}
    for name in names:
        shape = (4, 32) if name.endswith("lora_A.weight") else (32, 4)
        tensors[name] = TensorEntry("F32", shape, 0, 0)
    return Header(tensors, {}, 0)


def test_a_text_encoder_module_on_qwen_image_is_refused_with_the_reason() -> None:
    names = ["text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight",
             "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight"]
    modules = keys.parse("f", names)
    weights = {"transformer": {"transformer_blocks.0.attn.to_q": _target("transformer_blocks.0.attn.to_q")}}
    with pytest.raises(LoraFileError, match="adapts text_encoder: Qwen-Image LoRAs adapt the transformer only"):
        library.resolve("f", modules, _header(names), weights, "qwen-image")
    with pytest.raises(LoraFileError, match="which this flux model does not have"):
        library.resolve("f", modules, _header(names), weights, "flux")
