"""TensorRT build plan for the DiT families (Flux.1 dev/schnell, SD 3 / 3.5, Qwen-Image, Z-Image, FLUX.2 [klein]):
per served size and
component, the exact provider options of one engine, as engines/build/trtplan.py plans the UNet families.

Every symbolic dim comes from the folder and the serving pipeline's own rules (engines/pipelines/flow.py):
rows are the images, doubled under classifier-free guidance (SD 3: negatives first; Flux never doubles); Flux's
transformer takes the 2x2-packed latent tokens ``(H/16)*(W/16)`` and ``text_tokens`` = the T5 length, with rope
tables over text + image tokens; SD 3's takes latents ``[rows, 16, H/8, W/8]`` and CLIP (77) + T5 tokens; the T5
length is the family's ``max_sequence_length`` capped by the tokenizer's. A dim that is fixed in the graph is
kept; one that is neither fixed nor known refuses the plan (trtplan.resolve).

Instruction edits (FLUX.1 Kontext, Qwen-Image-Edit 2509/2511, FLUX.2 with reference images): their reference
tokens widen every image-token dim, engines/build/trtplan_edit.py.

Qwen-Image (engines/pipelines/qwen.py, qwen_tokenizer.py): the transformer takes the 2x2-packed tokens
like Flux, and ``max_sequence_length`` (512) text states, every row zero-padded to that fixed length, with the key
mask ``encoder_hidden_states_mask`` [rows, 512] beside them; rows doubled under true CFG (negatives first); rope
tables over 512 + image tokens. Its text encoder is fed *variable-length* ids: each batch's rows right-padded to
its longest templated prompt, the template's 34-token system prefix included, cut at 34 + 512. So the profile
spans ``input_ids`` [rows, 35 .. 546] (``QWEN_TEXT_MIN``: the prefix and at least one token, what the tokenizer
requires; ``QWEN_TEXT_OPT``: a typical prompt; max: the prefix + 512), one engine for every prompt length.

Z-Image and FLUX.2 [klein] (engines/pipelines/zimage.py, flux2.py) are fixed-length text families too
(``text_dims``: which id lengths each text encoder is fed, by the registry row's ``text_ids``); Z-Image's image
tables run over its 2x2 tokens padded to a multiple of 32; FLUX.2's VAE patchifies its latents itself
(``vae_dims``: 128 channels at 1/16, one latent per token), and its step-distilled checkpoints never
run CFG (their rows are never doubled).

Precision per part follows a half-precision export (engines/health/dit_precision.py ``export_precision``): each
component's ``model.onnx`` is read for the float type most of its initializers have (the protobuf's headers,
engines/health/onnx_scan.py: the weights are never read): an fp16 export gives ``trt_fp16_enable``, a bf16 one
``trt_bf16_enable``, so an fp16 export is never computed in bf16 (nor a bf16 one in fp16). An fp32 export (what
`sdserve engines export` writes by default) leaves the choice to the registry, as TensorRT's half-precision flags
on an fp32 graph let the builder lower it: how fp32 exports were always built (fp32 engines would double every
engine). One exception keeps a range the export kept on purpose: an fp16 graph holding fp32 weights
(``HALF_KEEPS_SHARE`` of its floats or more: T5's ``wo`` kept in fp32, engines/build/dit_export.py ``PRECISION``)
is built in bf16, since TensorRT's fp16 flag would let those layers run in fp16 too.
Where a component has no ``model.onnx`` (a config-only folder the memory plan sizes) the registry's precision
stands (engines/architectures.py ``ENGINE_PRECISION``: T5 and the transformer in bf16, CLIP in fp16, the VAE in
bf16; Qwen-Image every part in bf16, its released precision): what to export at. bf16 needs compute capability
>= 8.0 (the matrix's H200 is 9.0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engines import architectures
from engines.health.dit_precision import precision
from engines.numerics.qwen_tokenizer import TEMPLATE_DROP
from engines.pipelines.flow_family import DitFamily
from engines.pipelines.zimage import SEQ_MULTI_OF

QWEN_TEXT_MIN = TEMPLATE_DROP + 1
"""The shortest ids the Qwen pipeline feeds: the template's system prefix and one token past it (the tokenizer
refuses less)."""
QWEN_TEXT_OPT = TEMPLATE_DROP + 128
"""The length the text encoder's engine is tuned for: a prompt of up to ~120 tokens in the template."""
TEXT_OPT = 128
"""The same for a Qwen3 encoder fed the whole templated prompt (Z-Image): a prompt of about 120 tokens."""

