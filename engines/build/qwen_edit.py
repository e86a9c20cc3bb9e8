"""Qwen-Image-Edit-Plus (diffusers' ``QwenImageEditPlusPipeline``, 0.42; the 2509 and 2511 configurations): the tiny
faithful model and its ONNX export. Build-time only: imports torch, diffusers and transformers.

The networks are Qwen-Image's (engines/build/qwen.py: the transformer, the VAE, the scheduler, the tokenizer's BPE),
plus what an edit uses of the Qwen2.5-VL text encoder that Qwen-Image leaves idle:

- the vision tower (``Qwen2_5_VisionTransformerPretrainedModel``, real patch 14, temporal patch 2, spatial merge 2,
  window 112 with windowed and full-attention blocks, as the released one; narrow and two blocks deep);
- the tokenizer's vision specials (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``) after the chat ones,
  and a ``Qwen2VLProcessor`` (the Qwen2-VL image processor with the released pixel bounds) in ``processor/``.

Exported (beside Qwen-Image's transformer/ and vae halves, engines/build/qwen_export.py)::

    vision/model.onnx        pixel_values [N, 1176] (the processor's patches of one image), window_index [N/4],
                             rope_cos/rope_sin [N, head] (window-ordered), window_mask [N, N] (additive: 0 inside a
                             window, -inf across) -> image_embeds [N/4, width] (merged, back in raster order)
    text_encoder/model.onnx  input_ids [B, S], image_embeds [M, width], position_ids [3, B, S] -> last_hidden_state:
                             the embedding of every ``<|image_pad|>`` replaced by the next image embedding, in
                             order (``masked_scatter``), then the language model at the given M-RoPE positions

The vision tower's host side (patches, rotary angles, window order, masks) is engines/pipelines/qwen_edit.py's.

2511 is the same pipeline with its transformer's ``zero_cond_t`` set: the noisy tokens are modulated at the step's
timestep, the reference tokens after them at timestep 0 (diffusers doubles the timestep batch, ``[t, 0]``, and picks
each token's shift/scale/gate by ``modulate_index``: 0 noisy, 1 reference; the text stream and the output norm take
``t``). Its export takes one more input, ``modulate_index`` [image tokens] int64 (the noisy ones 0, the reference
ones 1: engines/pipelines/qwen_edit.py feeds it when the graph has it), handed to every block.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines.build.qwen import SCHEDULER, SEED, TEXT, TINY_NATIVE_SIZE, TRANSFORMER, VAE, train_vocab
from engines.pipelines.qwen_edit import MODULATE_INDEX

log = logging.getLogger(__name__)
CLASS_NAME = "OnnxQwenImageEditPlusPipeline"
"""model_index.json ``_class_name`` of an exported folder."""
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
VISION = dict(depth=2, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=TEXT["hidden_size"],
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1],
              tokens_per_second=2)
PIXELS = dict(min_pixels=3136, max_pixels=12845056)
"""Qwen/Qwen-Image-Edit-2509's processor/preprocessor_config.json pixel bounds."""


def write_edit_tokenizer(out: Path, bpe: Path | None = None) -> dict[str, int]:
    """The tokenizer (Qwen-Image's BPE, the chat specials, then the vision specials) and the processor folder;
    returns the special tokens' ids and ``vocab`` (the vocabulary's size)."""
    from transformers import AddedToken, Qwen2Tokenizer, Qwen2VLImageProcessorPil

    vocab, merges = train_vocab(bpe)
    for token in VISION_SPECIALS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False)
                          for t in ("<|im_start|>", "<|im_end|>", *VISION_SPECIALS)])
    tokenizer.model_max_length = 32768
    tokenizer.save_pretrained(out / "tokenizer")
    Qwen2VLImageProcessorPil(**PIXELS).save_pretrained(out / "processor")
    return {"vocab": len(vocab), **{t: vocab[t] for t in ("<|endoftext|>", "<|im_end|>", *VISION_SPECIALS)}}


