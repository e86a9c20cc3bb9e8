"""ONNX export of Qwen-Image (diffusers' ``QwenImagePipeline``): the tiny build of engines/build/qwen.py and local
diffusers folders (`sdserve engines export --from`). Build-time only: imports torch, diffusers, transformers.

Output layout (ONNX, legacy exporter, fp32)::

    text_encoder/ transformer/ vae_decoder/ [vae_encoder/]  model.onnx + config.json
    tokenizer/tokenizer.json  scheduler/scheduler_config.json  model_index.json (OnnxQwenImagePipeline)  manifest.json

- ``text_encoder``: the Qwen2.5-VL *language model* (what the pipeline reads: its last hidden state, after the final
  norm, is ``hidden_states[-1]``): ``input_ids`` [B, S] -> ``last_hidden_state`` [B, S, width]. No attention mask:
  its attention is causal, so right-padded rows give the valid tokens the states a masked run gives them (the
  serving pipeline reads only those). Traced with eager attention (grouped-query SDPA has no legacy symbolic).
- ``transformer``: ``hidden_states`` [B, image tokens, 64] (2×2-packed), ``encoder_hidden_states`` [B, T, width],
  ``encoder_hidden_states_mask`` [B, T] float (1 valid, 0 padding: the joint attention's key mask), ``timestep``
  [B] (t / 1000), ``rope_cos``/``rope_sin`` [T + image tokens, head_dim] fp32 -> ``out_hidden_states``. diffusers
  rotates q/k with complex tables (``torch.polar``, ``view_as_complex``: no ONNX); the same rotation on interleaved
  real pairs with host-computed tables (engines/pipelines/qwen.py ``qwen_rope``) is applied here to the
  joint (text, image) sequence, which equals rotating each stream before concatenating them.
- ``vae_decoder`` / ``vae_encoder``: ``AutoencoderKLQwenImage`` (a causal 3D VAE) used for single images: one
  frame, 4D at the graph's edges. Its per-channel normalisation is folded in: the decoder takes the transformer's
  latents and computes ``z / (1 / latents_std) + latents_mean`` first (as the pipeline does), the encoder gives
  the moments of the normalised latents (``(mean - latents_mean) / latents_std``; the log-variance clamped as the
  posterior does and shifted by ``-2 log latents_std``), so the serving pipeline's flow graphs run with scaling 1
  and shift 0. The decoder's output is clamped to [-1, 1] as ``_decode`` does.
- ``tokenizer/tokenizer.json``: the tokenizer as transformers builds it (vocab.json + merges.txt, Qwen2's split
  pattern, NFC, the added special tokens), so serving reads it with ``tokenizers`` alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engines.build.dit_folder import config_of, load_diffusers, write_folder
from engines.build.dit_folder import export_onnx as _export

log = logging.getLogger(__name__)
CLASS_NAME = "OnnxQwenImagePipeline"
"""model_index.json ``_class_name`` of an exported folder (engines/pipelines/flow_family.py QWEN_CLASSES)."""


class _TextModel(torch.nn.Module):
    """Qwen2.5-VL's language model: ``input_ids`` -> the last hidden state (the pipeline's ``hidden_states[-1]``)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, return_dict=False)[0]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen`` (complex pairs) on interleaved real pairs: x [B, S, H, D], tables [S, D]
    (each angle twice); written so the tracer keeps the batch and token counts dynamic."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos[None, :, None, :] + rotated.float() * sin[None, :, None, :]).to(x.dtype)


