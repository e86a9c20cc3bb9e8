"""FLUX.2 [klein] (diffusers' ``Flux2KleinPipeline``, 0.42): a tiny faithful model built offline from a fixed seed,
and the ONNX export of it and of local diffusers folders (`sdserve engines export --from`). Build-time only: imports
torch, diffusers and transformers.

The tiny model keeps the released structure in miniature:

- the text encoder is a ``Qwen3ForCausalLM`` with grouped-query attention and QK norms, 28 layers deep so the
  pipeline's hidden-state layers (9, 18, 27) exist and none of them is the final-normed last state, as in the 4B/9B
  encoders (36 layers); its tokenizer is a byte-level BPE with Qwen2's pre-tokenizer (engines/build/qwen.py
  ``train_vocab``) plus ``<think>``/``</think>`` and a chat template that renders the one-user-turn prompt with
  ``enable_thinking=False`` as Qwen3's does;
- the transformer is ``Flux2Transformer2DModel`` with the real 128 input channels (32 latent channels, 2×2-patched
  by the VAE's batch-norm layout), 4 rotary axes (T, H, W, L) and no guidance embedding (klein's);
- the VAE is ``AutoencoderKLFlux2`` with 4 levels (scale factor 8), 32 latent channels and batch-norm statistics
  drawn from the seed (not the identity), so the pipeline's normalisation is exercised;
- the scheduler is the released one (dynamic, exponential shift; the pipeline gives ``mu`` empirically).

Exported layout (ONNX, legacy exporter; fp32, or fp16/bf16 behind fp32 inputs and outputs: engines/build/dit_folder.py
``half_plan``; weights in model.onnx.data past 2 GB)::

    text_encoder/ transformer/ vae_decoder/  model.onnx + config.json
    tokenizer/tokenizer.json  scheduler/scheduler_config.json  model_index.json (OnnxFlux2KleinPipeline)  manifest.json

- ``text_encoder``: ``input_ids``, ``attention_mask`` [B, S] -> ``prompt_embeds`` [B, S, 3 × width]: the hidden
  states of ``HIDDEN_LAYERS`` stacked per token, as ``_get_qwen3_prompt_embeds`` does (every position, padding
  included: the transformer attends to all of them, unmasked).
- ``transformer``: ``hidden_states`` [B, 128, h, w] (the patchified latents as an image: flattened to tokens inside
  the graph and back, so the serving loop runs it unpacked), ``encoder_hidden_states`` [B, S, 3 × width],
  ``timestep`` [B] (t / 1000), ``rope_cos``/``rope_sin`` [S + h·w, head_dim] (engines/pipelines/flux2.py computes
  them on the host from the position ids as ``Flux2PosEmbed`` does) -> ``out_hidden_states`` [B, 128, h, w].
- ``vae_decoder``: normalised patchified latents [B, 128, h, w] -> the image [B, 3, 16h, 16w]: the batch-norm
  de-normalisation (``x · sqrt(var + eps) + mean``) and the 2×2 unpatchify are folded in, so the serving decode graph
  scales by 1.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.build.dit_export import apply_dtype
from engines.build.dit_folder import config_of, export_onnx, load_diffusers, with_io, write_folder

log = logging.getLogger(__name__)
SEED = 0
CLASS_NAME = "OnnxFlux2KleinPipeline"
"""model_index.json ``_class_name`` of an exported folder (its registry row claims it)."""
HIDDEN_LAYERS = (9, 18, 27)
"""``Flux2KleinPipeline``'s ``text_encoder_out_layers`` default: the hidden states the transformer reads."""
THINK = ("<think>", "</think>")
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                 "{% endif %}{% endif %}")
"""What Qwen3's chat template renders for one user turn (no tools, no system turn)."""
TEXT_WIDTH = 16
TEXT = dict(hidden_size=TEXT_WIDTH, intermediate_size=24, num_hidden_layers=28, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, rope_theta=1000000.0,
            tie_word_embeddings=True)
TRANSFORMER = dict(patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=len(HIDDEN_LAYERS) * TEXT_WIDTH,
                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000,
                   guidance_embeds=False)