def make_edit_components(ids: dict[str, int], seed: int = SEED, zero_cond_t: bool = False) -> dict[str, Any]:
    """The networks and scheduler of the tiny Qwen-Image-Edit-Plus, each module from its own seed (the transformer,
    VAE and scheduler as the tiny Qwen-Image's); ``zero_cond_t``: the 2511 transformer (the same weights)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rows = -(-ids["vocab"] // 64) * 64
    special = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
               "pad_token_id": ids["<|endoftext|>"]}
    config = Qwen2_5_VLConfig(text_config={**TEXT, "vocab_size": rows, **special}, vision_config=VISION,
                              vocab_size=rows, image_token_id=ids["<|image_pad|>"],
                              vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], **special)
    def seeded(offset: int, make: Any) -> Any:
        torch.manual_seed(seed + offset)
        return make().eval()

    return {
        "text_encoder": seeded(0, lambda: Qwen2_5_VLForConditionalGeneration(config)),
        "transformer": seeded(1, lambda: QwenImageTransformer2DModel(**TRANSFORMER, zero_cond_t=zero_cond_t)),
        "vae": seeded(2, lambda: AutoencoderKLQwenImage(**VAE)),
        "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER),
    }


def edit_processor(folder: Path) -> Any:
    """The ``Qwen2VLProcessor`` of ``folder`` (tokenizer/, processor/) without a video processor: transformers
    builds that one on torchvision, which sdserve does not install; diffusers' pipeline never calls it."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessorPil, Qwen2VLProcessor

    class _ImagesOnly(Qwen2VLProcessor):  # type: ignore[misc]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return _ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder / "processor"),
                       tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer"))


def edit_pipeline(components: dict[str, Any], folder: Path) -> Any:
    """diffusers' ``QwenImageEditPlusPipeline`` on the same weights (in memory: the parity reference)."""
    from diffusers import QwenImageEditPlusPipeline

    processor = edit_processor(folder)
    return QwenImageEditPlusPipeline(**components, tokenizer=processor.tokenizer, processor=processor)