class _JointAttention:
    """``QwenDoubleStreamAttnProcessor2_0`` with the rotary tables given (``tables``: (cos, sin) over the joint
    text-then-image sequence) and torch's SDPA; everything else as diffusers computes it."""

    def __init__(self) -> None:
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 encoder_hidden_states_mask: torch.Tensor | None = None, attention_mask: Any = None,
                 image_rotary_emb: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None
        mask = None
        if encoder_hidden_states_mask is not None:
            image = torch.ones_like(hidden_states[..., 0], dtype=torch.bool)
            mask = torch.cat([encoder_hidden_states_mask, image], dim=1)[:, None, None, :]
        head = attn.inner_dim // attn.heads
        img = [p(hidden_states).unflatten(-1, (-1, head)) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(encoder_hidden_states).unflatten(-1, (-1, head))
               for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        for norm, streams, i in ((attn.norm_q, img, 0), (attn.norm_k, img, 1), (attn.norm_added_q, txt, 0),
                                 (attn.norm_added_k, txt, 1)):
            if norm is not None:
                streams[i] = norm(streams[i])
        cos, sin = self.tables
        query, key, value = (torch.cat([t, i], dim=1) for t, i in zip(txt, img, strict=True))
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        joint = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                               attn_mask=mask).transpose(1, 2).flatten(2, 3).to(query.dtype)
        seq_txt = encoder_hidden_states.shape[1]
        image_out = attn.to_out[0](joint[:, seq_txt:].contiguous())
        return image_out, attn.to_add_out(joint[:, :seq_txt].contiguous())


