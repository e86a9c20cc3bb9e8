"""Z-Image (diffusers' ``ZImagePipeline``, 0.42): a tiny faithful model built offline from a fixed seed, and the
ONNX export of it and of local diffusers folders (`sdserve engines export --from`). Build-time only: imports torch,
diffusers and transformers.

The tiny model keeps the released structure in miniature: a ``Qwen3Model`` text encoder (grouped-query attention,
q/k norms, three layers so its second-to-last hidden state, the one the pipeline reads, is not its last), the
byte-level BPE tokenizer of engines/build/qwen.py with Qwen3's chat template (the user turn and the generation
prompt, ``enable_thinking``), a ``ZImageTransformer2DModel`` (patch 2, a noise and a context refiner, two main
blocks, rope axes summing to the head width, its pad tokens drawn at random so the padding is exercised) and the
FLUX.1 VAE shape (16 latent channels, scaling 0.3611, shift 0.1159), with the released scheduler (static shift 3).

Output layout (ONNX, legacy exporter; fp32, or fp16/bf16 behind fp32 inputs and outputs: engines/build/dit_folder.py
``half_plan``; weights in model.onnx.data past 2 GB)::

    text_encoder/ transformer/ vae_decoder/ [vae_encoder/]  model.onnx + config.json
    tokenizer/tokenizer.json  scheduler/scheduler_config.json  model_index.json (OnnxZImagePipeline)  manifest.json

- ``text_encoder``: ``input_ids`` [B, S] -> ``prompt_embeds`` [B, S, width], the Qwen3 model's
  ``hidden_states[-2]``. No attention mask: the attention is causal and the rows right-padded, so the valid tokens
  get the states diffusers' masked run gives them (the pipeline keeps only those).
- ``transformer``: diffusers' forward takes lists of per-image latents and caption features of any length; this
  wrapper takes fixed-size batched tensors and computes the same thing: ``hidden_states`` [B, 16, H, W] (unpacked
  latents), ``timestep`` [B] (the scheduler's ``t``: the graph computes ``(1000 - t) / 1000`` as the pipeline
  does), ``encoder_hidden_states`` [B, T, width] with ``encoder_hidden_states_mask`` [B, T] (1 for a prompt's
  tokens, a prefix), and the size's tables from the pipeline (engines/pipelines/zimage.py ``image_tables``):
  ``image_index`` [N'] int64 and ``image_pad`` [N'] (the image tokens padded to a multiple of 32 as
  ``_pad_with_ids`` pads them), ``image_rope_cos``/``image_rope_sin`` [N', head] (the h/w axes; the first axis
  identity) and ``text_rope_cos``/``text_rope_sin`` [T, head] (caption positions 1..T). Per row the graph rounds the
  prompt's length L up to a multiple of 32 (Lp): tokens L..Lp-1 become ``cap_pad_token`` and take part in attention
  as in diffusers, tokens past Lp are masked keys (what batching does there), and the image's first rope axis is
  Lp + 1 (gathered from the constant table diffusers precomputes). Output ``out_hidden_states`` [B, 16, H, W] is
  the negated prediction (the pipeline's ``-noise_pred``): a plain flow-matching velocity.
- ``vae_decoder`` / ``vae_encoder``: the AutoencoderKL halves as engines/build/dit_export.py exports them.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engines.build.dit_export import apply_dtype
from engines.build.dit_folder import config_of, load_diffusers, with_io, write_folder
from engines.build.dit_folder import export_onnx as _export
from engines.build.export import VaeDecoderExport, VaeEncoderExport

log = logging.getLogger(__name__)
SEED = 0
CLASS_NAME = "OnnxZImagePipeline"
"""model_index.json ``_class_name`` of an exported folder."""
SEQ_MULTI_OF = 32
"""diffusers' transformer_z_image.SEQ_MULTI_OF: image and caption tokens are padded to a multiple of it."""
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
                 "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- if enable_thinking is defined and enable_thinking is false %}"
                 "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
"""Qwen3's chat template for what the pipeline sends (one user message, the generation prompt)."""
TEXT_WIDTH = 32
TEXT = dict(hidden_size=TEXT_WIDTH, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rope_theta=1000000.0, max_position_embeddings=2048)
TRANSFORMER = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
                   n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=TEXT_WIDTH, axes_dims=[8, 4, 4],
                   axes_lens=[1024, 512, 512])
VAE = dict(block_out_channels=(32, 64, 64, 64), in_channels=3, out_channels=3, latent_channels=16,
           down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, sample_size=64,
           norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611,
           shift_factor=0.1159)
