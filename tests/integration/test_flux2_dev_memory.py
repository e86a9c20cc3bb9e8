"""FLUX.2 [dev]'s text encoder sized from its config alone: the Mistral Small 3.1 language model as far as diffusers'
Flux2Pipeline reads it (hidden states 10, 20 and 30, transformers' models/mistral/modeling_mistral.py:
``hidden_states`` index k is decoder layer k's output, the final norm applies only after the last layer)."""

from __future__ import annotations

from typing import Any

import pytest

from engines.health.param_counts import FLUX2_DEV_TEXT_LAYERS, mistral3_text

TINY: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 24, "intermediate_size": 96, "vocab_size": 300}


def _count(config: dict[str, Any]) -> int:
    import torch
    from transformers import MistralConfig, MistralModel

    with torch.device("meta"):
        return sum(p.numel() for p in MistralModel(MistralConfig(**config)).parameters())


def test_the_pipeline_reads_the_layers_the_formula_stops_at() -> None:
    """The layers stacked by diffusers' pipeline_flux2.py are the formula's (a change there changes the count)."""
    import inspect

    from diffusers import Flux2Pipeline

    default = inspect.signature(Flux2Pipeline.encode_prompt).parameters["text_encoder_out_layers"].default
    assert tuple(default) == FLUX2_DEV_TEXT_LAYERS


@pytest.mark.parametrize("deepest", [4, 9])
def test_read_to_the_last_layer_the_formula_is_the_whole_language_model(deepest: int) -> None:
    assert mistral3_text(TINY, deepest=deepest).params == _count(TINY)


@pytest.mark.parametrize("deepest", [1, 3])
def test_layers_past_the_deepest_read_and_the_final_norm_are_not_counted(deepest: int) -> None:
    fewer = {**TINY, "num_hidden_layers": deepest}
    assert mistral3_text(TINY, deepest=deepest).params == _count(fewer) - TINY["hidden_size"]


def test_the_released_config_is_counted_from_its_text_config() -> None:
    """Mistral3Config's defaults are Mistral Small 3.1's language model (5120 wide, 40 layers, 32/8 heads of 128,
    MLP 32768, vocabulary 131072): the whole model is transformers' count, the 30 layers FLUX.2 [dev] runs ~17.3B."""
    from transformers import Mistral3Config

    config = Mistral3Config().to_dict()
    text = config["text_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]) == (5120, 40, 32768)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (32, 8, 128)
    assert text["vocab_size"] == 131072
    assert mistral3_text(config, deepest=40).params == _count(text)
    assert mistral3_text(config).params == 17_343_754_240
    assert mistral3_text({}).params == mistral3_text(config).params
