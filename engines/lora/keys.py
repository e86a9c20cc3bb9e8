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
