"""LoRA tensor names, in the two layouts users have, parsed into modules: (component, module path, down, up, alpha).

- kohya / A1111: ``lora_unet_<module path, '_' for '.'>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``;
  text encoders ``lora_te_`` (SD 1.x/2.x), ``lora_te1_`` / ``lora_te2_`` (SDXL), ``lora_te3_`` (SD 3's T5).
- PEFT / diffusers: ``<component>.<module path>.lora_A.weight`` (down, [r, in]) and ``.lora_B.weight`` (up,
  [out, r]), components ``unet``, ``transformer``, ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``; the
  older diffusers ``.lora.down.weight`` / ``.lora.up.weight``; a PEFT ``base_model.model.`` prefix is the denoiser.
- ComfyUI / musubi-tuner / ai-toolkit DiT files (Qwen-Image): ``diffusion_model.<module path>`` with either pair
  of suffixes and an optional ``.alpha``, and PEFT's unsaved-adapter ``.lora_A.default.weight``: the prefixes and
  the ``default.`` diffusers' QwenImageLoraLoaderMixin strips (src/diffusers/loaders/lora_conversion_utils.py
  ``_convert_non_diffusers_qwen_lora_to_diffusers``, which also scales by ``alpha / rank``).

A1111 renames lora_A to lora_down and lora_B to lora_up and scales by ``alpha / rank`` (1.0 without an alpha),
as extensions-builtin/Lora/network.py ``calc_scale`` does; diffusers' kohya conversion keeps the same scale
(src/diffusers/loaders/lora_conversion_utils.py). Other LyCORIS kinds (LoHa, LoKr, DoRA, full diffs) are refused by
name: they are not a low-rank product this server merges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from engines.lora.safetensors import LoraFileError

DENOISER = "denoiser"
"""The UNet or the DiT transformer, whichever the model has."""
KOHYA_PREFIXES = {"lora_unet_": DENOISER, "lora_te_": "text_encoder", "lora_te1_": "text_encoder",
                  "lora_te2_": "text_encoder_2", "lora_te3_": "text_encoder_3"}
DOTTED_COMPONENTS = {"unet": DENOISER, "transformer": DENOISER, "diffusion_model": DENOISER,
                     "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2",
                     "text_encoder_3": "text_encoder_3"}
SUFFIXES = ((".lora_down.weight", "down"), (".lora_up.weight", "up"), (".lora_A.weight", "down"),
            (".lora_B.weight", "up"), (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
            (".lora.down.weight", "down"), (".lora.up.weight", "up"),
            (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"), (".alpha", "alpha"))
UNSUPPORTED = re.compile(r"\.(hada_w\d_[ab]|hada_t\d|lokr_w\d(_[ab])?|lokr_t\d|lora_magnitude_vector|diff|diff_b|"
                         r"dora_scale|lora_mid\.weight)$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: where it is and which tensors hold its factors."""

    component: str
    """``denoiser``, ``text_encoder``, ``text_encoder_2`` or ``text_encoder_3``."""
    path: str
    """Dotted (PEFT/diffusers) or underscored (kohya) module path, as the file names it."""
    kohya: bool
    down: str
    up: str
    alpha: str | None


def parse(file: str, keys: list[str]) -> list[LoraModule]:
    """The file's modules; LoraFileError naming the first key that is not LoRA, or a module missing a factor."""
    parts: dict[tuple[str, str, bool], dict[str, str]] = {}
    for key in keys:
        found = _split(key)
        if found is None:
            kind = UNSUPPORTED.search(key)
            what = (f"a LyCORIS/DoRA tensor ({kind.group(1)}), not a LoRA product this server merges" if kind
                    else "not a LoRA tensor name this server knows (kohya lora_down/lora_up/alpha, PEFT lora_A/"
                    "lora_B)")
            raise LoraFileError(f"LoRA file {file}: key {key!r} is {what}")
        component, path, kohya, role = found
        parts.setdefault((component, path, kohya), {})[role] = key
    modules = []
    for (component, path, kohya), roles in sorted(parts.items()):
        if "down" not in roles or "up" not in roles:
            missing = "down (lora_down/lora_A)" if "down" not in roles else "up (lora_up/lora_B)"
            raise LoraFileError(f"LoRA file {file}: module {path} has no {missing} factor")
        modules.append(LoraModule(component, path, kohya, roles["down"], roles["up"], roles.get("alpha")))
    if not modules:
        raise LoraFileError(f"LoRA file {file} holds no LoRA tensors")
    return modules