NAMED: dict[str, tuple[str, ...]] = {
    "input_ids": ("rows", "clip_tokens"),
    "hidden_states": ("rows", "image_tokens", "packed_channels"),
    "encoder_hidden_states": ("rows", "text_tokens", "joint"),
    "pooled_projections": ("rows", "pooled"),
    "encoder_hidden_states_mask": ("rows", "text_tokens"),
    "attention_mask": ("rows", "text_ids"),
    "image_index": ("padded_image_tokens",), "image_pad": ("padded_image_tokens",),
    "image_rope_cos": ("padded_image_tokens", "rope_dim"), "image_rope_sin": ("padded_image_tokens", "rope_dim"),
    "text_rope_cos": ("text_tokens", "rope_dim"), "text_rope_sin": ("text_tokens", "rope_dim"),
    "timestep": ("rows",), "guidance": ("rows",), "modulate_index": ("image_tokens",),
    "rope_cos": ("rope_tokens", "rope_dim"), "rope_sin": ("rope_tokens", "rope_dim"),
    "latent_sample": ("batch", "latent_channels", "height", "width"),
    "controlnet_cond": ("rows", "image_tokens", ""), "controlnet_mode": ("rows", ""), "conditioning_scale": ("rows",),
    "sample": ("batch", "image_channels", "pixel_height", "pixel_width"),
}
"""Each input's dims by role; SD 3's 4-D ``hidden_states`` and the T5's ``input_ids`` are told apart in ``roles``.
``modulate_index``: Qwen-Image-Edit 2511's 0/1 per image token, the reference tokens included
(engines/build/trtplan_edit.py). ``controlnet_*``, ``conditioning_scale``: a FLUX.1 ControlNet's
(engines/build/controlnet_dit.py; its mode and channel dims are fixed in the graph)."""
CONTROLLED = "transformer_controlnet"
"""FLUX.1's residual transformer (engines/build/controlnet_dit.py): the transformer's inputs, then one residual
``[rows, image_tokens, inner]`` per block (``RESIDUALS``; the width is fixed in the graph)."""
RESIDUALS = ("block_residual_", "single_residual_")
CONTROL_ROPE = "control_rope_tokens"
"""A FLUX.1 ControlNet's rope rows: the text and image tokens, one more for the union kind's mode token
(``control_text`` in the plan's dims, engines/build/trtplan_controlnet.py)."""


def _json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def t5_component(family: DitFamily) -> str:
    return architectures.get(family.base).t5


def components(family: DitFamily, folder: Path) -> list[str]:
    """The folder's exported parts: the row's, the VAE encoder, FLUX.1's residual transformer (ControlNet)."""
    parts = architectures.get(family.base).components
    return [p for p in [*parts, "vae_encoder", CONTROLLED] if (folder / p / "model.onnx").is_file()]


def precisions(family: DitFamily, folder: Path) -> dict[str, str]:
    """Every exported component's engine precision (what engines/build/trtplan.py puts in the plan's flags); the
    residual transformer's is its own export's, else the transformer's (the same network)."""
    return {c: precision(family, c, folder) if c != CONTROLLED else controlled_precision(family, folder / c)
            for c in components(family, folder)}


def controlled_precision(family: DitFamily, folder: Path) -> str:
    """The engine precision of a FLUX.1 ControlNet part in ``folder`` (the residual transformer or a ControlNet):
    a half export's own, else the registry's transformer precision (a ControlNet is the transformer's blocks)."""
    from engines.health.dit_precision import export_precision

    path = folder / "model.onnx"
    found = export_precision(path) if path.is_file() else None
    return found if found not in (None, "fp32") else precision(family, "transformer")


def dims(folder: Path, family: DitFamily) -> dict[str, int | None]:
    """The values the roles take for every size (the size-dependent ones are added per profile)."""
    vae = _json(folder / "vae_decoder" / "config.json")
    row = architectures.get(family.base)
    # rows per image under CFG: 1 where the family never runs it, and for a step-distilled checkpoint
    # (model_index.json ``is_distilled``: diffusers' Flux2KleinPipeline ignores the guidance scale, so does ours)
    distilled = bool(_json(folder / "model_index.json").get("is_distilled", False))
    cfg = {"cfg_rows": 2 if family.cfg and not distilled else 1}
    if row.text_tokens == "fixed":
        return {**text_dims(family), **vae_dims(vae), **cfg, **_edit(family, folder, vae)}
    t5_tok = _json(folder / row.t5.replace("text_encoder", "tokenizer") / "tokenizer_config.json")
    clip_tok = _json(folder / "tokenizer" / "tokenizer_config.json")
    cap = t5_tok.get("model_max_length")
    t5 = min(family.max_sequence_length, cap) if isinstance(cap, int) and 0 < cap < 100_000 else \
        family.max_sequence_length
    clip = clip_tok.get("model_max_length")
    clip = clip if isinstance(clip, int) and 0 < clip < 100_000 else 77
    return {"t5_tokens": t5, "clip_tokens": clip,
            "text_tokens": clip + t5 if row.text_tokens == "clip+t5" else t5, **vae_dims(vae), **cfg,
            **_edit(family, folder, vae)}


def _edit(family: DitFamily, folder: Path, vae: dict[str, Any]) -> dict[str, int]:
    """An instruction-edit folder's reference bounds (engines/build/trtplan_edit.py ``references``; {} else)."""
    from engines.build.trtplan_edit import references

    geometry = vae_dims(vae)
    return references(family, folder, int(geometry["factor"] or 8) * int(geometry["pack"] or 2))