VAE = dict(block_out_channels=(16, 32, 32, 32), layers_per_block=1, latent_channels=32, norm_num_groups=8,
           sample_size=64)
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                 base_image_seq_len=256, max_image_seq_len=4096, time_shift_type="exponential")
"""FLUX.2 [klein]'s scheduler_config.json."""
TINY_NATIVE_SIZE = 64


def export_rms(module: torch.nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
            outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    """Legacy-exporter ONNX of ``module``, its ``torch.nn.RMSNorm`` layers written as plain ops meanwhile (the
    legacy exporter has no ``aten::rms_norm`` symbolic)."""
    norms = [m for m in module.modules() if isinstance(m, torch.nn.RMSNorm)]
    for norm in norms:
        norm.forward = functools.partial(_rms_norm, norm)  # type: ignore[method-assign]
    try:
        export_onnx(module, args, path, inputs, outputs, dynamic)
    finally:
        for norm in norms:
            del norm.forward


def _rms_norm(norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """``torch.nn.RMSNorm`` in fp32: x / sqrt(mean(x², last dims) + eps) · weight (eps: fp32's machine epsilon when
    unset, as torch takes it)."""
    dims = tuple(range(-len(norm.normalized_shape), 0))
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    half = x.dtype if x.dtype != torch.float32 else None  # computed in fp32 and cast back, as torch's rms_norm does
    x = x.float() if half is not None else x
    out = x * torch.rsqrt(x.pow(2).mean(dim=dims, keepdim=True) + eps)
    out = out * (norm.weight.float() if half is not None else norm.weight) if norm.weight is not None else out
    return out.to(half) if half is not None else out


def _rotary(x: torch.Tensor, freqs_cis: tuple[torch.Tensor, torch.Tensor], use_real: bool = True,
            use_real_unbind_dim: int = -1, sequence_dim: int = 1) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` as FLUX.2 calls it (real tables, interleaved pairs, tokens on axis 1) with
    the pairs split by ``unflatten``: its ``reshape(*x.shape[:-1], -1, 2)`` would freeze the traced token count."""
    cos, sin = (t[None, :, None, :] for t in freqs_cis)
    pairs = x.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(3)
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


# --- the tiny model ---------------------------------------------------------------------------------------------

def write_flux2_tokenizer(out: Path, bpe: Path | None = None) -> int:
    """The Qwen3-style tokenizer folder (tokenizer.json, the chat template); returns the vocabulary's size."""
    from transformers import AddedToken, Qwen2Tokenizer

    from engines.build.qwen import SPECIALS, train_vocab

    vocab, merges = train_vocab(bpe)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[1:]])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tokenizer.model_max_length = 40960
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return len(vocab) + len(THINK)


def tiny_transformer_and_vae(config: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The tiny FLUX.2 transformer (``config``: klein's ``TRANSFORMER`` or dev's, with its guidance embedding) and VAE
    from ``seed`` + 1 and + 2, the VAE's batch-norm statistics as a trained VAE has them, not the identity."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    torch.manual_seed(seed + 1)
    transformer = Flux2Transformer2DModel(**config).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLFlux2(**VAE).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn_like(vae.bn.running_mean) * 0.5)
        vae.bn.running_var.copy_(torch.rand_like(vae.bn.running_var) + 0.5)
    return transformer, vae


def make_flux2_components(vocab_size: int, distilled: bool, seed: int = SEED) -> dict[str, Any]:
    """The networks and scheduler of the tiny FLUX.2 [klein], each module from its own seed."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**TEXT, vocab_size=-(-vocab_size // 64) * 64, pad_token_id=vocab_size - 5,
                         eos_token_id=vocab_size - 3)
    torch.manual_seed(seed)
    text = Qwen3ForCausalLM(config).eval()
    transformer, vae = tiny_transformer_and_vae(TRANSFORMER, seed)
    return {"text_encoder": text, "transformer": transformer, "vae": vae,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER), "is_distilled": distilled}


def save_flux2_diffusers(components: dict[str, Any], tokenizer_dir: Path, out: Path) -> Path:
    """The same weights as a diffusers ``Flux2KleinPipeline`` folder (parity tests, `sdserve engines export`)."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen2TokenizerFast

    Flux2KleinPipeline(**components, tokenizer=Qwen2TokenizerFast.from_pretrained(tokenizer_dir)).save_pretrained(out)
    return out


def build_tiny_flux2(out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                     distilled: bool = True) -> Path:
    """Build the tiny FLUX.2 [klein] (``distilled``: the few-step checkpoint, no CFG; else the base one) and export
    it to ``out``; ``diffusers_out``: the same weights as a diffusers folder too."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        components = make_flux2_components(write_flux2_tokenizer(tokenizer_dir, bpe), distilled)
        family = "flux2-klein" if distilled else "flux2-klein-base"
        export_flux2(components, tokenizer_dir, out, {"kind": "tiny", "family": family, "seed": SEED},
                     native_size=TINY_NATIVE_SIZE)
        if diffusers_out is not None:
            save_flux2_diffusers(components, tokenizer_dir, diffusers_out)
    log.info("tiny FLUX.2 [klein] model in %s", out)
    return out


# --- the export -------------------------------------------------------------------------------------------------

class _TextStates(torch.nn.Module):
    """Qwen3's hidden states at ``HIDDEN_LAYERS``, stacked per token: [B, S, layers × width]."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                         use_cache=False)
        states = torch.stack([out.hidden_states[k] for k in HIDDEN_LAYERS], dim=2)
        return states.flatten(2)


class _Tables(torch.nn.Module):
    """Stands in for ``Flux2PosEmbed`` during export: the joint (text, image) tables arrive as graph inputs; the
    image call gets them whole, the text call (zero ids) an empty slice, so their concatenation is the tables."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.tables is not None
        cos, sin = self.tables
        return (cos, sin) if ids.shape[0] else (cos[:0], sin[:0])


class _Transformer(torch.nn.Module):
    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.tables = _Tables()

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                rope_cos: torch.Tensor, rope_sin: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        self.tables.tables = (rope_cos, rope_sin)
        tokens = hidden_states.flatten(2).transpose(1, 2)
        marker = torch.zeros(1, 4)
        out = self.model(hidden_states=tokens, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                         guidance=guidance, img_ids=marker, txt_ids=marker[:0], return_dict=False)[0]
        return out.transpose(1, 2).reshape(hidden_states.shape)


class _VaeDecoder(torch.nn.Module):
    """Normalised patchified latents [B, 4C, h, w] -> the image [B, 3, 16h, 16w] (batch-norm undone, unpatchified)."""

    def __init__(self, vae: Any) -> None:
        super().__init__()
        self.vae = vae
        self.register_buffer("mean", vae.bn.running_mean.detach().clone().view(1, -1, 1, 1))
        self.register_buffer("std", torch.sqrt(vae.bn.running_var.detach().view(1, -1, 1, 1)
                                               + vae.config.batch_norm_eps))

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        z = latent_sample * self.std + self.mean
        b, c, h, w = z.shape
        z = z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)
        return self.vae.decode(z, return_dict=False)[0]


def _export_text(model: Any, out: Path, dtype: str = "fp32") -> None:
    base = model.model if hasattr(model, "model") else model
    attention = base.config._attn_implementation
    base.config._attn_implementation = "eager"  # grouped-query SDPA has no legacy-exporter symbolic
    try:
        seq = {0: "batch", 1: "sequence"}
        mask = torch.ones(2, 12, dtype=torch.int64)
        mask[1, 7:] = 0
        export_rms(with_io(_TextStates(base), dtype), (torch.zeros(2, 12, dtype=torch.int64), mask),
                out / "text_encoder" / "model.onnx", ["input_ids", "attention_mask"], ["prompt_embeds"],
                {"input_ids": seq, "attention_mask": seq, "prompt_embeds": seq})
    finally:
        base.config._attn_implementation = attention


def _export_transformer(transformer: Any, out: Path, dtype: str = "fp32") -> None:
    """The transformer with the tables given and diffusers' rotation traced with dynamic token counts
    (``_rotary``)."""
    from diffusers.models.transformers import transformer_flux2

    config = transformer.config
    wrapper = _Transformer(transformer)
    original, rotary = transformer.pos_embed, transformer_flux2.apply_rotary_emb
    transformer.pos_embed, transformer_flux2.apply_rotary_emb = wrapper.tables, _rotary
    try:
        head = int(config.attention_head_dim)
        args = (torch.randn(1, int(config.in_channels), 2, 3), torch.randn(1, 8, int(config.joint_attention_dim)),
                torch.tensor([0.5]), torch.randn(14, head), torch.randn(14, head))
        latent = {0: "batch", 2: "height", 3: "width"}
        dynamic = {"hidden_states": latent, "encoder_hidden_states": {0: "batch", 1: "text_tokens"},
                   "timestep": {0: "batch"}, "rope_cos": {0: "tokens"}, "rope_sin": {0: "tokens"},
                   "out_hidden_states": latent}
        names = ["hidden_states", "encoder_hidden_states", "timestep", "rope_cos", "rope_sin"]
        if config.guidance_embeds:  # dev: the embedded guidance scale, a row per image (the pipeline passes it raw)
            args, names, dynamic = (*args, torch.tensor([4.0])), [*names, "guidance"], {**dynamic,
                                                                                       "guidance": {0: "batch"}}
        export_rms(with_io(wrapper, dtype), args, out / "transformer" / "model.onnx", names, ["out_hidden_states"],
                   dynamic)
    finally:
        transformer.pos_embed, transformer_flux2.apply_rotary_emb = original, rotary


def _export_vae(vae: Any, out: Path, dtype: str = "fp32") -> None:
    spatial = {0: "batch", 2: "height", 3: "width"}
    channels = 4 * int(vae.config.latent_channels)
    export_rms(with_io(_VaeDecoder(vae), dtype), (torch.randn(1, channels, 2, 2),), out / "vae_decoder" / "model.onnx",
            ["latent_sample"], ["sample"], {"latent_sample": spatial, "sample": spatial})


TextHook = tuple[Callable[[Any, Path, str], None], Callable[[Any], dict[str, Any]]]
"""Another text encoder's (export to ``out``, its config.json) for ``export_flux2`` (FLUX.2 [dev]'s Mistral:
engines/build/mistral3.py)."""


def export_flux2(components: dict[str, Any], tokenizer_dir: Path, out: Path, source: dict[str, Any],
                 native_size: int | None = None, dtype: str = "fp32", class_name: str = CLASS_NAME,
                 text: TextHook | None = None) -> Path:
    """Export FLUX.2's networks, the tokenizer and the scheduler config; write model_index.json (``class_name``,
    klein's ``OnnxFlux2KleinPipeline`` with ``is_distilled``) and the manifest. ``dtype``: fp32, or fp16/bf16 per
    engines/build/dit_folder.py ``half_plan`` (the networks cast in place); ``text``: the text encoder's export
    and config where it is not klein's Qwen3."""
    out.mkdir(parents=True, exist_ok=True)
    dtypes, source = apply_dtype(components, dtype, source)
    export_text, text_config = text or (_export_text, lambda model: model.config.to_dict())
    export_text(components["text_encoder"], out, dtypes["text_encoder"])
    _export_transformer(components["transformer"], out, dtypes["transformer"])
    _export_vae(components["vae"], out, dtypes["vae"])
    configs = {"text_encoder": text_config(components["text_encoder"]),
               "transformer": config_of(components["transformer"]),
               "vae_decoder": config_of(components["vae"])}  # batch norm folded in
    extra = {"is_distilled": components["is_distilled"]} if "is_distilled" in components else {}
    return write_folder(out, class_name, configs, tokenizer_dir, components["scheduler"], source, native_size, extra)


def export_flux2_folder(src: Path, out: Path, dtype: str = "fp32") -> Path:
    """Export a local diffusers ``Flux2KleinPipeline`` folder in ``dtype`` (``export_flux2``; the networks load in
    their export dtype, the VAE in fp32 and cast after, by its config); ModelLoadError for an sdserve ONNX folder or
    a FLUX.2 variant not served."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    family, parts = load_diffusers(src, dtype, Qwen3ForCausalLM, Flux2Transformer2DModel, AutoencoderKLFlux2)
    index = json.loads((src / "model_index.json").read_text(encoding="utf-8"))
    parts["is_distilled"] = bool(index.get("is_distilled", False))
    log.info("exporting %s (%s, %s) to %s", src, family.name, dtype, out)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "tokenizer"
        shutil.copytree(src / "tokenizer", tokenizer)
        return export_flux2(parts, tokenizer, out, {"kind": "diffusers-folder", "family": family.name,
                                                    "path_name": src.name}, dtype=dtype)