"""The FLUX.1 VAE's shape in miniature (engines/build/dit.py VAE16) with its scaling and shift."""
SCHEDULERS: dict[str, dict[str, Any]] = {
    "z-image-turbo": dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
    "z-image": dict(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False),
}
"""The released scheduler configs (static shift)."""
TINY_NATIVE_SIZE = 64


def _seeded(seed: int, make: Any) -> Any:
    torch.manual_seed(seed)
    return make().eval()


def write_zimage_tokenizer(out: Path, bpe: Path | None = None) -> int:
    """The tokenizer folder (Qwen2Tokenizer with Qwen3's chat template); returns the vocabulary size."""
    from transformers import AddedToken, Qwen2Tokenizer

    from engines.build.qwen import SPECIALS, train_vocab

    vocab, merges = train_vocab(bpe)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[1:]])
    tokenizer.model_max_length = 32768
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return len(vocab)


def make_zimage_components(family: str, vocab_size: int, seed: int = SEED) -> dict[str, Any]:
    """The networks and scheduler of the tiny Z-Image, each module from its own seed."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    rows = -(-vocab_size // 64) * 64
    config = Qwen3Config(**TEXT, vocab_size=rows, bos_token_id=vocab_size - 3, eos_token_id=vocab_size - 1,
                         pad_token_id=vocab_size - 3)
    transformer = _seeded(seed + 1, lambda: ZImageTransformer2DModel(**TRANSFORMER))
    with torch.no_grad():  # zeros when released untrained: drawn here so the padding changes the output
        transformer.x_pad_token.copy_(torch.randn_like(transformer.x_pad_token))
        transformer.cap_pad_token.copy_(torch.randn_like(transformer.cap_pad_token))
    return {
        "text_encoder": _seeded(seed, lambda: Qwen3Model(config)),
        "transformer": transformer,
        "vae": _seeded(seed + 2, lambda: AutoencoderKL(**VAE)),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULERS[family]),
    }


class _TextModel(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, output_hidden_states=True, return_dict=True).hidden_states[-2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' complex rotation (``view_as_complex(x) * freqs_cis``) on interleaved real pairs: x [B, S, H, D],
    tables [B, S, D] (each angle twice), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos[:, :, None, :] + rotated * sin[:, :, None, :]).to(x.dtype)


class _Attention:
    """``ZSingleStreamAttnProcessor`` with real rotary tables and an explicit key mask (softmax attention)."""

    def __init__(self) -> None:
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: torch.Tensor | None = None, freqs_cis: Any = None) -> torch.Tensor:
        query, key, value = (p(hidden_states).unflatten(-1, (attn.heads, -1)) for p in (attn.to_q, attn.to_k,
                                                                                         attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        cos, sin = freqs_cis
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        scores = torch.matmul(query.transpose(1, 2), key.permute(0, 2, 3, 1)) / float(query.shape[-1]) ** 0.5
        if attention_mask is not None:  # an fp32 key mask (the wrapper's own) added in a half export's dtype
            mask = attention_mask if attention_mask.dtype == scores.dtype else attention_mask.to(scores.dtype)
            scores = scores + mask[:, None, None, :]
        out = torch.matmul(torch.softmax(scores, dim=-1), value.transpose(1, 2)).transpose(1, 2).flatten(2, 3)
        return attn.to_out[0](out.to(query.dtype))


def _rope_table(dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RopeEmbedder.precompute_freqs_cis for one axis as (cos, sin) [length, dim], each angle twice."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    angles = np.outer(np.arange(length, dtype=np.float64), freqs).astype(np.float32)
    return (torch.from_numpy(np.repeat(np.cos(angles), 2, axis=1)),
            torch.from_numpy(np.repeat(np.sin(angles), 2, axis=1)))


class _Transformer(torch.nn.Module):
    """ZImageTransformer2DModel's basic-mode forward on fixed-size batched tensors (module docstring)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.attention = _Attention()
        cfg = model.config
        self.axis0 = int(cfg.axes_dims[0])
        cos, sin = _rope_table(self.axis0, int(cfg.axes_lens[0]), float(cfg.rope_theta))
        self.register_buffer("axis0_cos", cos, persistent=False)
        self.register_buffer("axis0_sin", sin, persistent=False)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor, image_index: torch.Tensor, image_pad: torch.Tensor,
                image_rope_cos: torch.Tensor, image_rope_sin: torch.Tensor, text_rope_cos: torch.Tensor,
                text_rope_sin: torch.Tensor) -> torch.Tensor:
        m = self.model
        b, c, h, w = hidden_states.shape
        adaln = m.t_embedder((1000 - timestep) / 1000 * m.t_scale).type_as(hidden_states)
        x = hidden_states.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1).reshape(b, -1, 4 * c)
        x = m.all_x_embedder["2-1"](x).index_select(1, image_index)
        pad = image_pad[None, :, None] > 0.5
        x = torch.where(pad, m.x_pad_token.to(x.dtype), x)
        # the caption's length rounded up to the padding multiple, per row; the image's first rope axis after it
        length = encoder_hidden_states_mask.sum(dim=1)
        padded = torch.ceil(length / SEQ_MULTI_OF) * SEQ_MULTI_OF
        first = (padded + 1).long()
        row_cos, row_sin = self.axis0_cos.index_select(0, first), self.axis0_sin.index_select(0, first)
        keep = 1.0 - image_pad[None, :, None]
        a0_cos = row_cos[:, None, :] * keep + (1.0 - keep)
        a0_sin = row_sin[:, None, :] * keep
        tokens = torch.ones_like(image_pad)[None, :, None]
        img_cos = torch.cat([a0_cos, image_rope_cos[None, :, self.axis0:] * tokens.expand(b, -1, -1)], dim=-1)
        img_sin = torch.cat([a0_sin, image_rope_sin[None, :, self.axis0:] * tokens.expand(b, -1, -1)], dim=-1)
        for layer in m.noise_refiner:
            x = layer(x, None, (img_cos, img_sin), adaln)
        positions = torch.arange(encoder_hidden_states.shape[1], device=hidden_states.device)[None, :].float()
        in_pad = (positions >= length[:, None]) & (positions < padded[:, None])
        cap = m.cap_embedder(encoder_hidden_states)
        cap = torch.where(in_pad[:, :, None], m.cap_pad_token.to(cap.dtype), cap)
        cap_mask = torch.where(positions < padded[:, None], 0.0, float("-inf"))
        t_cos = text_rope_cos[None].expand(b, -1, -1)
        t_sin = text_rope_sin[None].expand(b, -1, -1)
        for layer in m.context_refiner:
            cap = layer(cap, cap_mask, (t_cos, t_sin))
        unified = torch.cat([x, cap], dim=1)
        mask = torch.cat([torch.zeros_like(x[:, :, 0]), cap_mask], dim=1)
        freqs = (torch.cat([img_cos, t_cos], dim=1), torch.cat([img_sin, t_sin], dim=1))
        for layer in m.layers:
            unified = layer(unified, mask, freqs, adaln)
        out = m.all_final_layer["2-1"](unified, c=adaln)[:, : (h // 2) * (w // 2)]
        out = out.reshape(b, h // 2, w // 2, 2, 2, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h, w)
        return -out


def image_tables_example(h: int, w: int, text: int, axes: list[int]) -> tuple[torch.Tensor, ...]:
    from engines.pipelines.zimage import image_tables, text_tables

    tables = image_tables(h, w, axes, 256.0)
    text_cos, text_sin = text_tables(text, axes, 256.0)
    return (*(torch.from_numpy(t) for t in tables), torch.from_numpy(text_cos), torch.from_numpy(text_sin))


def _export_vae(vae: Any, out: Path, encoder: bool, dtype: str = "fp32") -> None:
    spatial = {0: "batch", 2: "height", 3: "width"}
    _export(with_io(VaeDecoderExport(vae), dtype), (torch.randn(1, int(vae.config.latent_channels), 4, 4),),
            out / "vae_decoder" / "model.onnx", ["latent_sample"], ["sample"],
            {"latent_sample": spatial, "sample": spatial})
    if encoder:
        _export(with_io(VaeEncoderExport(vae), dtype), (torch.randn(1, int(vae.config.in_channels), 32, 32),),
                out / "vae_encoder" / "model.onnx", ["sample"], ["latent_parameters"],
                {"sample": spatial, "latent_parameters": spatial})


def _export_transformer(transformer: Any, out: Path, dtype: str = "fp32") -> None:
    config = transformer.config
    if config.get("siglip_feat_dim") is not None:
        raise ValueError("the transformer has SigLIP features: Z-Image Omni, not Z-Image text-to-image")
    wrapper = _Transformer(transformer)
    attentions = [m for m in transformer.modules() if hasattr(m, "set_processor") and hasattr(m, "processor")]
    processors = [m.processor for m in attentions]
    for module in attentions:
        module.set_processor(wrapper.attention)
    try:
        h = w = 6  # 9 image tokens: padded to 32, so the padding is traced
        tables = image_tables_example(h, w, 40, list(config.axes_dims))
        mask = torch.zeros(1, 40)
        mask[:, :7] = 1.0
        args = (torch.randn(1, int(config.in_channels), h, w), torch.tensor([500.0]),
                torch.randn(1, 40, int(config.cap_feat_dim)), mask, *tables)
        names = ["hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_mask", "image_index",
                 "image_pad", "image_rope_cos", "image_rope_sin", "text_rope_cos", "text_rope_sin"]
        spatial = {0: "batch", 2: "height", 3: "width"}
        text = {0: "batch", 1: "text_tokens"}
        dynamic = {"hidden_states": spatial, "out_hidden_states": spatial, "timestep": {0: "batch"},
                   "encoder_hidden_states": text, "encoder_hidden_states_mask": text,
                   "image_index": {0: "image_tokens"}, "image_pad": {0: "image_tokens"},
                   "image_rope_cos": {0: "image_tokens"}, "image_rope_sin": {0: "image_tokens"},
                   "text_rope_cos": {0: "text_tokens"}, "text_rope_sin": {0: "text_tokens"}}
        _export(with_io(wrapper, dtype), args, out / "transformer" / "model.onnx", names, ["out_hidden_states"],
                dynamic)
    finally:
        for module, processor in zip(attentions, processors, strict=True):
            module.set_processor(processor)


def _export_text(model: Any, out: Path, dtype: str = "fp32") -> None:
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # grouped-query SDPA has no legacy-exporter symbolic
    try:
        seq = {0: "batch", 1: "sequence"}
        _export(with_io(_TextModel(model), dtype), (torch.zeros(1, 40, dtype=torch.int64),),
                out / "text_encoder" / "model.onnx", ["input_ids"], ["prompt_embeds"],
                {"input_ids": seq, "prompt_embeds": seq})
    finally:
        model.config._attn_implementation = attention


def export_zimage(components: dict[str, Any], tokenizer_dir: Path, out: Path, source: dict[str, Any],
                  vae_encoder: bool = True, native_size: int | None = None, dtype: str = "fp32") -> Path:
    """Export Z-Image's networks, the tokenizer and the scheduler config; model_index.json and the manifest.
    ``dtype``: fp32, or fp16/bf16 per engines/build/dit_folder.py ``half_plan`` (the networks cast in place)."""
    out.mkdir(parents=True, exist_ok=True)
    dtypes, source = apply_dtype(components, dtype, source)
    _export_text(components["text_encoder"], out, dtypes["text_encoder"])
    _export_transformer(components["transformer"], out, dtypes["transformer"])
    _export_vae(components["vae"], out, vae_encoder, dtypes["vae"])
    vaes = ["vae_decoder", "vae_encoder"] if vae_encoder else ["vae_decoder"]
    configs = {"text_encoder": config_of(components["text_encoder"]),
               "transformer": config_of(components["transformer"]),
               **dict.fromkeys(vaes, config_of(components["vae"]))}
    return write_folder(out, CLASS_NAME, configs, tokenizer_dir, components["scheduler"], source, native_size)


def export_zimage_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers ``ZImagePipeline`` folder in ``dtype`` (``export_zimage``); the networks load in
    their export dtype (half the memory of an fp32 load), the VAE in fp32 (cast after, by its config)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import AutoModel

    family, parts = load_diffusers(src, dtype, AutoModel, ZImageTransformer2DModel, AutoencoderKL)
    log.info("exporting %s (%s, %s) to %s", src, family.name, dtype, out)
    return export_zimage(parts, src / "tokenizer", out, {"kind": "diffusers-folder", "family": family.name,
                                                         "path_name": src.name}, dtype=dtype)


def save_zimage_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path) -> Path:
    """The same weights as a diffusers ``ZImagePipeline`` folder (parity tests, `sdserve engines export`)."""
    from diffusers import ZImagePipeline
    from transformers import Qwen2Tokenizer

    ZImagePipeline(**components, tokenizer=Qwen2Tokenizer.from_pretrained(tokenizer_dir)).save_pretrained(out)
    return out


def build_tiny_zimage(family: str, out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                      vae_encoder: bool = True, first_block: bool = False) -> Path:
    """Build the tiny ``family`` (z-image-turbo or z-image) and export it to ``out``; ``diffusers_out``: the same
    weights as a diffusers folder too."""
    if first_block:
        raise ValueError("the first-block cache's transformer parts are not exported for Z-Image")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        components = make_zimage_components(family, write_zimage_tokenizer(tokenizer_dir, bpe))
        export_zimage(components, tokenizer_dir, out, {"kind": "tiny", "family": family, "seed": SEED},
                      vae_encoder, native_size=TINY_NATIVE_SIZE)
        if diffusers_out is not None:
            save_zimage_diffusers(components, tokenizer_dir, diffusers_out)
    log.info("tiny %s model in %s", family, out)
    return out
