"""TensorRT build plan for the DiT families (Flux.1 dev/schnell, SD 3 / 3.5, Qwen-Image): per served size and
component, the exact provider options of one engine, as engines/build/trtplan.py plans the UNet families.

Every symbolic dim comes from the folder and the serving pipeline's own rules (engines/pipelines/flow.py):
rows are the images, doubled under classifier-free guidance (SD 3: negatives first; Flux never doubles); Flux's
transformer takes the 2x2-packed latent tokens ``(H/16)*(W/16)`` and ``text_tokens`` = the T5 length, with rope
tables over text + image tokens; SD 3's takes latents ``[rows, 16, H/8, W/8]`` and CLIP (77) + T5 tokens; the T5
length is the family's ``max_sequence_length`` capped by the tokenizer's. A dim that is fixed in the graph is
kept; one that is neither fixed nor known refuses the plan (trtplan.resolve).

Qwen-Image (engines/pipelines/qwen.py, qwen_tokenizer.py): the transformer takes the 2x2-packed tokens
like Flux, and ``max_sequence_length`` (512) text states, every row zero-padded to that fixed length, with the key
mask ``encoder_hidden_states_mask`` [rows, 512] beside them; rows doubled under true CFG (negatives first); rope
tables over 512 + image tokens. Its text encoder is fed *variable-length* ids: each batch's rows right-padded to
its longest templated prompt, the template's 34-token system prefix included, cut at 34 + 512. So the profile
spans ``input_ids`` [rows, 35 .. 546] (``QWEN_TEXT_MIN``: the prefix and at least one token, what the tokenizer
requires; ``QWEN_TEXT_OPT``: a typical prompt; max: the prefix + 512), one engine for every prompt length.

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

QWEN_TEXT_MIN = TEMPLATE_DROP + 1
"""The shortest ids the Qwen pipeline feeds: the template's system prefix and one token past it (the tokenizer
refuses less)."""
QWEN_TEXT_OPT = TEMPLATE_DROP + 128
"""The length the text encoder's engine is tuned for: a prompt of up to ~120 tokens in the template."""

NAMED: dict[str, tuple[str, ...]] = {
    "input_ids": ("rows", "clip_tokens"),
    "hidden_states": ("rows", "image_tokens", "packed_channels"),
    "encoder_hidden_states": ("rows", "text_tokens", "joint"),
    "pooled_projections": ("rows", "pooled"),
    "encoder_hidden_states_mask": ("rows", "text_tokens"),
    "timestep": ("rows",), "guidance": ("rows",),
    "rope_cos": ("rope_tokens", "rope_dim"), "rope_sin": ("rope_tokens", "rope_dim"),
    "latent_sample": ("batch", "latent_channels", "height", "width"),
    "sample": ("batch", "image_channels", "pixel_height", "pixel_width"),
}
"""Each input's dims by role; SD 3's 4-D ``hidden_states`` and the T5's ``input_ids`` are told apart in ``roles``."""


def _json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def t5_component(family: DitFamily) -> str:
    return architectures.get(family.base).t5


def components(family: DitFamily, folder: Path) -> list[str]:
    parts = architectures.get(family.base).components
    return [p for p in [*parts, "vae_encoder"] if (folder / p / "model.onnx").is_file()]


def precisions(family: DitFamily, folder: Path) -> dict[str, str]:
    """Every exported component's engine precision (what engines/build/trtplan.py puts in the plan's flags)."""
    return {c: precision(family, c, folder) for c in components(family, folder)}


def dims(folder: Path, family: DitFamily) -> dict[str, int | None]:
    """The values the roles take for every size (the size-dependent ones are added per profile)."""
    vae = _json(folder / "vae_decoder" / "config.json")
    row = architectures.get(family.base)
    if row.text_tokens == "fixed":
        return qwen_dims(family, vae)
    t5_tok = _json(folder / row.t5.replace("text_encoder", "tokenizer") / "tokenizer_config.json")
    clip_tok = _json(folder / "tokenizer" / "tokenizer_config.json")
    cap = t5_tok.get("model_max_length")
    t5 = min(family.max_sequence_length, cap) if isinstance(cap, int) and 0 < cap < 100_000 else \
        family.max_sequence_length
    clip = clip_tok.get("model_max_length")
    clip = clip if isinstance(clip, int) and 0 < clip < 100_000 else 77
    blocks = vae.get("block_out_channels")
    return {"t5_tokens": t5, "clip_tokens": clip,
            "text_tokens": clip + t5 if row.text_tokens == "clip+t5" else t5,
            "latent_channels": int(vae.get("latent_channels", 16)), "image_channels": 3,
            "factor": 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8}


def qwen_dims(family: DitFamily, vae: dict[str, Any]) -> dict[str, int | None]:
    """Qwen-Image's: the fixed text length of the transformer, the text encoder's id lengths, the 16-channel VAE
    (``z_dim``) and its factor (one 2x downsample per ``temperal_downsample`` entry)."""
    temporal = vae.get("temperal_downsample")
    return {"text_tokens": family.max_sequence_length, "qwen_tokens_min": QWEN_TEXT_MIN,
            "qwen_tokens_opt": min(QWEN_TEXT_OPT, TEMPLATE_DROP + family.max_sequence_length),
            "qwen_tokens_max": TEMPLATE_DROP + family.max_sequence_length,
            "latent_channels": int(vae.get("z_dim", 16)), "image_channels": 3,
            "factor": 2 ** len(temporal) if isinstance(temporal, list) and temporal else 8}


def roles(family: DitFamily, component: str, name: str, rank: int) -> tuple[str, ...] | None:
    if name == "input_ids" and architectures.get(family.base).text_tokens == "fixed":
        return ("rows", "qwen_tokens")
    if name == "input_ids":
        return ("rows", "t5_tokens") if component == t5_component(family) else ("rows", "clip_tokens")
    if component == "transformer" and name == "hidden_states" and rank == 4:
        return ("rows", "latent_channels", "height", "width")
    return NAMED.get(name)


def values(family: DitFamily, base: dict[str, int | None], width: int, height: int, batch: int,
           cfg: bool, bound: str = "max") -> dict[str, int | None]:
    """Every role's value at one profile bound (``min``, ``opt`` or ``max``): the batch's, and where a dim varies
    within a size (the Qwen text encoder's id length), the bound's."""
    factor = base["factor"] or 8
    h, w = height // factor, width // factor
    image_tokens = (h // 2) * (w // 2)
    text = base["text_tokens"] or 0
    return {**base, "batch": batch, "rows": 2 * batch if cfg and family.cfg else batch, "height": h, "width": w,
            "pixel_height": height, "pixel_width": width, "image_tokens": image_tokens,
            "rope_tokens": text + image_tokens, "qwen_tokens": base.get(f"qwen_tokens_{bound}")}
