"""FLUX.2 [dev]'s text encoder (diffusers' ``Flux2Pipeline``, 0.42): Mistral Small 3.1's language model
(``Mistral3ForConditionalGeneration.model.language_model``) exported to ONNX as the pipeline reads it — the hidden
states at ``FLUX2_DEV_TEXT_LAYERS`` (10, 20, 30) stacked per token, [B, S, 3 × width]. Layers past the deepest one
read are dropped from the graph (their outputs are never used) and the final norm with them. Build-time only:
imports torch and transformers.

Not yet wired: the tiny faithful model's tokenizer (the pipeline's Pixtral processor with its chat template and
system message) and the serving pipeline's dev variant."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from engines.build.flux2 import export_rms
from engines.health.param_counts import FLUX2_DEV_TEXT_LAYERS

TINY_TEXT = dict(hidden_size=64, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=512, max_position_embeddings=1024)
"""A Mistral language model in miniature, deep enough (32 > 30) that the deepest state read is not the last."""


class _MistralStates(torch.nn.Module):
    """The language model's hidden states at ``layers``, stacked per token: [B, S, len(layers) × width]."""

    def __init__(self, language_model: Any, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.layers = language_model, layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                         use_cache=False)
        return torch.stack([out.hidden_states[k] for k in self.layers], dim=2).flatten(2)


def truncated(language_model: Any, deepest: int) -> Any:
    """A copy of ``language_model`` holding only its first ``deepest`` decoder layers and no final norm (hidden
    states 0..deepest are unchanged: each is the previous layer's output; transformers norms its last state)."""
    model = copy.deepcopy(language_model)
    if deepest < len(model.layers):
        model.layers = torch.nn.ModuleList(list(model.layers)[:deepest])
        model.config.num_hidden_layers = deepest
        model.norm = torch.nn.Identity()  # transformers gives the last state read normed: here it is not the last
    return model


def export_mistral3_text(language_model: Any, out: Path, layers: tuple[int, ...] = FLUX2_DEV_TEXT_LAYERS) -> Path:
    """Writes ``out`` (model.onnx): input_ids and attention_mask [B, S] int64 in, prompt_embeds out."""
    model = truncated(language_model, max(layers)).float().eval()
    ids = torch.ones((1, 8), dtype=torch.int64)
    export_rms(_MistralStates(model, layers), (ids, torch.ones_like(ids)), out, ["input_ids", "attention_mask"],
            ["prompt_embeds"], {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                                "prompt_embeds": {0: "batch", 1: "tokens"}})
    return out
