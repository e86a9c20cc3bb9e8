"""Parameter counts of the diffusion components from their diffusers/transformers ``config.json`` alone, counted the
way the modules hold them (FluxTransformer2DModel, SD3Transformer2DModel, UNet2DConditionModel, T5EncoderModel,
CLIPTextModel(WithProjection), AutoencoderKL's halves): what engines/health/memory_plan.py sizes a config-only
folder with. tests/unit/test_memory_plan.py checks every formula against the module torch builds from the config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Tally:
    """A network's parameters as its modules hold them; ``adaptable``: the Linear and Conv weights (a LoRA's
    targets) and their distinct shapes (the merge keeps one device buffer per shape)."""

    params: int = 0
    adaptable: int = 0
    shapes: set[tuple[int, ...]] = field(default_factory=set)

    def linear(self, i: int, o: int, bias: bool = True, n: int = 1) -> None:
        self.params += n * (i * o + (o if bias else 0))
        self.adaptable += n * i * o
        self.shapes.add((o, i))

    def conv(self, i: int, o: int, k: int, bias: bool = True, n: int = 1) -> None:
        self.params += n * (i * o * k * k + (o if bias else 0))
        self.adaptable += n * i * o * k * k
        self.shapes.add((o, i, k, k))

    def conv3d(self, i: int, o: int, k: tuple[int, int, int], n: int = 1) -> None:
        """A 3D convolution with bias (the causal 3D VAE's): ``k`` = (time, height, width)."""
        size = k[0] * k[1] * k[2]
        self.params += n * (i * o * size + o)
        self.adaptable += n * i * o * size
        self.shapes.add((o, i, *k))

    def add(self, count: int, n: int = 1) -> None:
        self.params += n * count


def ival(config: Mapping[str, Any], key: str, default: int) -> int:
    """An integer field of a config (``default`` when absent or null)."""
    value = config.get(key, default)
    return int(value) if value is not None else default


# ---- parameter counts from diffusers / transformers configs ----------------------------------------------------

def flux_transformer(c: Mapping[str, Any]) -> Tally:
    """FluxTransformer2DModel: double-stream blocks (image and text each with adaLN-Zero, q/k/v, out, 4x MLP),
    single-stream blocks (fused attention + MLP), RMS q/k norms per head."""
    t, hd = Tally(), ival(c, "attention_head_dim", 128)
    d, p = ival(c, "num_attention_heads", 24) * hd, ival(c, "patch_size", 1)
    in_ch = ival(c, "in_channels", 64)
    for _ in range(3 if c.get("guidance_embeds") else 2):  # timestep, [guidance], pooled text: Linear, Linear
        t.linear(d, d)
    t.linear(256, d, n=2 if c.get("guidance_embeds") else 1)
    t.linear(ival(c, "pooled_projection_dim", 768), d)
    t.linear(ival(c, "joint_attention_dim", 4096), d)
    t.linear(in_ch, d)
    double, single = ival(c, "num_layers", 19), ival(c, "num_single_layers", 38)
    t.linear(d, 6 * d, n=2 * double)  # norm1, norm1_context
    t.linear(d, d, n=8 * double)  # q, k, v, add_q, add_k, add_v, to_out, to_add_out
    t.add(4 * hd, n=double)  # norm_q, norm_k, norm_added_q, norm_added_k
    t.linear(d, 4 * d, n=2 * double)  # ff, ff_context
    t.linear(4 * d, d, n=2 * double)
    t.linear(d, 3 * d, n=single)  # AdaLayerNormZeroSingle
    t.linear(d, 4 * d, n=single)  # proj_mlp
    t.linear(5 * d, d, n=single)  # proj_out over [attention, mlp]
    t.linear(d, d, n=3 * single)
    t.add(2 * hd, n=single)
    t.linear(d, 2 * d)  # norm_out
    t.linear(d, p * p * (ival(c, "out_channels", 0) or in_ch))
    return t


def sd3_transformer(c: Mapping[str, Any]) -> Tally:
    """SD3Transformer2DModel (3 and 3.5): joint blocks, the last one context-pre-only; 3.5's q/k RMS norms and
    Medium's dual-attention blocks."""
    t, hd = Tally(), ival(c, "attention_head_dim", 64)
    d, p = ival(c, "num_attention_heads", 18) * hd, ival(c, "patch_size", 2)
    layers, qk = ival(c, "num_layers", 18), 2 * hd if c.get("qk_norm") else 0
    dual = {int(i) for i in c.get("dual_attention_layers") or ()}
    t.conv(ival(c, "in_channels", 16), d, p)  # patch embedding
    t.linear(256, d)
    t.linear(d, d, n=2)
    t.linear(ival(c, "pooled_projection_dim", 2048), d)
    t.linear(ival(c, "joint_attention_dim", 4096), ival(c, "caption_projection_dim", 1152))
    for i in range(layers):
        last = i == layers - 1
        t.linear(d, (9 if i in dual else 6) * d)
        t.linear(d, (2 if last else 6) * d)  # norm1_context: continuous on the last block
        t.linear(d, d, n=7 if last else 8)
        t.add(2 * qk)
        t.linear(d, 4 * d, n=1 if last else 2)
        t.linear(4 * d, d, n=1 if last else 2)
        if i in dual:  # attn2: q, k, v, out
            t.linear(d, d, n=4)
            t.add(qk)
    t.linear(d, 2 * d)
    t.linear(d, p * p * (ival(c, "out_channels", 0) or ival(c, "in_channels", 16)))
    return t


def t5_encoder(c: Mapping[str, Any]) -> Tally:
    """T5EncoderModel: shared embedding, per block self-attention (q, k, v, o, no biases) and a gated (v1.1) or
    plain feed-forward, RMS layer norms, relative position buckets in the first block."""
    t, d = Tally(), ival(c, "d_model", 4096)
    inner, ff, n = ival(c, "num_heads", 64) * ival(c, "d_kv", 64), ival(c, "d_ff", 10240), ival(c, "num_layers", 24)
    t.add(ival(c, "vocab_size", 32128) * d)
    t.add(ival(c, "relative_attention_num_buckets", 32) * ival(c, "num_heads", 64))
    t.linear(d, inner, bias=False, n=3 * n)
    t.linear(inner, d, bias=False, n=n)
    gated = str(c.get("feed_forward_proj", "relu")).startswith("gated")
    t.linear(d, ff, bias=False, n=(2 if gated else 1) * n)
    t.linear(ff, d, bias=False, n=n)
    t.add(d, n=2 * n + 1)
    return t


def clip_text(c: Mapping[str, Any], projection: bool) -> Tally:
    """CLIPTextModel, or CLIPTextModelWithProjection (``projection``: its bias-free text projection)."""
    t, d, n = Tally(), ival(c, "hidden_size", 768), ival(c, "num_hidden_layers", 12)
    t.add((ival(c, "vocab_size", 49408) + ival(c, "max_position_embeddings", 77)) * d)
    t.linear(d, d, n=4 * n)
    t.linear(d, ival(c, "intermediate_size", 3072), n=n)
    t.linear(ival(c, "intermediate_size", 3072), d, n=n)
    t.add(2 * d, n=2 * n + 1)
    if projection:
        t.linear(d, ival(c, "projection_dim", 768), bias=False)
    return t


def _resnet(t: Tally, i: int, o: int, temb: int = 0) -> None:
    t.add(2 * i + 2 * o)  # two GroupNorms
    t.conv(i, o, 3)
    t.conv(o, o, 3)
    if temb:
        t.linear(temb, o)
    if i != o:
        t.conv(i, o, 1)


def _vae_mid(t: Tally, ch: int, attention: bool) -> None:
    _resnet(t, ch, ch)
    if attention:  # single-head attention: GroupNorm, q, k, v, out
        t.add(2 * ch)
        t.linear(ch, ch, n=4)
    _resnet(t, ch, ch)


def vae_decoder(c: Mapping[str, Any]) -> Tally:
    """AutoencoderKL's decoder as exported (post_quant_conv + decoder); AutoencoderKLFlux2's too (its decoder's own
    ``decoder_block_out_channels`` where set; its batch-norm statistics are buffers, not parameters)."""
    t, blocks = Tally(), decoder_channels(c)
    latent, layers = ival(c, "latent_channels", 4), ival(c, "layers_per_block", 2)
    if c.get("use_post_quant_conv", True):
        t.conv(latent, latent, 1)
    t.conv(latent, blocks[-1], 3)
    _vae_mid(t, blocks[-1], bool(c.get("mid_block_add_attention", True)))
    out = blocks[-1]
    for i, ch in enumerate(reversed(blocks)):
        for j in range(layers + 1):
            _resnet(t, out if j == 0 else ch, ch)
        out = ch
        if i < len(blocks) - 1:
            t.conv(ch, ch, 3)
    t.add(2 * blocks[0])
    t.conv(blocks[0], ival(c, "out_channels", 3), 3)
    return t


def decoder_channels(c: Mapping[str, Any]) -> list[int]:
    """An AutoencoderKL(-Flux2) decoder's channels per level, full size first."""
    blocks = c.get("decoder_block_out_channels") or c.get("block_out_channels") or (128, 256, 512, 512)
    return [int(b) for b in blocks]


def vae_encoder(c: Mapping[str, Any]) -> Tally:
    """AutoencoderKL's encoder as exported (encoder + quant_conv)."""
    t, blocks = Tally(), [int(b) for b in c.get("block_out_channels") or (128, 256, 512, 512)]
    latent, layers = ival(c, "latent_channels", 4), ival(c, "layers_per_block", 2)
    t.conv(ival(c, "in_channels", 3), blocks[0], 3)
    prev = blocks[0]
    for i, ch in enumerate(blocks):
        for j in range(layers):
            _resnet(t, prev if j == 0 else ch, ch)
        prev = ch
        if i < len(blocks) - 1:
            t.conv(ch, ch, 3)
    _vae_mid(t, blocks[-1], bool(c.get("mid_block_add_attention", True)))
    t.add(2 * blocks[-1])
    t.conv(blocks[-1], 2 * latent, 3)
    if c.get("use_quant_conv", True):
        t.conv(2 * latent, 2 * latent, 1)
    return t


def _per_block(value: Any, count: int, default: int) -> list[int]:
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return [int(value if value is not None else default)] * count


def _transformer2d(t: Tally, ch: int, layers: int, cross: int, linear: bool) -> None:
    """diffusers' Transformer2DModel of a UNet block: GroupNorm, proj_in/out, ``layers`` BasicTransformerBlocks."""
    t.add(2 * ch)
    if linear:
        t.linear(ch, ch, n=2)
    else:
        t.conv(ch, ch, 1, n=2)
    t.add(6 * ch, n=layers)  # three LayerNorms
    t.linear(ch, ch, bias=False, n=4 * layers)  # attn1 q, k, v; attn2 q
    t.linear(cross, ch, bias=False, n=2 * layers)  # attn2 k, v
    t.linear(ch, ch, n=2 * layers)  # the two to_out
    t.linear(ch, 8 * ch, n=layers)  # GEGLU
    t.linear(4 * ch, ch, n=layers)


def unet(c: Mapping[str, Any]) -> Tally:
    """UNet2DConditionModel of SD 1.x/2.x/SDXL: cross-attention down/up blocks, the cross-attention mid block,
    SDXL's text_time added embedding."""
    t, blocks = Tally(), [int(b) for b in c.get("block_out_channels") or (320, 640, 1280, 1280)]
    n, temb, cross = len(blocks), 4 * blocks[0], ival(c, "cross_attention_dim", 768)
    layers = _per_block(c.get("layers_per_block"), n, 2)
    depth = _per_block(c.get("transformer_layers_per_block"), n, 1)
    down = list(c.get("down_block_types") or ["CrossAttnDownBlock2D"] * (n - 1) + ["DownBlock2D"])
    up = list(c.get("up_block_types") or ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * (n - 1))
    linear = bool(c.get("use_linear_projection", False))
    t.conv(ival(c, "in_channels", 4), blocks[0], 3)
    t.linear(blocks[0], temb)
    t.linear(temb, temb)
    if c.get("addition_embed_type") == "text_time":
        t.linear(ival(c, "projection_class_embeddings_input_dim", 2816), temb)
        t.linear(temb, temb)
    prev = blocks[0]
    for i, ch in enumerate(blocks):
        for j in range(layers[i]):
            _resnet(t, prev if j == 0 else ch, ch, temb)
            if "CrossAttn" in down[i]:
                _transformer2d(t, ch, depth[i], cross, linear)
        prev = ch
        if i < n - 1:
            t.conv(ch, ch, 3)
    _resnet(t, blocks[-1], blocks[-1], temb)
    _transformer2d(t, blocks[-1], depth[-1], cross, linear)
    _resnet(t, blocks[-1], blocks[-1], temb)
    rev, rev_layers, rev_depth = blocks[::-1], layers[::-1], depth[::-1]
    out = rev[0]
    for i, ch in enumerate(rev):
        prev_out, out, skip_in = out, ch, rev[min(i + 1, n - 1)]
        count = rev_layers[i] + 1
        for j in range(count):
            skip = skip_in if j == count - 1 else out
            _resnet(t, (prev_out if j == 0 else out) + skip, out, temb)
            if "CrossAttn" in up[i]:
                _transformer2d(t, out, rev_depth[i], cross, linear)
        if i < n - 1:
            t.conv(out, out, 3)
    t.add(2 * blocks[0])
    t.conv(blocks[0], ival(c, "out_channels", 4), 3)
    return t



def qwen_transformer(c: Mapping[str, Any]) -> Tally:
    """QwenImageTransformer2DModel (Qwen-Image's MMDiT): per block an image and a text stream, each with its own
    adaLN modulation (6 x width), q/k/v and output projections and 4x GELU MLP, per-head RMS q/k norms, one joint
    attention; the timestep embedding, the text's RMS norm and input projections, adaLN-continuous out."""
    t, hd = Tally(), ival(c, "attention_head_dim", 128)
    d, p = ival(c, "num_attention_heads", 24) * hd, ival(c, "patch_size", 2)
    joint, in_ch, layers = ival(c, "joint_attention_dim", 3584), ival(c, "in_channels", 64), ival(c, "num_layers", 60)
    t.linear(256, d)  # timestep embedding: Linear, Linear
    t.linear(d, d)
    if c.get("use_additional_t_cond"):
        t.add(2 * d)
    t.add(joint)  # txt_norm (RMSNorm)
    t.linear(in_ch, d)  # img_in
    t.linear(joint, d)  # txt_in
    t.linear(d, 6 * d, n=2 * layers)  # img_mod, txt_mod
    t.linear(d, d, n=8 * layers)  # to_q, to_k, to_v, to_out, add_q, add_k, add_v, to_add_out
    t.add(4 * hd, n=layers)  # norm_q, norm_k, norm_added_q, norm_added_k
    t.linear(d, 4 * d, n=2 * layers)  # img_mlp, txt_mlp
    t.linear(4 * d, d, n=2 * layers)
    t.linear(d, 2 * d)  # norm_out
    t.linear(d, p * p * (ival(c, "out_channels", 0) or in_ch))
    return t


def zimage_transformer(c: Mapping[str, Any]) -> Tally:
    """ZImageTransformer2DModel (Z-Image's single-stream DiT): the patch embedder, the noise refiner blocks (with
    adaLN modulation) and the context refiner blocks (without), the main blocks (with); each block bias-free q/k/v/out
    with per-head RMS q/k norms, a SwiGLU MLP at 8/3 x width, four RMS norms; the timestep MLP to the 256-wide
    modulation input, the caption embedder (RMS norm, Linear), two pad tokens, the final layer with its own adaLN."""
    t, d = Tally(), ival(c, "dim", 3840)
    hd, ff, a = d // ival(c, "n_heads", 30), int(d / 3 * 8), min(d, 256)
    p = int((c.get("all_patch_size") or [2])[0])
    f = int((c.get("all_f_patch_size") or [1])[0])
    in_ch, cap = ival(c, "in_channels", 16), ival(c, "cap_feat_dim", 2560)
    refiner, layers = ival(c, "n_refiner_layers", 2), ival(c, "n_layers", 30)
    t.linear(f * p * p * in_ch, d)  # x_embedder
    for modulated in (refiner + layers, refiner):  # noise refiner + main blocks; context refiner (no modulation)
        t.linear(d, d, bias=False, n=4 * modulated)  # to_q, to_k, to_v, to_out
        t.add(2 * hd, n=modulated)  # norm_q, norm_k
        t.linear(d, ff, bias=False, n=2 * modulated)  # w1, w3
        t.linear(ff, d, bias=False, n=modulated)  # w2
        t.add(4 * d, n=modulated)  # attention_norm1/2, ffn_norm1/2
    t.linear(a, 4 * d, n=refiner + layers)  # adaLN_modulation of the modulated blocks
    t.linear(256, 1024)  # t_embedder
    t.linear(1024, a)
    t.add(cap)  # cap_embedder: RMSNorm, Linear
    t.linear(cap, d)
    t.add(2 * d)  # x_pad_token, cap_pad_token
    t.linear(d, p * p * f * in_ch)  # final layer
    t.linear(a, d)
    return t


def flux2_transformer(c: Mapping[str, Any]) -> Tally:
    """Flux2Transformer2DModel (FLUX.2 [klein] and [dev]): bias-free throughout; the timestep (and guidance)
    embedding, one shared adaLN modulation per stream kind (double-stream image and text: 2 x 3 x width; single:
    3 x width) instead of Flux.1's per block; double-stream blocks with q/k/v/out per stream, per-head RMS q/k norms
    and SwiGLU MLPs at ``mlp_ratio`` x width; single-stream blocks fusing q/k/v with the MLP's input projection and
    the attention's output with the MLP's; adaLN-continuous out."""
    t, hd = Tally(), ival(c, "attention_head_dim", 128)
    d, p = ival(c, "num_attention_heads", 48) * hd, ival(c, "patch_size", 1)
    in_ch, m = ival(c, "in_channels", 128), int(d * float(c.get("mlp_ratio") or 3.0))
    double, single = ival(c, "num_layers", 8), ival(c, "num_single_layers", 48)
    channels = ival(c, "timestep_guidance_channels", 256)
    embedders = 2 if c.get("guidance_embeds", True) else 1  # timestep[, guidance]: Linear, Linear
    t.linear(channels, d, bias=False, n=embedders)
    t.linear(d, d, bias=False, n=embedders)
    t.linear(d, 6 * d, bias=False, n=2)  # double_stream_modulation_img, _txt
    t.linear(d, 3 * d, bias=False)  # single_stream_modulation
    t.linear(in_ch, d, bias=False)  # x_embedder
    t.linear(ival(c, "joint_attention_dim", 15360), d, bias=False)  # context_embedder
    t.linear(d, d, bias=False, n=8 * double)  # to_q, to_k, to_v, to_out, add_q, add_k, add_v, to_add_out
    t.add(4 * hd, n=double)  # norm_q, norm_k, norm_added_q, norm_added_k
    t.linear(d, 2 * m, bias=False, n=2 * double)  # ff, ff_context: linear_in (SwiGLU halves it)
    t.linear(m, d, bias=False, n=2 * double)  # linear_out
    t.linear(d, 3 * d + 2 * m, bias=False, n=single)  # to_qkv_mlp_proj
    t.linear(d + m, d, bias=False, n=single)  # to_out over [attention, mlp]
    t.add(2 * hd, n=single)
    t.linear(d, 2 * d, bias=False)  # norm_out
    t.linear(d, p * p * (ival(c, "out_channels", 0) or in_ch), bias=False)
    return t


def qwen3_text(c: Mapping[str, Any]) -> Tally:
    """A Qwen3 language model as the pipelines run it (Z-Image's, FLUX.2 [klein]'s text encoder): the token
    embedding, per layer bias-free grouped-query attention with per-head RMS q/k norms, a gated SiLU MLP, two RMS
    norms, the final norm. No LM head (the pipelines read hidden states)."""
    t, d, n = Tally(), ival(c, "hidden_size", 2560), ival(c, "num_hidden_layers", 36)
    heads = ival(c, "num_attention_heads", 32)
    hd = ival(c, "head_dim", d // heads)
    kv, ff = ival(c, "num_key_value_heads", heads) * hd, ival(c, "intermediate_size", 9728)
    t.add(ival(c, "vocab_size", 151936) * d)
    t.linear(d, heads * hd, bias=False, n=n)
    t.linear(d, kv, bias=False, n=2 * n)
    t.linear(heads * hd, d, bias=False, n=n)
    t.add(2 * hd, n=n)  # q_norm, k_norm
    t.linear(d, ff, bias=False, n=2 * n)  # gate, up
    t.linear(ff, d, bias=False, n=n)
    t.add(d, n=2 * n + 1)
    return t


def qwen_text_config(c: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields of a Qwen2.5-VL config: its ``text_config`` where it has one, else the top level
    (the released folder's layout); the top level fills what ``text_config`` leaves out."""
    text = c.get("text_config")
    return {**c, **text} if isinstance(text, Mapping) else c


def qwen_text(c: Mapping[str, Any]) -> Tally:
    """The Qwen2.5-VL language model the pipeline runs and `sdserve engines export` writes (its last hidden state):
    the token embedding, per layer grouped-query attention (q/k/v with biases, o without) and a gated SiLU MLP
    (no biases), two RMS norms, the final norm. The vision tower and the LM head, which the pipeline never runs,
    are not counted."""
    c = qwen_text_config(c)
    t, d, n = Tally(), ival(c, "hidden_size", 3584), ival(c, "num_hidden_layers", 28)
    heads = ival(c, "num_attention_heads", 28)
    hd = ival(c, "head_dim", d // heads)
    kv, ff = ival(c, "num_key_value_heads", heads) * hd, ival(c, "intermediate_size", 18944)
    t.add(ival(c, "vocab_size", 152064) * d)
    t.linear(d, heads * hd, n=n)
    t.linear(d, kv, n=2 * n)
    t.linear(heads * hd, d, bias=False, n=n)
    t.linear(d, ff, bias=False, n=2 * n)  # gate, up
    t.linear(ff, d, bias=False, n=n)
    t.add(d, n=2 * n + 1)
    return t


FLUX2_DEV_TEXT_LAYERS = (10, 20, 30)
"""The hidden states diffusers' Flux2Pipeline stacks from Mistral Small 3.1 (``text_encoder_out_layers``): index 0 is
the token embedding, index k the output of decoder layer k, so layers past the deepest one are never run."""


def mistral3_text(c: Mapping[str, Any], deepest: int = max(FLUX2_DEV_TEXT_LAYERS)) -> Tally:
    """Mistral Small 3.1's language model (``Mistral3ForConditionalGeneration.language_model``, FLUX.2 [dev]'s text
    encoder) as far as the pipeline reads it: the token embedding and the first ``deepest`` decoder layers, each
    bias-free grouped-query attention, a gated SiLU MLP and two RMS norms; the final norm only where the deepest
    hidden state read is the last one (the model applies it there). The vision tower and the LM head, which the
    pipeline never runs, are not counted. Defaults are the released config's (5120 wide, 40 layers, 32 heads and
    8 KV heads of 128, MLP 32768, vocabulary 131072)."""
    c = qwen_text_config(c)
    t, d, total = Tally(), ival(c, "hidden_size", 5120), ival(c, "num_hidden_layers", 40)
    n = min(deepest, total)
    heads = ival(c, "num_attention_heads", 32)
    hd = ival(c, "head_dim", d // heads if "hidden_size" in c else 128)  # transformers' rule; the release's 128
    kv, ff = ival(c, "num_key_value_heads", 8) * hd, ival(c, "intermediate_size", 32768)
    t.add(ival(c, "vocab_size", 131072) * d)
    t.linear(d, heads * hd, bias=False, n=n)
    t.linear(d, kv, bias=False, n=2 * n)
    t.linear(heads * hd, d, bias=False, n=n)
    t.linear(d, ff, bias=False, n=2 * n)  # gate, up
    t.linear(ff, d, bias=False, n=n)
    t.add(d, n=2 * n + (1 if n == total else 0))
    return t


def qwen_vae_dims(c: Mapping[str, Any]) -> list[int]:
    """AutoencoderKLQwenImage's channels per level, full size first (``base_dim`` x ``dim_mult``)."""
    base = ival(c, "base_dim", 96)
    return [base * int(m) for m in c.get("dim_mult") or (1, 2, 4, 4)]


def _qwen_resnet(t: Tally, i: int, o: int) -> None:
    t.add(i + o)  # two RMS norms (gamma only)
    t.conv3d(i, o, (3, 3, 3))
    t.conv3d(o, o, (3, 3, 3))
    if i != o:
        t.conv3d(i, o, (1, 1, 1))


def _qwen_attention(t: Tally, ch: int) -> None:
    t.add(ch)  # RMS norm
    t.conv(ch, 3 * ch, 1)  # to_qkv
    t.conv(ch, ch, 1)  # proj


def _qwen_mid(t: Tally, ch: int) -> None:
    _qwen_resnet(t, ch, ch)
    _qwen_attention(t, ch)
    _qwen_resnet(t, ch, ch)


def qwen_vae_encoder(c: Mapping[str, Any]) -> Tally:
    """AutoencoderKLQwenImage's encoder (causal 3D convolutions; a time convolution in each temporal downsample)
    and its quant_conv, as the module holds them."""
    t, dims, z = Tally(), qwen_vae_dims(c), ival(c, "z_dim", 16)
    temporal = [bool(v) for v in c.get("temperal_downsample") or (False, True, True)]
    attention = {float(s) for s in c.get("attn_scales") or ()}
    blocks = ival(c, "num_res_blocks", 2)
    t.conv3d(ival(c, "input_channels", 3), dims[0], (3, 3, 3))
    prev, scale = dims[0], 1.0
    for i, ch in enumerate(dims):
        for _ in range(blocks):
            _qwen_resnet(t, prev, ch)
            if scale in attention:
                _qwen_attention(t, ch)
            prev = ch
        if i < len(dims) - 1:
            t.conv(ch, ch, 3)  # stride-2 downsample
            if temporal[i]:
                t.conv3d(ch, ch, (3, 1, 1))
            scale /= 2
    _qwen_mid(t, dims[-1])
    t.add(dims[-1])
    t.conv3d(dims[-1], 2 * z, (3, 3, 3))
    t.conv3d(2 * z, 2 * z, (1, 1, 1))  # quant_conv
    return t


def qwen_vae_decoder(c: Mapping[str, Any]) -> Tally:
    """AutoencoderKLQwenImage's post_quant_conv and decoder: levels in reverse, each upsampler halving the channels
    it hands on (a time convolution in each temporal upsample), as the module holds them."""
    t, dims, z = Tally(), qwen_vae_dims(c)[::-1], ival(c, "z_dim", 16)
    temporal = [bool(v) for v in c.get("temperal_downsample") or (False, True, True)][::-1]
    blocks = ival(c, "num_res_blocks", 2)
    t.conv3d(z, z, (1, 1, 1))  # post_quant_conv
    t.conv3d(z, dims[0], (3, 3, 3))
    _qwen_mid(t, dims[0])
    prev = dims[0]
    for i, ch in enumerate(dims):
        if i > 0:
            prev //= 2  # the previous level's upsampler halves the channels
        for _ in range(blocks + 1):
            _qwen_resnet(t, prev, ch)
            prev = ch
        if i < len(dims) - 1:
            t.conv(ch, ch // 2, 3)
            if temporal[i]:
                t.conv3d(ch, 2 * ch, (3, 1, 1))
    t.add(dims[-1])
    t.conv3d(dims[-1], ival(c, "input_channels", 3), (3, 3, 3))
    return t

# ---- an exported component: element counts from the protobuf's headers ------------------------------------------
