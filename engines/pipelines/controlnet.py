"""ControlNet units on the SD 1.x/2.x and SDXL UNet pipelines (issue 56), with diffusers'
StableDiffusionControlNetPipeline and StableDiffusionXLControlNetPipeline semantics: every denoiser evaluation runs
each active unit's ControlNet on the UNet's input (the scaled latents, every CFG row), its timestep and text states
(on SDXL its added conditions too: the pooled text embeddings and time ids the UNet gets, the same rows), and the
control image; the units' residuals are summed (diffusers'
MultiControlNetModel; on the device, one Add graph call per extra unit) and the UNet's residual variant
(``unet_controlnet/``, engines/build/controlnet.py) takes them. A unit is active at evaluation ``i`` of ``n``
unless ``i / n < guidance_start`` or ``(i + 1) / n > guidance_end`` (diffusers' ``controlnet_keep``); an
evaluation with no active unit runs the plain UNet, which is what the residual variant computes with zero
residuals. The control image is prepared as diffusers' ``prepare_image`` does: resized to the output size (PIL
Lanczos, ``VaeImageProcessor``), RGB in [0, 1], one copy per row, doubled under CFG.

A pipeline serves ControlNet once ``attach`` gave it the ControlNets and its residual UNet; the plain UNet and its
path are unchanged otherwise. A ControlNet for another base (an SDXL one, config ``addition_embed_type``
"text_time", on an SD 1.x/2.x model, or the reverse) is left out at load, logged by name, and a unit naming it is
refused by name (``controlnet.model``) with the reason; a file that fits no other way raises ModelLoadError.

LoRA with ControlNet is diffusers' ``load_lora_weights`` + ``fuse_lora`` on StableDiffusionControlNetPipeline: the
LoRA adapts the UNet and the text encoders, never a ControlNet. The text encoders run as without units; the
residual UNet runs on its own LoRA variant session (``attach_lora``: LoraManager.residual_variant, the same targets
renamed to the UNet's initializer names) with the UNet's merged tensors bound, so one merged set serves both UNets;
its run is recorded as the UNet's (Adapters.adapted), the only component it adapts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.pipelines.ort_model import Feed, OrtModel
from engines.pipelines.unet_family import read_json
from engines.types.request import Batch, ControlUnit

StableDiffusionOnnx = Any
"""engines/pipelines/unet.py's pipeline, which imports this module (its hooks): named here without an import."""
Denoising = Any
"""engines/pipelines/unet.py's per-request denoising state (its ``control`` is this module's ControlRun)."""

DOWN = "down_block_additional_residual_"
MID = "mid_block_additional_residual"
NET_DOWN = "down_block_res_sample_"
NET_MID = "mid_block_res_sample"
ADDED = ("text_embeds", "time_ids")
"""SDXL's added conditions, inputs of its ControlNet and of its residual UNet under these names."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlNet:
    """One loaded ControlNet: its session and its residuals' geometry (channels, downsampling per residual)."""

    name: str
    model: OrtModel
    levels: tuple[tuple[int, int], ...]
    """Per residual, down blocks then mid: (channels, latent downsampling factor)."""
    xl: bool = False
    """An SDXL ControlNet: it takes the UNet's added conditions (ADDED)."""


@dataclass
class ActiveUnit:
    """One unit of a running request: its ControlNet, the prepared image and scale rows on the device."""

    net: ControlNet
    cond: ort.OrtValue
    scale: ort.OrtValue
    keep: tuple[bool, ...]
    """Per evaluation: whether the unit runs (diffusers' controlnet_keep != 0)."""


@dataclass
class ControlRun:
    """The control set of one running request (Denoising.control)."""

    units: list[ActiveUnit] = field(default_factory=list)


