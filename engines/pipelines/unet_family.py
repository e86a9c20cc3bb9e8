"""Model families: what a model folder is, told from its files before any session runs, and what that means for
the shared txt2img loop.

A family is detected from ``model_index.json`` (``_class_name``, ``force_zeros_for_empty_prompt``), the component
configs (UNet conditioning, VAE scaling, text encoder) and the scheduler config, then checked against the UNet
session's inputs. What sdserve serves:

- ``sd1``: SD 1.x, one CLIP text encoder (last hidden state), 512 native.
- ``sd2``: SD 2.x, one OpenCLIP encoder (the folder's tokenizer pads with ``!``), linear-projection transformers,
  v-prediction or epsilon as its scheduler config says, 768 (or 512 for the base models) native.
- ``sdxl``: two encoders, penultimate hidden states concatenated, pooled projection from the second, and the
  ``text_time`` added conditioning (text_embeds, time_ids); VAE scaling 0.13025.
- ``turbo``: a few-step distilled model of either base (SD-Turbo, SDXL-Turbo), told by its scheduler's
  ``timestep_spacing = "trailing"``: no CFG by default (guidance 0), 1-4 steps.

Each family comes in its inpainting variant too: a UNet with ``in_channels`` 9 (the latents, the mask and the
masked image's latents concatenated, as stable-diffusion-inpainting and SDXL inpainting 0.1), ``Family.inpainting``.

Anything else (a depth UNet's 5 input channels, LCM's guidance embedding, an upscaler's class labels, an SDXL
refiner's single encoder, a UNet with inputs no family has) is refused with ModelLoadError (exit 11) naming what was
found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines import families
from engines.errors import ModelLoadError

SD_CLASSES = frozenset({"OnnxStableDiffusionPipeline", "ORTStableDiffusionPipeline", "StableDiffusionPipeline",
                        "OnnxStableDiffusionInpaintPipeline", "ORTStableDiffusionInpaintPipeline",
                        "StableDiffusionInpaintPipeline", "OnnxStableDiffusionImg2ImgPipeline",
                        "ORTStableDiffusionImg2ImgPipeline", "StableDiffusionImg2ImgPipeline"})
XL_CLASSES = frozenset({"OnnxStableDiffusionXLPipeline", "ORTStableDiffusionXLPipeline", "StableDiffusionXLPipeline",
                        "StableDiffusionXLInpaintPipeline", "ORTStableDiffusionXLInpaintPipeline",
                        "StableDiffusionXLImg2ImgPipeline", "ORTStableDiffusionXLImg2ImgPipeline"})
INPAINT_CHANNELS = 9
"""An inpainting UNet's input channels: 4 latents + 1 mask + 4 masked-image latents."""
FAMILY_NAMES = families.names("unet")
SERVED = "sdserve serves sd1, sd2, sdxl and turbo (SD/SDXL-Turbo) text-to-image folders"
XL_INPUTS = ("text_embeds", "time_ids")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when absent; ModelLoadError when it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


@dataclass(frozen=True)
class Family:
    """What the pipeline consults: encoders, extra UNet inputs, CFG default, schedule defaults."""

    name: str
    """sd1 | sd2 | sdxl | turbo"""
    base: str
    """The architecture: sd1 | sd2 | sdxl (turbo has one of them)."""
    native_size: int
    prediction_type: str
    timestep_spacing: str
    """As the scheduler config says; "" when it leaves it to each sampler's default."""
    text_encoders: int
    vae_scaling_factor: float
    vae_force_upcast: bool
    """SDXL whose VAE config keeps force_upcast (true in diffusers for every VAE; only SDXL's overflows in
    fp16 in practice): it must decode in fp32. An fp16-fixed SDXL VAE sets it false."""
    force_zeros_for_empty_prompt: bool
    """SDXL: an empty negative prompt conditions on zeros (embeddings and pooled), not on the encoded ""."""
    default_steps: int
    default_guidance: float
    inpainting: bool = False
    """A 9-channel inpainting UNet: it serves inpainting, and txt2img as A1111 does with such models (the whole
    image masked, the masked image mid-gray); img2img without a mask is refused."""

    @property
    def xl(self) -> bool:
        """SDXL's UNet: micro-conditioning, two text encoders (the base family's facts)."""
        return families.facts(self.base).micro_conditioning

    @property
    def cfg_default(self) -> bool:
        """Whether the default guidance runs classifier-free guidance (guidance > 1, as diffusers decides)."""
        return self.default_guidance > 1.0

    def describe(self) -> str:
        """One line for the boot log."""
        return (f"family {self.name} (base {self.base}): native {self.native_size}x{self.native_size}, "
                f"{self.prediction_type}, spacing {self.timestep_spacing or 'sampler default'}, "
                f"{self.text_encoders} text encoder(s), VAE scaling {self.vae_scaling_factor:g}, "
                f"CFG by default: {'yes' if self.cfg_default else 'no'}, "
                f"{'9-channel inpainting' if self.inpainting else '4-channel'} UNet "
                f"(defaults: {self.default_steps} steps, guidance {self.default_guidance:g})")