def _split(key: str) -> tuple[str, str, bool, str] | None:
    for suffix, role in SUFFIXES:
        if not key.endswith(suffix):
            continue
        stem = key[: -len(suffix)]
        for prefix, component in KOHYA_PREFIXES.items():
            if stem.startswith(prefix) and "." not in stem:
                return component, stem[len(prefix):], True, role
        stem = stem.removeprefix("base_model.model.")
        head, _, rest = stem.partition(".")
        if head in DOTTED_COMPONENTS and rest:
            return DOTTED_COMPONENTS[head], rest, False, role
        if "." in stem and not stem.startswith("lora_"):
            return DENOISER, stem, False, role
    return None


def normalize(path: str) -> str:
    """A module path without the export wrapper's ``model.`` and CLIP's ``text_model.`` (present on one side
    and not the other depending on who wrote the file and the graph)."""
    for prefix in ("model.", "text_model."):
        path = path.removeprefix(prefix)
    return path


def kohya_name(path: str) -> str:
    """kohya's flattened name of a dotted module path (``down_blocks.0.attn1`` -> ``down_blocks_0_attn1``)."""
    return normalize(path).replace(".", "_")


def normalize_kohya(path: str) -> str:
    return path.removeprefix("text_model_")


SGM_IN_OUT = re.compile(r"^(input_blocks|output_blocks)_(\d+)_(\d+)_(.+)$")
SGM_MIDDLE = re.compile(r"^middle_block_(\d+)_(.+)$")
INNER = ("resnets", "attentions", "upsamplers")


def sgm_to_diffusers(path: str, layers_per_block: int) -> str:
    """A kohya SDXL UNet name in the original (SGM) block layout, ``input_blocks_4_1_transformer_blocks_0_attn1_
    to_q``, in diffusers' layout, ``down_blocks_1_attentions_0_...``, as diffusers' _maybe_map_sgm_blocks_to_diffusers
    maps it (src/diffusers/loaders/lora_conversion_utils.py): input block i>0 is down block (i-1)//(L+1), layer
    (i-1)%(L+1), its inner index 0 a resnet and 1 an attention, ``op`` its downsampler; middle block 0/1/2 are
    resnet 0, attention 0, resnet 1; output block i is up block i//(L+1), layer i%(L+1), inner 0/1/2 resnet,
    attention, upsampler. Names not in that layout come back unchanged."""
    middle = SGM_MIDDLE.match(path)
    if middle is not None:
        inner = {0: "resnets_0", 1: "attentions_0", 2: "resnets_1"}.get(int(middle.group(1)))
        return f"mid_block_{inner}_{middle.group(2)}" if inner else path
    found = SGM_IN_OUT.match(path)
    if found is None:
        return path
    kind, i, j, rest = found.group(1), int(found.group(2)), int(found.group(3)), found.group(4)
    if kind == "input_blocks":
        if i == 0 or j > 1:
            return path
        block, layer = divmod(i - 1, layers_per_block + 1)
        if rest == "op" or rest.startswith("op_"):
            return f"down_blocks_{block}_downsamplers_0_conv{rest[2:]}"
        return f"down_blocks_{block}_{INNER[j]}_{layer}_{rest}"
    block, layer = divmod(i, layers_per_block + 1)
    if j > 2:
        return path
    return f"up_blocks_{block}_{INNER[j]}_{layer if j < 2 else 0}_{rest}"


Rows = tuple[tuple[int, int], ...]
"""The rows of a file's up factor a weight takes: chunks ``(index, of count)`` of its rows, concatenated in that
order; ``()`` is every row. A fused projection of the original checkpoint layout is several weights in diffusers'
(the qkv Linear is ``to_q``, ``to_k``, ``to_v``): each takes its third of the up factor and the whole down factor,
which is the product diffusers' conversions give (down shared, up split; their "sparse" split is the same product)."""
Rule = tuple[str, tuple[tuple[str, Rows], ...]]


def _thirds(*names: str) -> tuple[tuple[str, Rows], ...]:
    return tuple((name, ((i, 3),)) for i, name in enumerate(names))