class _NoRope(torch.nn.Module):
    """Stands in for ``QwenEmbedRope`` during export: the tables arrive as graph inputs."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Transformer(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.attention = _JointAttention()

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, mask: torch.Tensor,
                timestep: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        self.attention.tables = (rope_cos, rope_sin)
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          encoder_hidden_states_mask=mask > 0.5, timestep=timestep, img_shapes=[(1, 1, 1)],
                          return_dict=False)[0]


class _Normalised(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        config = model.config
        self.register_buffer("mean", torch.tensor(config.latents_mean).view(1, -1, 1, 1))
        self.register_buffer("inv_std", 1.0 / torch.tensor(config.latents_std).view(1, -1, 1, 1))


class _VaeDecoder(_Normalised):
    """Normalised latents [B, 16, h, w] -> the image [B, 3, H, W] in [-1, 1], one frame."""

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        z = latent_sample / self.inv_std + self.mean
        return self.model.decode(z[:, :, None], return_dict=False)[0][:, :, 0]


class _VaeEncoder(_Normalised):
    """Image [B, 3, H, W] in [-1, 1] -> the moments (mean, log-variance) of the normalised latents, one frame."""

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        moments = self.model.encode(sample[:, :, None]).latent_dist.parameters[:, :, 0]
        mean, logvar = torch.chunk(moments, 2, dim=1)
        logvar = torch.clamp(logvar, -30.0, 20.0) + 2.0 * torch.log(self.inv_std)
        return torch.cat([(mean - self.mean) * self.inv_std, logvar], dim=1)


def _export_text(model: Any, out: Path) -> None:
    language = model.model.language_model if hasattr(model, "model") else model
    attention = language.config._attn_implementation
    language.config._attn_implementation = "eager"  # grouped-query SDPA has no legacy-exporter symbolic
    try:
        seq = {0: "batch", 1: "sequence"}
        _export(_TextModel(language), (torch.zeros(1, 40, dtype=torch.int64),), out / "text_encoder" / "model.onnx",
                ["input_ids"], ["last_hidden_state"], {"input_ids": seq, "last_hidden_state": seq})
    finally:
        language.config._attn_implementation = attention


def check_transformer(config: Any) -> None:
    """ValueError for a transformer of a Qwen-Image variant this export does not take (Edit 2511, Layered)."""
    variant = [k for k in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
               if config.get(k)]
    if variant:
        raise ValueError(f"the transformer sets {', '.join(variant)}: a Qwen-Image variant (Edit/Layered), not "
                         "Qwen-Image text-to-image")


def _export_transformer(transformer: Any, out: Path) -> None:
    config = transformer.config
    check_transformer(dict(config))
    wrapper = _Transformer(transformer)
    head = int(config.attention_head_dim)
    processors = transformer.attn_processors
    original = transformer.pos_embed
    transformer.set_attn_processor(wrapper.attention)
    transformer.pos_embed = _NoRope()
    try:
        args = (torch.randn(1, 16, int(config.in_channels)), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.ones(1, 8), torch.tensor([0.5]), torch.randn(24, head), torch.randn(24, head))
        names = ["hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "rope_cos",
                 "rope_sin"]
        text = {0: "batch", 1: "text_tokens"}
        dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"}, "encoder_hidden_states": text,
                   "encoder_hidden_states_mask": text, "timestep": {0: "batch"}, "rope_cos": {0: "tokens"},
                   "rope_sin": {0: "tokens"}, "out_hidden_states": {0: "batch", 1: "image_tokens"}}
        _export(wrapper, args, out / "transformer" / "model.onnx", names, ["out_hidden_states"], dynamic)
    finally:
        transformer.pos_embed = original
        transformer.set_attn_processor(processors)


def _nearest(vae: Any) -> list[Any]:
    """Its 2x "nearest-exact" upsamplers switched to "nearest" (no legacy symbolic for the former; at an integer
    factor of 2 both pick source pixel floor(i / 2)); returns them, to switch back."""
    switched = [m for m in vae.modules() if isinstance(m, torch.nn.Upsample) and m.mode == "nearest-exact"]
    if any(m.scale_factor not in (2.0, (2.0, 2.0)) for m in switched):
        raise ValueError("the VAE upsamples by another factor than 2: nearest-exact is not nearest there")
    for module in switched:
        module.mode = "nearest"
    return switched


def _export_vae(vae: Any, out: Path, encoder: bool) -> None:
    spatial = {0: "batch", 2: "height", 3: "width"}
    switched = _nearest(vae)
    try:
        _export_vae_parts(vae, out, encoder, spatial)
    finally:
        for module in switched:
            module.mode = "nearest-exact"


def _export_vae_parts(vae: Any, out: Path, encoder: bool, spatial: dict[int, str]) -> None:
    _export(_VaeDecoder(vae), (torch.randn(1, int(vae.config.z_dim), 4, 4),), out / "vae_decoder" / "model.onnx",
            ["latent_sample"], ["sample"], {"latent_sample": spatial, "sample": spatial})
    if encoder:
        _export(_VaeEncoder(vae), (torch.randn(1, 3, 32, 32),), out / "vae_encoder" / "model.onnx", ["sample"],
                ["latent_parameters"], {"sample": spatial, "latent_parameters": spatial})


def export_qwen(components: dict[str, Any], tokenizer_dir: Path, out: Path, source: dict[str, Any],
                vae_encoder: bool = True, native_size: int | None = None) -> Path:
    """Export Qwen-Image's networks, the tokenizer and the scheduler config; write model_index.json
    (``OnnxQwenImagePipeline``) and the manifest. ``vae_encoder``: also the VAE encoder (img2img)."""
    out.mkdir(parents=True, exist_ok=True)
    _export_text(components["text_encoder"], out)
    _export_transformer(components["transformer"], out)
    _export_vae(components["vae"], out, vae_encoder)
    text = components["text_encoder"].config
    vaes = ["vae_decoder", "vae_encoder"] if vae_encoder else ["vae_decoder"]
    configs = {"text_encoder": getattr(text, "text_config", text).to_dict(),
               "transformer": config_of(components["transformer"]),
               **dict.fromkeys(vaes, config_of(components["vae"]))}  # latents_mean/std folded in (module docstring)
    return write_folder(out, CLASS_NAME, configs, tokenizer_dir, components["scheduler"], source, native_size)


def export_qwen_folder(src: Path, out: Path) -> Path:
    """Export a local diffusers ``QwenImagePipeline`` folder (fp32); ModelLoadError for a refused variant (Edit,
    Layered, ControlNet) or an sdserve ONNX folder."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    family, parts = load_diffusers(src, "fp32", Qwen2_5_VLForConditionalGeneration, QwenImageTransformer2DModel,
                                   AutoencoderKLQwenImage)
    log.info("exporting %s (%s) to %s", src, family.name, out)
    return export_qwen(parts, src / "tokenizer", out, {"kind": "diffusers-folder", "family": family.name,
                                                       "path_name": src.name})