def sum_graph(count: int, dtype: type[np.generic]) -> bytes:
    """``count`` element-wise additions in one call (a_j + b_j -> sum_j): the units' residuals summed on the
    device, as MultiControlNetModel sums them (one IEEE addition per element, in unit order)."""
    from onnx import helper
    from onnx.helper import np_dtype_to_tensor_dtype

    elem = np_dtype_to_tensor_dtype(np.dtype(dtype))
    shape = ["B", "C", "H", "W"]
    names = [(f"a{j}", f"b{j}", f"sum{j}") for j in range(count)]
    graph = helper.make_graph(
        [helper.make_node("Add", [a, b], [out]) for a, b, out in names], "controlnet_residual_sum",
        [helper.make_tensor_value_info(n, elem, [f"{n}_{d}" for d in shape]) for a, b, _ in names for n in (a, b)],
        [helper.make_tensor_value_info(out, elem, None) for _, _, out in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sdserve")
    model.ir_version = 8
    return bytes(model.SerializeToString())


def base_mismatch(name: str, config: dict[str, Any], xl: bool) -> str:
    """Why the ControlNet ``name`` of ``config`` is for another base than an SDXL (``xl``) or SD 1.x/2.x model, or
    "" when its base is the model's."""
    net_xl = config.get("addition_embed_type") == "text_time"
    if net_xl == xl:
        return ""
    kinds = ("an SD 1.x/2.x ControlNet", "an SDXL model") if xl else ("an SDXL ControlNet", "an SD 1.x/2.x model")
    return f"ControlNet {name} is {kinds[0]}, this is {kinds[1]} (a ControlNet for another base model)"


def residual_levels(config: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """(channels, downsampling) of each residual of a ControlNet of ``config``: the input conv's, one per resnet
    layer, one per downsampler, then the mid block's."""
    channels = [int(c) for c in config["block_out_channels"]]
    layers = int(config["layers_per_block"])
    factor, levels = 1, [(channels[0], 1)]
    for level, width in enumerate(channels):
        levels += [(width, factor)] * layers
        if level < len(channels) - 1:
            factor *= 2
            levels.append((width, factor))
    return (*levels, (channels[-1], factor))


class ControlNets:
    """The ControlNets a pipeline serves and its UNet's residual variant."""

    def __init__(self, pipe: StableDiffusionOnnx, folder: Path, nets: dict[str, Path], label: str = "") -> None:
        """``folder``: the model's folder (its unet_controlnet/model.onnx); ``nets``: name -> ControlNet folder
        (model.onnx, config.json). ModelLoadError names what does not fit the model."""
        if pipe.family.inpainting:
            raise ModelLoadError(f"{folder.name}: ControlNet is served on SD 1.x/2.x and SDXL text-to-image UNets "
                                 "only")
        path = folder / "unet_controlnet" / "model.onnx"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no unet_controlnet/model.onnx (export the model with "
                                 "`sdserve engines export --controlnet` to serve ControlNet)")
        self.unet = OrtModel(pipe.runtime, path, "unet_controlnet" + label)
        self.path = path
        self.denoiser = pipe.unet.component
        """The plain UNet's component name: the key of the merged LoRA tensors the residual UNet binds."""
        count = sum(name.startswith(DOWN) for name in self.unet.inputs)
        self.residuals = [f"{DOWN}{i}" for i in range(count)] + [MID]
        missing = [name for name in self.residuals if name not in self.unet.inputs]
        if missing:
            raise ModelLoadError(f"{path}: no input {missing[0]} (not a UNet exported with residual inputs)")
        xl = bool(pipe.family.xl)
        if xl and any(name not in self.unet.inputs for name in ADDED):
            raise ModelLoadError(f"{path}: no inputs {list(ADDED)} (not an SDXL UNet exported with residual inputs)")
        self.nets: dict[str, ControlNet] = {}
        self.refused: dict[str, str] = {}
        """ControlNets for another base model: name -> why (a unit naming one is refused with it)."""
        for name, net_folder in sorted(nets.items()):
            config = read_json(net_folder / "config.json")
            mismatch = base_mismatch(name, config, xl)
            if mismatch:
                log.warning("ControlNet %s refused: %s", name, mismatch)
                self.refused[name] = mismatch
                continue
            levels = residual_levels(config)
            if len(levels) != len(self.residuals):
                raise ModelLoadError(f"ControlNet {name}: {len(levels)} residuals, the UNet takes "
                                     f"{len(self.residuals)} (a ControlNet for another base model)")
            width = int(config.get("cross_attention_dim", 0))
            if width != pipe.hidden_width:
                raise ModelLoadError(f"ControlNet {name}: cross_attention_dim {width}, the model's text states "
                                     f"are {pipe.hidden_width} wide (a ControlNet for another base model)")
            model = OrtModel(pipe.runtime, net_folder / "model.onnx", f"controlnet_{name}" + label)
            wanted = ("controlnet_cond", "conditioning_scale", *(ADDED if xl else ()))
            absent = [n for n in wanted if n not in model.inputs]
            if absent:
                raise ModelLoadError(f"ControlNet {name}: no input {absent[0]} (inputs {model.inputs}; export it "
                                     "with `sdserve engines export --controlnet`)")
            if model.output_dtype() != self.unet.input_dtype(MID):
                raise ModelLoadError(f"ControlNet {name}: residuals of {np.dtype(model.output_dtype()).name}, the "
                                     f"UNet takes {np.dtype(self.unet.input_dtype(MID)).name} (export both alike)")
            self.nets[name] = ControlNet(name, model, levels, xl)
        self.sum = OrtModel(pipe.runtime, sum_graph(len(self.residuals), self.unet.input_dtype(MID)),
                            "controlnet_sum" + label)
        """Adds one unit's residuals to the others' on the device."""

    def attach_lora(self, manager: Any) -> None:
        """Give the residual UNet the LoRA variant of ``manager`` (engines/lora/manager.py LoraManager), or None
        while no file adapts the UNet; called wherever the plain UNet's variant is attached (boot, refresh). A
        residual UNet whose weights are not the UNet's gets none (logged): a unit with a UNet LoRA is refused."""
        try:
            self.unet.variant = manager.residual_variant(self.path, self.denoiser)
        except ModelLoadError as exc:
            log.warning("LoRA with ControlNet not served: %s", exc)
            self.unet.variant = None

    def lora(self, adapters: Adapters | None) -> Adapters | None:
        """The adapters the residual UNet runs with: the UNet's merged tensors under its own component name, or
        None (its base session) when the batch has none for the UNet."""
        weights = adapters.of(self.denoiser) if adapters is not None else None
        return Adapters({self.unet.component: weights}) if weights is not None else None

    def start(self, pipe: StableDiffusionOnnx, batch: Batch, state: Denoising) -> ControlRun:
        """The request's units on the device: images prepared, scales per row, activity per evaluation."""
        rows = int(state.model_in.shape()[0])
        evaluations = state.evaluations
        run = ControlRun()
        for k, unit in enumerate(batch.control):
            net = self.nets.get(unit.model)
            if net is None and unit.model in self.refused:
                raise InvalidRequestError(self.refused[unit.model], param="controlnet.model")
            if net is None:
                raise InvalidRequestError(f"unknown ControlNet {unit.model!r}; this server has "
                                          f"{sorted(self.nets) or 'none'}", param="controlnet.model")
            image = prepare_hint(unit, batch)
            cond = np.repeat(image[None], rows, axis=0).astype(net.model.input_dtype("controlnet_cond"))
            scale = np.full((rows,), unit.weight, dtype=net.model.input_dtype("conditioning_scale"))
            keep = tuple(not (i / evaluations < unit.guidance_start or (i + 1) / evaluations > unit.guidance_end)
                         for i in range(evaluations))
            run.units.append(ActiveUnit(net, pipe.runtime.upload(f"control{k}", cond),
                                        pipe.runtime.upload(f"control_scale{k}", scale), keep))
        return run

    def run(self, pipe: StableDiffusionOnnx, state: Denoising, control: ControlRun) -> None:
        """The state's next evaluation with its active units: their summed residuals into the residual UNet; the
        plain UNet when none is active."""
        i = state.next_eval
        timestep = state.timesteps[i]
        base: dict[str, Feed] = {pipe.io.sample: state.model_in, pipe.io.timestep: timestep, **state.feeds}
        active = [unit for unit in control.units if unit.keep[i]]
        if not active:
            pipe.unet.run(base, {pipe.io.out: state.model_out}, state.adapters)
            return
        rows, _, height, width = state.model_in.shape()
        added = {ADDED[0]: state.feeds[pipe.io.text_embeds], ADDED[1]: state.feeds[pipe.io.time_ids]} \
            if pipe.io.text_embeds is not None and pipe.io.time_ids is not None else {}
        total: list[ort.OrtValue] = []
        for k, unit in enumerate(active):
            dtype = unit.net.model.output_dtype()
            outputs = [pipe.runtime.buffer(f"control_res{k % 2}_{j}", (rows, c, height // f, width // f), dtype)
                       for j, (c, f) in enumerate(unit.net.levels)]
            names = [f"{NET_DOWN}{j}" for j in range(len(outputs) - 1)] + [NET_MID]
            unit.net.model.run({"sample": state.model_in, "timestep": timestep,
                                "encoder_hidden_states": state.feeds[pipe.io.hidden],
                                "controlnet_cond": unit.cond, "conditioning_scale": unit.scale,
                                **(added if unit.net.xl else {})},
                               dict(zip(names, outputs, strict=True)))
            if not total:
                total = outputs
            else:  # MultiControlNetModel: the units' residuals summed, in unit order
                sums = [pipe.runtime.buffer(f"control_sum{k % 2}_{j}", tuple(out.shape()), dtype)
                        for j, out in enumerate(outputs)]
                feeds: dict[str, Feed] = {f"a{j}": a for j, a in enumerate(total)}
                self.sum.run(feeds | {f"b{j}": b for j, b in enumerate(outputs)},
                             {f"sum{j}": out for j, out in enumerate(sums)})
                total = sums
        lora = self.lora(state.adapters)
        self.unet.run({**base, **dict(zip(self.residuals, total, strict=True))}, {pipe.io.out: state.model_out},
                      lora)
        if lora is not None and state.adapters is not None and self.unet.component in lora.adapted:
            state.adapters.adapted.add(self.denoiser)  # the UNet ran with its LoRA (as the residual UNet)


def prepare_image(unit: ControlUnit, width: int, height: int) -> np.ndarray:
    """The control image as diffusers' ``prepare_image`` gives it for one row: [3, height, width] float32 RGB in
    [0, 1], resized (PIL Lanczos, VaeImageProcessor's default) when it is not the output size. A unit this path
    cannot serve (an inpaint unit, one without an image: the DiT pipelines call it) is refused by name."""
    if unit.inpaint or unit.hint_mask is not None:
        raise InvalidRequestError("inpaint ControlNet units (inpaint_global_harmonious, inpaint_only) are served on "
                                  "SD 1.x/2.x and SDXL ControlNets only, not on this model",
                                  param=f"{unit.field}.module")
    if unit.from_init is not None:
        raise InvalidRequestError("a ControlNet unit without an image is served on SD 1.x/2.x and SDXL UNets only: "
                                  "send the unit's image", param=f"{unit.field}.image")
    return _pixels(np.asarray(unit.image), width, height, unit.field)


def _pixels(image: np.ndarray, width: int, height: int, field: str) -> np.ndarray:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise InvalidRequestError(f"control image must be uint8 [H, W, 3], got {image.dtype} {list(image.shape)}",
                                  param=f"{field}.image")
    if image.shape[:2] != (height, width):
        image = np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))
    return (image.astype(np.float32) / 255.0).transpose(2, 0, 1)


def unit_inputs(unit: ControlUnit, batch: Batch) -> tuple[np.ndarray, np.ndarray | None]:
    """The unit's control image (uint8 [H, W, 3]) and hint mask (bool [H, W] or None) on ``batch``: a unit without
    an image takes the init image of the batch's first image (A1111's ``init_images[0]``, already at the batch's
    size) through its preprocessor; an inpaint unit without its own mask takes that image's mask (>= 128: diffusers'
    binarization at 0.5). Refused naming the unit's field: no init image (txt2img), an inpaint unit without any
    mask, ``inpaint_only`` where the pipeline blends nothing back (not inpainting)."""
    edit = batch.images[0].edit if batch.images else None
    image, mask = np.asarray(unit.image), unit.hint_mask
    if unit.from_init is not None:
        if edit is None or edit.references:
            raise InvalidRequestError("a ControlNet unit without an image takes img2img's init image; this request "
                                      "has none (send the unit's image)", param=f"{unit.field}.image")
        image = np.asarray(unit.from_init(np.asarray(edit.image)))
    if not unit.inpaint:
        return image, mask
    if mask is None and edit is not None and edit.mask is not None:
        mask = np.asarray(edit.mask) >= 128
    if mask is None:
        raise InvalidRequestError("an inpaint ControlNet unit needs a mask: the unit's (mask, or image {image, "
                                  "mask}) or, on img2img inpainting, the request's", param=f"{unit.field}.mask")
    if unit.inpaint == "only" and batch.mode != "inpaint":
        raise InvalidRequestError("inpaint_only keeps the unmasked area by blending it back, which this server does "
                                  "on img2img inpainting only (a request with a mask); use inpaint_global_harmonious "
                                  "here", param=f"{unit.field}.module")
    return image, mask


def prepare_hint(unit: ControlUnit, batch: Batch) -> np.ndarray:
    """The unit's hint for one row, [3, height, width] float32: prepare_image's pixels in [0, 1], and for an inpaint
    unit -1 where its mask (resized to the output size, nearest) is set, after the resize so the -1 survives
    (diffusers' ``make_inpaint_condition``; sd-webui-controlnet's inpaint hint)."""
    image, mask = unit_inputs(unit, batch)
    pixels = _pixels(image, batch.width, batch.height, unit.field)
    if mask is None:
        return pixels
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (batch.height, batch.width):
        mask = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize(
            (batch.width, batch.height), Image.Resampling.NEAREST)) >= 128
    return np.where(mask[None], np.float32(-1.0), pixels).astype(np.float32)


def start(pipe: StableDiffusionOnnx, batch: Batch, state: Denoising) -> ControlRun | None:
    """The request's control set, or None without units (the pipeline's plain path). InvalidRequestError when the
    pipeline serves no ControlNet, or with a LoRA on the UNet while the residual UNet has no LoRA variant (a
    server whose boot did not attach it: ControlNets.attach_lora)."""
    if not batch.control:
        return None
    controls: ControlNets | None = getattr(pipe, "controls", None)
    if controls is None:
        raise InvalidRequestError("this model serves no ControlNet (no ControlNet folder or no "
                                  "unet_controlnet/model.onnx)", param="controlnet")
    if state.adapters is not None and state.adapters.of(controls.denoiser) and controls.unet.variant is None:
        raise InvalidRequestError("ControlNet with a LoRA on the UNet is not served by this server (the residual "
                                  "UNet has no LoRA variant)", param="controlnet")
    return controls.start(pipe, batch, state)


def attach(pipe: StableDiffusionOnnx, folder: Path, nets: dict[str, Path], label: str = "") -> ControlNets:
    """Give ``pipe`` (loaded from ``folder``) the ControlNets ``nets`` (name -> exported ControlNet folder)."""
    controls = ControlNets(pipe, folder, nets, label)
    pipe.controls = controls
    return controls