def _scheduler_value(config: Mapping[str, Any], key: str, default: str) -> str:
    # Keys diffusers listed as defaulted are unset (engines/numerics/schedulers.py NoiseSchedule.from_config).
    if key in config.get("_use_default_values", ()):
        return default
    value = config.get(key, default)
    return value if isinstance(value, str) else default


def _refuse_unet_config(folder: Path, unet: Mapping[str, Any]) -> None:
    found = []
    if int(unet.get("in_channels", 4)) not in (4, INPAINT_CHANNELS):
        found.append(f"in_channels {unet.get('in_channels')} (a depth or upscaler UNet; 4 and 9 are served)")
    if unet.get("time_cond_proj_dim") is not None:
        found.append(f"time_cond_proj_dim {unet.get('time_cond_proj_dim')} (a guidance-embedded LCM UNet)")
    if unet.get("class_embed_type") is not None or unet.get("num_class_embeds") is not None:
        found.append(f"class_embed_type {unet.get('class_embed_type')!r} (an upscaler's noise-level labels)")
    if unet.get("addition_embed_type") not in (None, "text_time"):
        found.append(f"addition_embed_type {unet.get('addition_embed_type')!r}")
    if found:
        raise ModelLoadError(f"{folder}: {SERVED}; its unet/config.json has {'; '.join(found)}")


def _base(folder: Path, index: Mapping[str, Any], unet: Mapping[str, Any]) -> str:
    cls = index.get("_class_name")
    two = (folder / "text_encoder_2").is_dir()
    if cls is not None and cls not in SD_CLASSES | XL_CLASSES:
        raise ModelLoadError(f"{folder}: {SERVED}; model_index.json names {cls!r}")
    xl = cls in XL_CLASSES or two or unet.get("addition_embed_type") == "text_time"
    if xl and not (two and (folder / "text_encoder").is_dir()):
        raise ModelLoadError(f"{folder}: {SERVED}; found an SDXL-class folder ({cls}) without both text_encoder "
                             "and text_encoder_2 (an SDXL refiner is not a text-to-image model)")
    if xl and unet.get("addition_embed_type", "text_time") != "text_time":
        raise ModelLoadError(f"{folder}: {SERVED}; an SDXL folder whose UNet has no text_time conditioning")
    if xl:
        return "sdxl"
    if cls in XL_CLASSES:
        raise ModelLoadError(f"{folder}: {SERVED}; {cls} without text_time conditioning in unet/config.json")
    # SD 2.x: linear projections in the transformers, OpenCLIP's 1024-wide states (its tiny build keeps the first).
    sd2 = bool(unet.get("use_linear_projection")) or unet.get("cross_attention_dim") == 1024
    return "sd2" if sd2 else "sd1"


def detect(folder: Path) -> Family:
    """The family of an optimum-layout ONNX folder, from its JSON files only (no session is created).
    ModelLoadError names what was found when it is no family sdserve serves."""
    index = read_json(folder / "model_index.json")
    unet = read_json(folder / "unet" / "config.json")
    vae = read_json(folder / "vae_decoder" / "config.json")
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")
    _refuse_unet_config(folder, unet)
    base = _base(folder, index, unet)
    prediction = _scheduler_value(scheduler, "prediction_type", "epsilon")
    spacing = _scheduler_value(scheduler, "timestep_spacing", "")
    # the scheduler as the samplers read it: keys diffusers marked as defaulted are unset
    resolved = {"prediction_type": prediction, "timestep_spacing": spacing}
    found = families.resolve(base, {"index": index, "scheduler": resolved, "denoiser": unet})
    name = found.name
    factor = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    sample = unet.get("sample_size", 64)
    steps, guidance = found.steps, found.guidance
    xl = families.facts(base).micro_conditioning  # SDXL's base: two encoders, its VAE's and empty prompt's rules
    return Family(name=name, base=base, native_size=int(sample if isinstance(sample, int) else 64) * factor,
                  prediction_type=prediction, timestep_spacing=spacing, text_encoders=2 if xl else 1,
                  vae_scaling_factor=float(vae.get("scaling_factor", 0.18215)),
                  vae_force_upcast=xl and bool(vae.get("force_upcast", True)),
                  force_zeros_for_empty_prompt=xl and bool(index.get("force_zeros_for_empty_prompt", True)),
                  default_steps=steps, default_guidance=guidance,
                  inpainting=int(unet.get("in_channels", 4)) == INPAINT_CHANNELS)