class _Vision(torch.nn.Module):
    """The vision tower with its host-side inputs given (no ``grid_thw`` loops in the graph)."""

    def __init__(self, tower: Any) -> None:
        super().__init__()
        self.tower = tower

    def forward(self, pixel_values: torch.Tensor, window_index: torch.Tensor, rope_cos: torch.Tensor,
                rope_sin: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
        tower = self.tower
        unit = tower.spatial_merge_unit
        x = tower.patch_embed(pixel_values)
        x = x.reshape(-1, unit, x.shape[-1])[window_index].flatten(0, 1)
        cos, sin = rope_cos[:, None, :], rope_sin[:, None, :]
        for i, block in enumerate(tower.blocks):
            attn = block.attn
            q, k, v = attn.qkv(block.norm1(x)).unflatten(-1, (3, attn.num_heads, -1)).unbind(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            mask = None if i in tower.fullatt_block_indexes else window_mask
            out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                   v.transpose(0, 1), attn_mask=mask)
            x = x + attn.proj(out.transpose(0, 1).flatten(1))
            x = x + block.mlp(block.norm2(x))
        merged = tower.merger(x)
        return merged[torch.argsort(window_index)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _Text(torch.nn.Module):
    """``input_ids`` with the image embeddings scattered over the image tokens -> the last hidden state."""

    def __init__(self, language: Any, embed: Any, image_token: int) -> None:
        super().__init__()
        self.language, self.embed, self.image_token = language, embed, image_token

    def forward(self, input_ids: torch.Tensor, image_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(input_ids)
        is_image = (input_ids == self.image_token).flatten()
        order = (torch.cumsum(is_image.to(torch.int64), 0) - 1).clamp(min=0)
        scattered = image_embeds[order].reshape(embeds.shape)
        embeds = torch.where(is_image.reshape(input_ids.shape)[..., None], scattered, embeds)
        return self.language(inputs_embeds=embeds, position_ids=position_ids, return_dict=False)[0]


def _export_vision(model: Any, out: Path) -> None:
    from engines.build.dit_folder import export_onnx

    tower = model.model.visual
    head = tower.config.hidden_size // tower.config.num_heads
    n = 64
    args = (torch.randn(n, 3 * 2 * 14 * 14), torch.arange(n // 4), torch.randn(n, head), torch.randn(n, head),
            torch.zeros(n, n))
    names = ["pixel_values", "window_index", "rope_cos", "rope_sin", "window_mask"]
    dynamic = {"pixel_values": {0: "patches"}, "window_index": {0: "merged"}, "rope_cos": {0: "patches"},
               "rope_sin": {0: "patches"}, "window_mask": {0: "patches", 1: "patches_k"},
               "image_embeds": {0: "merged"}}
    export_onnx(_Vision(tower), args, out / "vision" / "model.onnx", names, ["image_embeds"], dynamic)


def _export_text(model: Any, out: Path) -> None:
    from engines.build.dit_folder import export_onnx

    language = model.model.language_model
    attention = language.config._attn_implementation
    language.config._attn_implementation = "eager"  # grouped-query SDPA has no legacy-exporter symbolic
    try:
        wrapper = _Text(language, language.embed_tokens, int(model.config.image_token_id))
        ids = torch.zeros(1, 40, dtype=torch.int64)
        ids[0, 5:9] = int(model.config.image_token_id)
        positions = torch.arange(40)[None, None].expand(3, 1, 40).contiguous()
        seq = {0: "batch", 1: "sequence"}
        export_onnx(wrapper, (ids, torch.randn(4, language.config.hidden_size), positions),
                    out / "text_encoder" / "model.onnx", ["input_ids", "image_embeds", "position_ids"],
                    ["last_hidden_state"], {"input_ids": seq, "image_embeds": {0: "image_tokens"},
                                            "position_ids": {1: "batch", 2: "sequence"}, "last_hidden_state": seq})
    finally:
        language.config._attn_implementation = attention


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by the tables [S, D] (each angle twice, interleaved pairs: diffusers' complex rotation
    ``apply_rotary_emb_qwen`` in real arithmetic)."""
    pairs = x.unflatten(-1, (-1, 2))
    swapped = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos[None, :, None, :] + swapped.float() * sin[None, :, None, :]).to(x.dtype)


class _TableAttention:
    """A Qwen-Image block's joint attention (``QwenDoubleStreamAttnProcessor2_0``: text then image tokens, the text
    key mask) with the rotary tables given over the joint sequence (``tables``) and torch's SDPA."""

    def __init__(self) -> None:
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: Any = None,
                 image_rotary_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None
        head = attn.inner_dim // attn.heads

        def joint(text: Any, image: Any, text_norm: Any = None, image_norm: Any = None) -> torch.Tensor:
            t, i = text(encoder_hidden_states).unflatten(-1, (-1, head)), image(hidden_states).unflatten(-1, (-1, head))
            t, i = text_norm(t) if text_norm is not None else t, image_norm(i) if image_norm is not None else i
            return torch.cat([t, i], dim=1)

        cos, sin = self.tables
        query = _turn(joint(attn.add_q_proj, attn.to_q, attn.norm_added_q, attn.norm_q), cos, sin)
        key = _turn(joint(attn.add_k_proj, attn.to_k, attn.norm_added_k, attn.norm_k), cos, sin)
        value = joint(attn.add_v_proj, attn.to_v)
        mask = None
        if encoder_hidden_states_mask is not None:
            image = torch.ones_like(hidden_states[..., 0], dtype=torch.bool)
            mask = torch.cat([encoder_hidden_states_mask, image], dim=1)[:, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2),
                                                               value.transpose(1, 2), attn_mask=mask)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        text = encoder_hidden_states.shape[1]
        return attn.to_out[0](out[:, text:].contiguous()), attn.to_add_out(out[:, :text].contiguous())


class _NoTables(torch.nn.Module):
    """Stands in for ``QwenEmbedRope`` during export: the tables are graph inputs."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class _ZeroCond(torch.nn.Module):
    """The 2511 transformer (``zero_cond_t``): diffusers' forward with the tables and ``modulate_index`` as inputs
    (every block handed the index by a pre-hook, in place of the one diffusers builds from ``img_shapes``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model, self.attention = model, _TableAttention()
        self.index: torch.Tensor | None = None

    def given_index(self, module: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return args, {**kwargs, "modulate_index": self.index}

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, mask: torch.Tensor,
                timestep: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                modulate_index: torch.Tensor) -> torch.Tensor:
        self.attention.tables, self.index = (rope_cos, rope_sin), modulate_index[None]
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          encoder_hidden_states_mask=mask > 0.5, timestep=timestep, img_shapes=[[(1, 1, 1)]],
                          return_dict=False)[0]


def _export_zero_cond(transformer: Any, out: Path) -> None:
    """transformer/model.onnx of a 2511 transformer: Qwen-Image's inputs (engines/build/qwen_export.py) and
    ``modulate_index``."""
    from engines.build.dit_folder import export_onnx

    config = transformer.config
    wrapper = _ZeroCond(transformer)
    processors, original = transformer.attn_processors, transformer.pos_embed
    transformer.set_attn_processor(wrapper.attention)
    transformer.pos_embed = _NoTables()
    hooks = [block.register_forward_pre_hook(wrapper.given_index, with_kwargs=True)
             for block in transformer.transformer_blocks]
    try:
        head, tokens = int(config.attention_head_dim), 16
        args = (torch.randn(1, tokens, int(config.in_channels)), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.ones(1, 8), torch.tensor([0.5]), torch.randn(8 + tokens, head), torch.randn(8 + tokens, head),
                (torch.arange(tokens) >= tokens // 2).to(torch.int64))
        names = ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "rope_cos",
                 "rope_sin", MODULATE_INDEX]
        text = {0: "batch", 1: "text_tokens"}
        dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": text,
                   "encoder_hidden_states_mask": text, "timestep": {0: "batch"}, "rope_cos": {0: "tokens"},
                   "rope_sin": {0: "tokens"}, MODULATE_INDEX: {0: "image_tokens"},
                   "out_hidden_states": {0: "batch", 1: "image_tokens"}}
        export_onnx(wrapper, args, out / "transformer" / "model.onnx", names, ["out_hidden_states"], dynamic)
    finally:
        for hook in hooks:
            hook.remove()
        transformer.pos_embed = original
        transformer.set_attn_processor(processors)


def _without_zero_cond(transformer: Any) -> Any:
    """The same weights in a transformer without ``zero_cond_t`` (what Qwen-Image's export takes; its transformer
    graph is then replaced by ``_export_zero_cond``'s)."""
    plain = type(transformer).from_config({**dict(transformer.config), "zero_cond_t": False}).eval()
    plain.load_state_dict(transformer.state_dict(), assign=True)
    return plain


def export_edit(components: dict[str, Any], folder: Path, out: Path, source: dict[str, Any],
                native_size: int | None = None) -> Path:
    """Qwen-Image's export (transformer, VAE halves, scheduler, tokenizer: engines/build/qwen_export.py) with the
    edit text encoder in place of Qwen-Image's, the vision tower and the processor's config; model_index.json names
    ``OnnxQwenImageEditPlusPipeline`` and the manifest is written again over the whole folder. A 2511 transformer
    (``zero_cond_t``) is exported by ``_export_zero_cond`` in place of Qwen-Image's graph."""
    from engines.build.dit_folder import config_of, write_json
    from engines.build.export import write_manifest
    from engines.build.qwen_export import export_qwen

    transformer = components["transformer"]
    zero_cond = bool(transformer.config.get("zero_cond_t"))
    base = {**components, "transformer": _without_zero_cond(transformer)} if zero_cond else components
    export_qwen(base, folder / "tokenizer", out, source, True, native_size)
    if zero_cond:
        shutil.rmtree(out / "transformer")
        _export_zero_cond(transformer, out)
        write_json(out / "transformer" / "config.json", config_of(transformer))
    shutil.rmtree(out / "text_encoder")
    text = components["text_encoder"]
    _export_text(text, out)
    _export_vision(text, out)
    write_json(out / "text_encoder" / "config.json",
               {**text.config.text_config.to_dict(), "image_token_id": text.config.image_token_id})
    write_json(out / "vision" / "config.json", text.config.vision_config.to_dict())
    processor = json.loads((folder / "processor" / "preprocessor_config.json").read_text(encoding="utf-8"))
    write_json(out / "processor" / "preprocessor_config.json", processor)
    index = json.loads((out / "model_index.json").read_text(encoding="utf-8"))
    write_json(out / "model_index.json", {**index, "_class_name": CLASS_NAME, "vision": index["text_encoder"]})
    write_manifest(out, source)
    return out


def build_tiny_qwen_edit(out: Path, bpe: Path | None = None, reference: bool = False,
                         zero_cond_t: bool = False) -> Any:
    """Build the tiny Qwen-Image-Edit-Plus and export it to ``out``; ``reference``: return diffusers'
    pipeline on the same weights (else ``out``); ``zero_cond_t``: the 2511 configuration (else 2509)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        components = make_edit_components(write_edit_tokenizer(folder, bpe), zero_cond_t=zero_cond_t)
        source = {"kind": "tiny", "family": "qwen-image-edit", "seed": SEED, **({"zero_cond_t": True} if zero_cond_t
                                                                                 else {})}
        export_edit(components, folder, out, source, native_size=TINY_NATIVE_SIZE)
        pipe = edit_pipeline(components, folder) if reference else None
    log.info("tiny qwen-image-edit model in %s", out)
    return pipe if reference else out