def text_dims(family: DitFamily) -> dict[str, int | None]:
    """A fixed-length text family's: the transformer's text length (``max_sequence_length``) and the id lengths its
    text encoder is fed (min, opt, max), as its registry row's ``text_ids`` says the pipeline feeds them:

    - ``longest+prefix`` (Qwen-Image's Qwen2.5-VL encoder): each batch's rows padded to its longest templated prompt,
      the 34-token system prefix read and then dropped: 35 .. 34 + max_sequence_length;
    - ``padded`` (FLUX.2's encoder, with an ``attention_mask``): every row padded to max_sequence_length: one length;
    - ``longest`` (Z-Image's Qwen3 encoder): each batch's rows padded to its longest templated prompt, cut at
      max_sequence_length with the template: 1 (a safe floor below the template's own tokens) .. the length."""
    n = family.max_sequence_length
    kind = architectures.get(family.base).text_ids
    if kind == "longest+prefix":
        ids = (QWEN_TEXT_MIN, min(QWEN_TEXT_OPT, TEMPLATE_DROP + n), TEMPLATE_DROP + n)
    elif kind == "padded":
        ids = (n, n, n)
    elif kind == "longest":
        ids = (1, min(TEXT_OPT, n), n)
    else:
        raise ValueError(f"{family.base}: a fixed-length text row needs text_ids (padded, longest, longest+prefix), "
                         f"not {kind!r}")
    return {"text_tokens": n, **{f"text_ids_{b}": v for b, v in zip(("min", "opt", "max"), ids, strict=True)}}


def vae_dims(vae: dict[str, Any]) -> dict[str, int | None]:
    """The latents' channels and scale factor, and ``pack``: the latent side of one transformer token. Qwen-Image's
    causal VAE: 16 channels (``z_dim``), one 2x downsample per ``temperal_downsample`` entry; AutoencoderKL's:
    ``latent_channels``, 2^(levels - 1); AutoencoderKLFlux2 (``patch_size``) 2x2-patchifies its latents into
    channels itself, so they run at one more 2x with 4x the channels, one latent per token; the others' transformers
    pack 2x2 latents into a token (Z-Image patchifies inside its graph, the same count)."""
    temporal, blocks = vae.get("temperal_downsample"), vae.get("block_out_channels")
    if isinstance(temporal, list) and temporal and not blocks:
        return {"latent_channels": int(vae.get("z_dim", 16)), "image_channels": 3, "factor": 2 ** len(temporal),
                "pack": 2}
    patch = vae.get("patch_size")
    p = int(patch[0]) if isinstance(patch, list) and patch else 1
    factor = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8
    return {"latent_channels": int(vae.get("latent_channels", 16)) * p * p, "image_channels": 3, "factor": factor * p,
            "pack": 1 if p > 1 else 2}


def roles(family: DitFamily, component: str, name: str, rank: int) -> tuple[str, ...] | None:
    if "vision" in architectures.get(family.base).components and component in ("text_encoder", "vision"):
        from engines.build.trtplan_edit import QWEN_EDIT_ROLES

        return QWEN_EDIT_ROLES.get((component, name))
    if name == "input_ids" and architectures.get(family.base).text_tokens == "fixed":
        return ("rows", "text_ids")
    if name == "input_ids":
        return ("rows", "t5_tokens") if component == t5_component(family) else ("rows", "clip_tokens")
    if name.startswith(RESIDUALS):
        return ("rows", "image_tokens", "")
    if component == "controlnet" and name in ("rope_cos", "rope_sin"):
        return (CONTROL_ROPE, "rope_dim")
    if component == "transformer" and name == "hidden_states" and rank == 4:
        return ("rows", "latent_channels", "grid_height", "grid_width")
    return NAMED.get(name)


def values(family: DitFamily, base: dict[str, int | None], width: int, height: int, batch: int,
           cfg: bool, bound: str = "max") -> dict[str, int | None]:
    """Every role's value at one profile bound (``min``, ``opt`` or ``max``): the batch's, and where a dim varies
    within a size (a Qwen text encoder's id length), the bound's. Z-Image's image tables run over the tokens padded
    to a multiple of ``SEQ_MULTI_OF`` (engines/pipelines/zimage.py ``image_tables``)."""
    factor, pack = base["factor"] or 8, base.get("pack") or 2
    h, w = height // factor, width // factor
    image_tokens = (h // pack) * (w // pack)
    text = base["text_tokens"] or 0
    rows = batch * (base.get("cfg_rows") or 1) if cfg else batch
    found = {**base, "batch": batch, "rows": rows, "height": h, "width": w, "grid_height": h, "grid_width": w,
             "pixel_height": height, "pixel_width": width, "image_tokens": image_tokens,
             "padded_image_tokens": image_tokens + (-image_tokens) % SEQ_MULTI_OF,
             "rope_tokens": text + image_tokens, "text_ids": base.get(f"text_ids_{bound}"),
             CONTROL_ROPE: text + image_tokens + (base.get("control_text") or 0)}
    from engines.build.trtplan_edit import edit_values

    return edit_values(base, found, bound)