@dataclass(frozen=True)
class UNetIO:
    """The UNet's input and output names by role; ``text_embeds``/``time_ids`` only for SDXL."""

    sample: str
    timestep: str
    hidden: str
    out: str
    timestep_shape: tuple[int, ...]
    text_embeds: str | None = None
    time_ids: str | None = None
    timestep_rows: bool = False
    """The timestep input takes one value per row (a symbolic first dim): rows at different steps can share a call
    (step-level batching). A UNet exported with a fixed [1] timestep serves rows at one timestep per call."""


def unet_io(family: Family, inputs: Mapping[str, Sequence[int | str | None]], outputs: Sequence[str]) -> UNetIO:
    """Assign the UNet session's inputs (name -> shape) to roles by rank (and, for SDXL's two rank-2 inputs, by
    name or width 6). Inputs that no role of ``family`` takes are refused, named."""
    by_rank: dict[int, list[str]] = {}
    for name, shape in inputs.items():
        by_rank.setdefault(len(shape), []).append(name)
    roles: dict[str, str] = {}
    for rank, role in ((4, "sample"), (3, "hidden")):
        if by_rank.get(rank):
            roles[role] = by_rank[rank].pop(0)
    scalars = by_rank.get(0) or by_rank.get(1)
    if scalars:
        roles["timestep"] = scalars.pop(0)
    pair = by_rank.get(2, [])
    if family.xl and len(pair) == 2:
        time_ids = next((n for n in pair if n == "time_ids"), None) or next(
            (n for n in pair if inputs[n][-1] == 6), pair[1])
        roles |= {"time_ids": time_ids, "text_embeds": next(n for n in pair if n != time_ids)}
        pair.clear()
    extra = sorted(n for names in by_rank.values() for n in names)
    wanted = ["sample", "timestep", "hidden", *(["text_embeds", "time_ids"] if family.xl else [])]
    missing = [r for r in wanted if r not in roles]
    if extra or missing:
        expected = "sample, timestep, encoder_hidden_states" + (", text_embeds, time_ids" if family.xl else "")
        what = [f"inputs {extra} that a {family.name} UNet does not take" if extra else "",
                f"no input for {missing}" if missing else ""]
        raise ModelLoadError(f"unet: {SERVED}; found {'; '.join(w for w in what if w)} "
                             f"(all inputs: {sorted(inputs)}; expected {expected})")
    shape = inputs[roles["timestep"]]
    return UNetIO(roles["sample"], roles["timestep"], roles["hidden"], outputs[0], () if not shape else (1,),
                  roles.get("text_embeds"), roles.get("time_ids"), bool(shape) and not isinstance(shape[0], int))


def penultimate_output(outputs: Sequence[str], config: Mapping[str, Any]) -> str:
    """The output holding hidden_states[-2] of an SDXL text encoder: ``hidden_states.<layers - 1>`` (our export and
    optimum's, which exports every layer's)."""
    layers = config.get("num_hidden_layers")
    indices = sorted(int(o.split(".")[1]) for o in outputs
                     if o.startswith("hidden_states.") and o.split(".")[1].isdigit())
    if isinstance(layers, int) and f"hidden_states.{layers - 1}" in outputs:
        return f"hidden_states.{layers - 1}"
    if len(indices) >= 2 and not isinstance(layers, int):  # every layer's states: the second to last
        return f"hidden_states.{indices[-2]}"
    raise ModelLoadError(f"an SDXL text encoder must output its penultimate hidden states (hidden_states.<n-1>); "
                         f"outputs {list(outputs)}, num_hidden_layers {layers}")


def time_ids(height: int, width: int, original: tuple[int, int] | None = None,
             crop: tuple[int, int] = (0, 0)) -> list[float]:
    """SDXL's six micro-conditioning ids: original size (h, w), crop top-left (top, left), target size (h, w).
    Defaults as diffusers: original = target, crop (0, 0)."""
    oh, ow = original or (height, width)
    return [float(oh), float(ow), float(crop[0]), float(crop[1]), float(height), float(width)]


def effective_guidance(guidance: float) -> float:
    """diffusers runs CFG only when guidance > 1; at or below 1 the prediction is the conditional one alone."""
    return guidance if guidance > 1.0 else 1.0