FLUX2_RULES: tuple[Rule, ...] = (
    (r"double_blocks_(\d+)_img_attn_qkv",
     _thirds(r"transformer_blocks_\1_attn_to_q", r"transformer_blocks_\1_attn_to_k",
             r"transformer_blocks_\1_attn_to_v")),
    (r"double_blocks_(\d+)_txt_attn_qkv",
     _thirds(r"transformer_blocks_\1_attn_add_q_proj", r"transformer_blocks_\1_attn_add_k_proj",
             r"transformer_blocks_\1_attn_add_v_proj")),
    (r"double_blocks_(\d+)_img_attn_proj", ((r"transformer_blocks_\1_attn_to_out_0", ()),)),
    (r"double_blocks_(\d+)_txt_attn_proj", ((r"transformer_blocks_\1_attn_to_add_out", ()),)),
    (r"double_blocks_(\d+)_img_mlp_0", ((r"transformer_blocks_\1_ff_linear_in", ()),)),
    (r"double_blocks_(\d+)_img_mlp_2", ((r"transformer_blocks_\1_ff_linear_out", ()),)),
    (r"double_blocks_(\d+)_txt_mlp_0", ((r"transformer_blocks_\1_ff_context_linear_in", ()),)),
    (r"double_blocks_(\d+)_txt_mlp_2", ((r"transformer_blocks_\1_ff_context_linear_out", ()),)),
    (r"sformer_blocks_(.+)", ((r"transformer_blocks_\1", ()),)),
    (r"single_blocks_(\d+)_linear1", ((r"single_transformer_blocks_\1_attn_to_qkv_mlp_proj", ()),)),
    (r"single_blocks_(\d+)_linear2", ((r"single_transformer_blocks_\1_attn_to_out", ()),)),
    (r"img_in", (("x_embedder", ()),)),
    (r"txt_in", (("context_embedder", ()),)),
    (r"time_in_in_layer", (("time_guidance_embed_timestep_embedder_linear_1", ()),)),
    (r"time_in_out_layer", (("time_guidance_embed_timestep_embedder_linear_2", ()),)),
    (r"guidance_in_in_layer", (("time_guidance_embed_guidance_embedder_linear_1", ()),)),
    (r"guidance_in_out_layer", (("time_guidance_embed_guidance_embedder_linear_2", ()),)),
    (r"final_layer_linear", (("proj_out", ()),)),
    (r"final_layer_adaLN_modulation_1", (("norm_out_linear", ((1, 2), (0, 2))),)),
    (r"(single_stream_modulation|double_stream_modulation_img|double_stream_modulation_txt)_lin",
     ((r"\1_linear", ()),)),
)
"""FLUX.2's original (BFL) module names, as ComfyUI/ai-toolkit (``diffusion_model.``) and kohya (``lora_unet_``)
files name them, in diffusers' names, as diffusers' ``_convert_non_diffusers_flux2_lora_to_diffusers`` and
``_convert_kohya_flux2_lora_to_diffusers`` map them (src/diffusers/loaders/lora_conversion_utils.py), with one
difference: the final layer's modulation keeps the original's meaning: its rows are
(shift, scale) where diffusers' ``norm_out.linear`` holds (scale, shift) (single_file_utils.py
``convert_flux2_transformer_checkpoint_to_diffusers`` swaps them for the weights; the LoRA conversion does not,
which would shift by the scale's delta), so the up factor's halves are swapped."""

ZIMAGE_RULES: tuple[Rule, ...] = (
    (r"(.+_attention)_qkv", _thirds(r"\1_to_q", r"\1_to_k", r"\1_to_v")),
    (r"(.+_attention)_out", ((r"\1_to_out_0", ()),)),
    (r"all_x_embedder_(.+)", ((r"\1", ()),)),
    (r"all_final_layer_(.+)", ((r"\1", ()),)),
    (r"x_embedder", (("2-1", ()),)),
    (r"final_layer_(.+)", ((r"2-1_\1", ()),)),
)
"""Z-Image: the original checkpoint's fused ``attention.qkv`` and ``attention.out`` (ComfyUI's and kohya-style
trainers' names; diffusers' ``_convert_non_diffusers_z_image_lora_to_diffusers`` splits and renames them the same
way), and the ``all_x_embedder`` / ``all_final_layer`` ModuleDicts: the export scopes a ModuleDict child by its key
alone (``/2-1/MatMul``), so diffusers' ``all_x_embedder.2-1`` is the graph's ``2-1``; the original checkpoint's
``x_embedder`` and ``final_layer`` are the released model's only patch key, ``2-1``."""

ORIGINAL_LAYOUTS: dict[str, tuple[Rule, ...]] = {"flux2-klein": FLUX2_RULES, "flux2-dev": FLUX2_RULES,
                                                  "z-image": ZIMAGE_RULES}
"""Per architecture (engines/families.py ``bases``): a module's other names, in kohya's flat naming."""


def renamed(architecture: str, flat: str) -> tuple[tuple[str, Rows], ...]:
    """The flat names (and row chunks) in the served graph of a module the file names in the architecture's
    original layout; ``()`` when no rule names it."""
    for pattern, outputs in ORIGINAL_LAYOUTS.get(architecture, ()):
        found = re.fullmatch(pattern, flat)
        if found is not None:
            return tuple((found.expand(name), rows) for name, rows in outputs)
    return ()


def take_rows(up: np.ndarray, rows: Rows) -> np.ndarray:
    """The rows of an up factor a weight takes (``rows`` as in ``Rows``)."""
    if not rows:
        return up
    return np.concatenate([np.split(up, count, axis=0)[index] for index, count in rows], axis=0)
