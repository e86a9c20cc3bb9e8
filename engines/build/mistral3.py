"""FLUX.2 [dev] (diffusers' ``Flux2Pipeline``, 0.42): its text encoder's export, the tiny faithful model and the
export of local diffusers folders (`sdserve engines export --from`). Build-time only: imports torch, diffusers and
transformers.

- The text encoder is Mistral Small 3.1's language model (``Mistral3ForConditionalGeneration.model.language_model``)
  exported as the pipeline reads it — the hidden states at ``FLUX2_DEV_TEXT_LAYERS`` (10, 20, 30) stacked per token,
  [B, S, 3 × width]. Layers past the deepest one read are dropped from the graph (their outputs are never used) and
  the final norm with them; the vision tower is never run by the pipeline and is not exported.
- The transformer, VAE and scheduler are FLUX.2's (engines/build/flux2.py writes them, the transformer with its
  ``guidance`` input: dev's ``guidance_embeds``); the folder's class is ``OnnxFlux2Pipeline``.
- The VAE encoder (reference images, ``Flux2Pipeline``'s ``image=``): engines/build/flux2_refs.py
  ``export_flux2_encoder``, as for klein; the tiny build and the export of a diffusers folder both write it.
- The tiny model: a ``Mistral3ForConditionalGeneration`` 32 layers deep (the deepest state read is not the last,
  as in the released 40), a byte-level BPE tokenizer with Mistral's special tokens and a chat template rendering
  what Mistral Small 3.1's renders for the pipeline's messages (a system turn and one user text turn:
  ``<s>[SYSTEM_PROMPT]…[/SYSTEM_PROMPT][INST]…[/INST]``), right padding with ``<pad>``."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.build.dit_folder import TORCH_DTYPES, config_of, half_plan, load_diffusers, with_io
from engines.build.flux2 import SCHEDULER, TINY_NATIVE_SIZE, export_flux2, export_rms, tiny_transformer_and_vae
from engines.build.flux2_refs import export_flux2_encoder
from engines.health.param_counts import FLUX2_DEV_TEXT_LAYERS

log = logging.getLogger(__name__)
SEED = 0
CLASS_NAME = "OnnxFlux2Pipeline"
"""model_index.json ``_class_name`` of an exported FLUX.2 [dev] folder (its registry row claims it)."""
TINY_TEXT = dict(hidden_size=64, num_hidden_layers=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, vocab_size=512, max_position_embeddings=1024)
"""A Mistral language model in miniature, deep enough (32 > 30) that the deepest state read is not the last."""
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16)
"""The Pixtral vision tower of the tiny Mistral3 (the pipeline never runs it: its input images go through the VAE
encoder, the prompt's text alone through the language model)."""
TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=len(FLUX2_DEV_TEXT_LAYERS) * TINY_TEXT["hidden_size"],
                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=True)
"""``Flux2Transformer2DModel`` in miniature with dev's guidance embedding."""
SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
"""Mistral's control tokens the pipeline's template uses (Tekken's first ids, in its order)."""
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set turns = messages[1:] %}"
    "{% if messages[0]['content'] is string %}{% set system = messages[0]['content'] %}"
    "{% else %}{% set system = messages[0]['content'][0]['text'] %}{% endif %}"
    "{% else %}{% set turns = messages %}{% set system = '' %}{% endif %}"
    "[SYSTEM_PROMPT]{{ system }}[/SYSTEM_PROMPT]"
    "{% for turn in turns %}{% if turn['role'] == 'user' %}[INST]{% if turn['content'] is string %}"
    "{{ turn['content'] }}{% else %}{% for part in turn['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% else %}[IMG]{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif turn['role'] == 'assistant' %}{{ turn['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
"""What Mistral Small 3.1's chat template renders for a system turn and user turns (text and image blocks)."""


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


