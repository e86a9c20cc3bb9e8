"""A tiny faithful Qwen-Image (diffusers' ``QwenImagePipeline``), built offline from a fixed seed, exported to ONNX
and saved as a diffusers folder with the same weights. Build-time only: imports torch, diffusers and transformers.

What is kept from the released model, in miniature:

- the text encoder is a ``Qwen2_5_VLForConditionalGeneration`` (vision tower included, as the folder holds it; the
  pipeline runs its language model only) with grouped-query attention and M-RoPE sections, as diffusers' own tests
  build it (tests/pipelines/qwenimage: hidden 16, 2 layers, mrope_section (1, 1, 2)), here 32 wide so the
  transformer's ``joint_attention_dim`` differs from its inner width;
- the tokenizer is a byte-level BPE with Qwen2's pre-tokenizer (its split pattern, NFC), trained here on CLIP's
  English word list (engines/build/clip_vocab.py) and the prompt template, so the template's system prefix is the
  34 tokens the pipeline drops (``prompt_template_encode_start_idx``), as with the real 151,643-entry vocabulary;
  ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` follow the BPE entries, as in the real one;
- the transformer is ``QwenImageTransformer2DModel`` as diffusers' tests shape it (patch 2, two blocks, head 16,
  rope axes summing to the head width) with the real 64 packed input channels (16 latent channels × 2×2);
- the VAE is ``AutoencoderKLQwenImage`` with the real 16 latent channels, its three temporal/spatial downsamples
  (scale factor 8) and the released ``latents_mean``/``latents_std`` (its defaults), narrow;
- the scheduler is the released one: dynamic shifting between (256, 0.5) and (8192, 0.9), ``shift_terminal`` 0.02.

engines/build/qwen_export.py exports them (its docstring has the ONNX layout).
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.build.clip_vocab import clip_vocab, find_bpe_source
from engines.numerics.qwen_tokenizer import TEMPLATE, TEMPLATE_DROP

log = logging.getLogger(__name__)
SEED = 0
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_SIZE = 8192
PRETOKENIZE = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2's split pattern (transformers' models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX)."""
TEXT_WIDTH = 32
TEXT = dict(hidden_size=TEXT_WIDTH, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=1000000.0, max_position_embeddings=2048,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"})
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=TEXT_WIDTH)
TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=TEXT_WIDTH, guidance_embeds=False,
                   axes_dims_rope=(4, 6, 6))
VAE = dict(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])
SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                 base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
"""Qwen/Qwen-Image's scheduler_config.json."""
TINY_NATIVE_SIZE = 64


def _seeded(seed: int, make: Any) -> Any:
    torch.manual_seed(seed)
    return make().eval()


def train_vocab(bpe: Path | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE (vocabulary, merges) with Qwen2's pre-tokenizer, trained on CLIP's word list and the
    template (deterministic: same words, same merges); the special tokens follow the BPE entries."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    words = [w[:-4] for w in clip_vocab(find_bpe_source(bpe))[0] if w.endswith("</w>") and len(w) > 5]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, min_frequency=1)
    corpus = [" ".join(words[i:i + 50]) for i in range(0, len(words), 50)] + [TEMPLATE.format("")] * 50
    tokenizer.train_from_iterator(corpus, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = dict(model["vocab"])
    for token in SPECIALS:
        vocab[token] = len(vocab)
    return vocab, [tuple(m.split(" ", 1)) if isinstance(m, str) else (m[0], m[1]) for m in model["merges"]]


def write_qwen_tokenizer(out: Path, bpe: Path | None = None) -> int:
    """The tokenizer folder as transformers' ``Qwen2Tokenizer`` saves it (tokenizer.json among its files); returns
    the vocabulary's size, special tokens included."""
    from transformers import AddedToken, Qwen2Tokenizer

    vocab, merges = train_vocab(bpe)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[1:]])
    tokenizer.model_max_length = 32768
    tokenizer.save_pretrained(out)
    prefix = tokenizer(TEMPLATE.split("{}")[0]).input_ids
    if len(prefix) != TEMPLATE_DROP:
        raise RuntimeError(f"the template's system prefix is {len(prefix)} tokens, not {TEMPLATE_DROP}")
    return len(vocab)


def make_qwen_components(vocab_size: int, seed: int = SEED) -> dict[str, Any]:
    """The networks and scheduler of the tiny Qwen-Image, each module from its own seed."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rows = -(-vocab_size // 64) * 64  # the embedding is padded past the tokenizer, as the released one
    ids = {"bos_token_id": vocab_size - 3, "eos_token_id": vocab_size - 1, "pad_token_id": vocab_size - 3}
    config = Qwen2_5_VLConfig(text_config={**TEXT, "vocab_size": rows, **ids}, vision_config=VISION,
                              vocab_size=rows, **ids)
    return {
        "text_encoder": _seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(config)),
        "transformer": _seeded(seed + 1, lambda: QwenImageTransformer2DModel(**TRANSFORMER)),
        "vae": _seeded(seed + 2, lambda: AutoencoderKLQwenImage(**VAE)),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    }


def save_qwen_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path) -> Path:
    """The same weights as a diffusers ``QwenImagePipeline`` folder (parity tests, `sdserve engines export`)."""
    from diffusers import QwenImagePipeline
    from transformers import Qwen2Tokenizer

    QwenImagePipeline(**components, tokenizer=Qwen2Tokenizer.from_pretrained(tokenizer_dir)).save_pretrained(out)
    return out


def build_tiny_qwen(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                    vae_encoder: bool = True) -> Path:
    """Build the tiny Qwen-Image and export it to ``out``; ``diffusers_out``: the same weights as a diffusers folder
    too; ``vae_encoder``: export the VAE encoder (img2img) as well."""
    from engines.build.qwen_export import export_qwen

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        components = make_qwen_components(write_qwen_tokenizer(tokenizer_dir, bpe))
        export_qwen(components, tokenizer_dir, out, {"kind": "tiny", "family": "qwen-image", "seed": SEED},
                    vae_encoder, native_size=TINY_NATIVE_SIZE)
        if diffusers_out is not None:
            save_qwen_diffusers(components, tokenizer_dir, diffusers_out)
    log.info("tiny qwen-image model in %s", out)
    return out
