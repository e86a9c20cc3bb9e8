"""FLUX.2 [klein] and Z-Image LoRA naming, without a model: the original checkpoint layouts (BFL's fused qkv and
``single_blocks``, Z-Image's fused ``attention.qkv``) mapped onto diffusers' weights by row chunks of the up
factor, and what does not fit refused by name (a fused up factor whose rows are not the parts' rows, a module
the architecture's rules do not name, the Qwen3 text encoder)."""

from __future__ import annotations

import numpy as np
import pytest

from engines.lora import keys, library
from engines.lora.safetensors import Header, LoraFileError, TensorEntry
from engines.lora.targets import Target

WIDTH = 32


def _target(module: str, out_in: tuple[int, int] = (WIDTH, WIDTH)) -> Target:
    return Target(module, f"w.{module}", "transposed", (out_in[1], out_in[0]), np.float32)


def _header(shapes: dict[str, tuple[int, ...]]) -> Header:
    return Header({name: TensorEntry("F32", shape, 0, 0) for name, shape in shapes.items()}, {}, 0)


def _resolve(shapes: dict[str, tuple[int, ...]], weights: dict[str, Target], family: str) -> dict[str, keys.Rows]:
    modules = keys.parse("f", list(shapes))
    found = library.resolve("f", modules, _header(shapes), {"transformer": weights}, family)
    return {r.target.module: r.rows for r in found}


FLUX2 = {m: _target(m) for m in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                 "transformer_blocks.0.attn.to_v", "norm_out.linear")}
FLUX2["single_transformer_blocks.0.attn.to_qkv_mlp_proj"] = _target(
    "single_transformer_blocks.0.attn.to_qkv_mlp_proj", (9 * WIDTH, WIDTH))


@pytest.mark.parametrize("family", ["flux2-klein", "flux2-klein-base", "flux2-dev"])
@pytest.mark.parametrize(("qkv", "suffixes"), [
    ("diffusion_model.double_blocks.0.img_attn.qkv", (".lora_A.weight", ".lora_B.weight")),
    ("lora_unet_double_blocks_0_img_attn_qkv", (".lora_down.weight", ".lora_up.weight"))])
def test_a_fused_qkv_in_bfl_names_is_split_over_q_k_v(family: str, qkv: str, suffixes: tuple[str, str]) -> None:
    shapes = {qkv + suffixes[0]: (4, WIDTH), qkv + suffixes[1]: (3 * WIDTH, 4)}
    assert _resolve(shapes, FLUX2, family) == {"transformer_blocks.0.attn.to_q": ((0, 3),),
                                               "transformer_blocks.0.attn.to_k": ((1, 3),),
                                               "transformer_blocks.0.attn.to_v": ((2, 3),)}


def test_bfl_single_blocks_and_the_final_modulation() -> None:
    """linear1 is diffusers' fused to_qkv_mlp_proj, whole; the final modulation's halves are swapped (BFL's
    (shift, scale) is diffusers' (scale, shift))."""
    shapes = {"diffusion_model.single_blocks.0.linear1.lora_A.weight": (4, WIDTH),
              "diffusion_model.single_blocks.0.linear1.lora_B.weight": (9 * WIDTH, 4),
              "diffusion_model.final_layer.adaLN_modulation.1.lora_A.weight": (4, WIDTH),
              "diffusion_model.final_layer.adaLN_modulation.1.lora_B.weight": (WIDTH, 4)}
    assert _resolve(shapes, FLUX2, "flux2-klein") == {"single_transformer_blocks.0.attn.to_qkv_mlp_proj": (),
                                                      "norm_out.linear": ((1, 2), (0, 2))}


def test_take_rows_concatenates_the_chunks_in_order() -> None:
    up = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.testing.assert_array_equal(keys.take_rows(up, ((2, 3),)), up[4:6])
    np.testing.assert_array_equal(keys.take_rows(up, ((1, 2), (0, 2))), np.concatenate([up[3:], up[:3]]))
    assert keys.take_rows(up, ()) is up


@pytest.mark.parametrize("rows", [2 * WIDTH, 3 * WIDTH + 3, WIDTH])
def test_a_fused_up_factor_of_the_wrong_rows_is_refused_with_its_shapes(rows: int) -> None:
    shapes = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, WIDTH),
              "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": (rows, 4)}
    with pytest.raises(LoraFileError, match=rf"has factors up \[{rows}, 4\] x down \[4, {WIDTH}\], but this "
                                            rf"flux2-klein model's weight is {WIDTH} x {WIDTH}"):
        _resolve(shapes, FLUX2, "flux2-klein")


def test_a_part_missing_from_the_graph_refuses_the_module() -> None:
    """A fused qkv on a block the graph does not have (a bigger model's LoRA) is not half-applied."""
    shapes = {"diffusion_model.double_blocks.7.img_attn.qkv.lora_A.weight": (4, WIDTH),
              "diffusion_model.double_blocks.7.img_attn.qkv.lora_B.weight": (3 * WIDTH, 4)}
    with pytest.raises(LoraFileError, match="double_blocks.7.img_attn.qkv matches no weight of this flux2-klein"):
        _resolve(shapes, FLUX2, "flux2-klein")


def test_the_rules_are_per_architecture() -> None:
    """Z-Image's fused attention names mean nothing on FLUX.2, and BFL's on Z-Image."""
    zimage = {m: _target(m) for m in ("layers.0.attention.to_q", "layers.0.attention.to_k",
                                      "layers.0.attention.to_v", "layers.0.attention.to_out.0", "2-1")}
    fused = {"lora_unet_layers_0_attention_qkv.lora.down.weight": (4, WIDTH),
             "lora_unet_layers_0_attention_qkv.lora.up.weight": (3 * WIDTH, 4),
             "lora_unet_layers_0_attention_out.lora.down.weight": (4, WIDTH),
             "lora_unet_layers_0_attention_out.lora.up.weight": (WIDTH, 4),
             "transformer.all_x_embedder.2-1.lora_A.weight": (4, WIDTH),
             "transformer.all_x_embedder.2-1.lora_B.weight": (WIDTH, 4)}
    assert _resolve(fused, zimage, "z-image-turbo") == {
        "layers.0.attention.to_q": ((0, 3),), "layers.0.attention.to_k": ((1, 3),),
        "layers.0.attention.to_v": ((2, 3),), "layers.0.attention.to_out.0": (), "2-1": ()}
    with pytest.raises(LoraFileError, match="matches no weight of this flux2-klein"):
        _resolve(fused, {**FLUX2, **zimage}, "flux2-klein")
    bfl = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": (4, WIDTH),
           "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": (3 * WIDTH, 4)}
    with pytest.raises(LoraFileError, match="matches no weight of this z-image"):
        _resolve(bfl, {**FLUX2, **zimage}, "z-image")


@pytest.mark.parametrize(("family", "loader"), [("flux2-klein", "Flux2LoraLoaderMixin"),
                                                ("flux2-klein-base", "Flux2LoraLoaderMixin"),
                                                ("z-image", "ZImageLoraLoaderMixin"),
                                                ("z-image-turbo", "ZImageLoraLoaderMixin")])
def test_a_qwen3_text_encoder_module_is_refused_with_the_reason(family: str, loader: str) -> None:
    shapes = {"lora_te_layers_0_self_attn_q_proj.lora_down.weight": (4, WIDTH),
              "lora_te_layers_0_self_attn_q_proj.lora_up.weight": (WIDTH, 4)}
    with pytest.raises(LoraFileError, match=f"adapts text_encoder: .*{loader} loads none into the Qwen3 text "
                                            "encoder"):
        _resolve(shapes, FLUX2, family)