def export_mistral3_text(language_model: Any, out: Path, layers: tuple[int, ...] = FLUX2_DEV_TEXT_LAYERS,
                         dtype: str = "fp32") -> Path:
    """Writes ``out`` (model.onnx): input_ids and attention_mask [B, S] int64 in, prompt_embeds out (fp32 at the
    graph's edges; the network in ``dtype``)."""
    model = truncated(language_model, max(layers)).to(TORCH_DTYPES[dtype]).eval()
    ids = torch.ones((1, 8), dtype=torch.int64)
    export_rms(with_io(_MistralStates(model, layers), dtype), (ids, torch.ones_like(ids)), out,
               ["input_ids", "attention_mask"],
            ["prompt_embeds"], {"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                                "prompt_embeds": {0: "batch", 1: "tokens"}})
    return out


def _export_text(text_encoder: Any, out: Path, dtype: str = "fp32") -> None:
    """engines/build/flux2.py's text hook: the language model of a ``Mistral3ForConditionalGeneration``."""
    export_mistral3_text(text_encoder.model.language_model, out / "text_encoder" / "model.onnx", dtype=dtype)


def text_config(text_encoder: Any) -> dict[str, Any]:
    """The text encoder's config.json in the exported folder: the language model's (what the memory plan counts)."""
    return dict(text_encoder.config.text_config.to_dict())


# --- the tiny model ---------------------------------------------------------------------------------------------

def write_mistral3_tokenizer(out: Path, bpe: Path | None = None) -> int:
    """The tokenizer folder (tokenizer.json, tokenizer_config.json with the chat template, right padding with
    ``<pad>``): a byte-level BPE after Mistral's control tokens; returns the vocabulary's size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engines.build.qwen import PRETOKENIZE, train_vocab

    trained, merges = train_vocab(bpe)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for token in sorted(trained, key=trained.__getitem__):
        vocab.setdefault(token, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>", padding_side="right",
                                        additional_special_tokens=list(SPECIALS[3:6] + SPECIALS[7:]),
                                        model_max_length=131072)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return len(vocab)


def make_flux2_dev_components(vocab_size: int, seed: int = SEED) -> dict[str, Any]:
    """The networks and scheduler of the tiny FLUX.2 [dev], each module from its own seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = {"model_type": "mistral", **TINY_TEXT, "vocab_size": -(-vocab_size // 64) * 64,
            "pad_token_id": SPECIALS.index("<pad>"), "bos_token_id": 1, "eos_token_id": 2}
    config = Mistral3Config(text_config=text, vision_config={"model_type": "pixtral", **TINY_VISION},
                            image_token_index=SPECIALS.index("[IMG]"))
    torch.manual_seed(seed)
    encoder = Mistral3ForConditionalGeneration(config).eval()
    transformer, vae = tiny_transformer_and_vae(TRANSFORMER, seed)
    return {"text_encoder": encoder, "transformer": transformer, "vae": vae,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER)}


def save_flux2_dev_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path) -> Path:
    """The same weights as a diffusers ``Flux2Pipeline`` folder (parity tests, `sdserve engines export`)."""
    from diffusers import Flux2Pipeline
    from transformers import PreTrainedTokenizerFast

    Flux2Pipeline(**components, tokenizer=PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)).save_pretrained(out)
    return out


def export_flux2_dev(components: dict[str, Any], tokenizer_dir: Path, out: Path, source: dict[str, Any],
                     native_size: int | None = None, dtype: str = "fp32") -> Path:
    """engines/build/flux2.py ``export_flux2`` with this module's text encoder and class name."""
    return export_flux2(components, tokenizer_dir, out, source, native_size, dtype, class_name=CLASS_NAME,
                        text=(_export_text, text_config))


def build_tiny_flux2_dev(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                         vae_encoder: bool = True) -> Path:
    """Build the tiny FLUX.2 [dev] and export it to ``out``, with its VAE encoder (reference images) unless
    ``vae_encoder`` is false (txt2img only); ``diffusers_out``: the same weights as a diffusers folder too."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        components = make_flux2_dev_components(write_mistral3_tokenizer(tokenizer_dir, bpe))
        source = {"kind": "tiny", "family": "flux2-dev", "seed": SEED}
        export_flux2_dev(components, tokenizer_dir, out, source, native_size=TINY_NATIVE_SIZE)
        if vae_encoder:
            export_flux2_encoder(components["vae"], out, source)
        if diffusers_out is not None:
            save_flux2_dev_diffusers(components, tokenizer_dir, diffusers_out)
    log.info("tiny FLUX.2 [dev] model in %s", out)
    return out


def export_flux2_dev_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers ``Flux2Pipeline`` folder in ``dtype`` (the networks load in their export dtype:
    engines/build/dit_folder.py ``half_plan``) with its VAE encoder (the VAE as ``export_flux2`` cast it, the
    manifest's source as it wrote it); ModelLoadError for an sdserve ONNX folder."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3ForConditionalGeneration

    family, parts = load_diffusers(src, dtype, Mistral3ForConditionalGeneration, Flux2Transformer2DModel,
                                   AutoencoderKLFlux2)
    log.info("exporting %s (%s, %s) to %s", src, family.name, dtype, out)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer"
        shutil.copytree(src / "tokenizer", tokenizer)
        export_flux2_dev(parts, tokenizer, out, {"kind": "diffusers-folder", "family": family.name,
                                                 "path_name": src.name}, dtype=dtype)
    source = json.loads((out / "manifest.json").read_text(encoding="utf-8")).get("source", {})
    return export_flux2_encoder(parts["vae"], out, source, half_plan(dtype, config_of(parts["vae"]))["vae"])
