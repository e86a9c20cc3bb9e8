"""FLUX.1 ControlNet units on the flow pipeline (issue 56), with diffusers' FluxControlNetPipeline semantics
(InstantX-style ControlNets and their union kind; engines/build/controlnet_dit.py exports both):

- the control image is resized to the output size (PIL Lanczos, VaeImageProcessor's), scaled to [-1, 1],
  VAE-encoded once per request, ``(mean - shift_factor) * scaling_factor``, 2x2-packed as the latents are and copied
  to every row. diffusers samples the posterior there with the request's torch generator; sdserve takes its mean
  (deterministic; the parity tests ask diffusers for the mean too: ``retrieve_latents(..., sample_mode="argmax")``);
- every transformer evaluation runs each active unit's ControlNet on the packed latents, the timestep, the text
  states, the pooled projections, the rope tables (the union kind's mode embedding leads the text: one more text
  token, position zero) and, where its config embeds guidance, the guidance; its block samples, scaled by the unit's
  weight, are summed over the units (FluxMultiControlNetModel, in unit order, on the device) and go into the
  transformer's residual variant (``transformer_controlnet/``: one residual input per block; block ``k`` gets sample
  ``k // ceil(blocks / samples)``, diffusers' interval rule, zeros where the ControlNet has no single blocks);
  units whose ControlNets have one depth are summed by sample, then mapped (diffusers' order: a sample per
  ControlNet block held, not one per transformer block); where their depths differ, each unit's samples are mapped to
  the blocks first and then summed (diffusers sums by sample index, truncating to the shorter list, and drops every
  later unit's single samples when the first unit has none; with a first unit with single blocks and units of
  equal double depth, the two are the same);
- a unit is active at evaluation ``i`` of ``n`` unless ``i / n < guidance_start`` or ``(i + 1) / n > guidance_end``
  (diffusers' ``controlnet_keep``); an evaluation with no active unit runs the plain transformer with the uncontrolled
  rows (what the residual variant computes with zero residuals).

A FluxPipeline serves ControlNet once ``attach`` gave it the ControlNets and its residual transformer. A ControlNet
that is no FLUX.1 one (an SD ControlNet, XLabs' pixel-hint kind, other widths) is left out at load, logged, and a
unit naming it is refused by name (``controlnet.model``) with the reason.

LoRA with a FLUX.1 ControlNet is diffusers' ``load_lora_weights`` + ``fuse_lora`` on FluxControlNetPipeline: a
FLUX.1 LoRA adapts the transformer (and the CLIP text encoder), never the ControlNet (FluxLoraLoaderMixin loads into
the transformer only). The residual transformer runs on its own LoRA variant session (``attach_lora``:
LoraManager.residual_variant, its targets renamed to the plain transformer's initializer names, engines/lora/
residual.py) with the transformer's merged tensors bound, so one merged set serves both; its run is recorded as the
transformer's (Adapters.adapted).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora.active import Adapters
from engines.pipelines.controlnet import prepare_image
from engines.pipelines.flow import DitConditioning, DitDenoising, pack_latents, run
from engines.pipelines.ort_model import Feed, OrtModel
from engines.pipelines.unet_edits import ENCODER_OUTPUT
from engines.pipelines.unet_family import read_json
from engines.types.request import Batch, ControlUnit

FluxPipeline = Any
"""engines/pipelines/flux.py's pipeline, which imports this module (its hooks): named here without an import."""
STATE_KEY = "_sdserve_control"
"""The attribute of a DitDenoising that holds its ControlRun (set by ``start``, read by ``run_controlled``)."""
BLOCK, SINGLE = "block_residual_", "single_residual_"
NET_BLOCK, NET_SINGLE = "controlnet_block_sample_", "controlnet_single_block_sample_"
SHARED = ("encoder_hidden_states", "pooled_projections", "guidance")
"""Transformer feeds the ControlNet takes under the same names."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FluxControlNet:
    """One loaded FLUX.1 ControlNet: its session and depth."""

    name: str
    model: OrtModel
    blocks: int
    singles: int
    union: bool
    guidance: bool


@dataclass
class ActiveUnit:
    net: FluxControlNet
    feeds: dict[str, Feed]
    """The unit's per-request ControlNet inputs on the device: controlnet_cond, conditioning_scale, controlnet_mode
    and the union kind's rope tables."""
    keep: tuple[bool, ...]


@dataclass
class ControlRun:
    units: list[ActiveUnit] = field(default_factory=list)
    zeros: ort.OrtValue | None = None
    """Zero residuals for blocks no active ControlNet feeds."""


def sum_graph(count: int, dtype: type[np.generic]) -> bytes:
    """``count`` element-wise additions of [B, N, D] residuals in one call (a_j + b_j -> sum_j)."""
    from onnx import helper
    from onnx.helper import np_dtype_to_tensor_dtype

    elem = np_dtype_to_tensor_dtype(np.dtype(dtype))
    names = [(f"a{j}", f"b{j}", f"sum{j}") for j in range(count)]
    graph = helper.make_graph(
        [helper.make_node("Add", [a, b], [out]) for a, b, out in names], "flux_controlnet_residual_sum",
        [helper.make_tensor_value_info(n, elem, [f"{n}_{d}" for d in "BND"]) for a, b, _ in names for n in (a, b)],
        [helper.make_tensor_value_info(out, elem, None) for _, _, out in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sdserve")
    model.ir_version = 8
    return bytes(model.SerializeToString())


def unfit(name: str, config: dict[str, Any], transformer: dict[str, Any]) -> str:
    """Why the ControlNet ``name`` of ``config`` does not fit the FLUX.1 ``transformer`` config ("" when it does)."""
    kind = config.get("_class_name")
    if kind != "FluxControlNetModel":
        return f"ControlNet {name} is a {kind or 'non-FLUX.1'} ControlNet, this is a FLUX.1 model (another base)"
    if config.get("conditioning_embedding_channels") is not None:
        return f"ControlNet {name} is an XLabs FLUX.1 ControlNet (a pixel hint block): not served"
    for key in ("in_channels", "joint_attention_dim", "pooled_projection_dim", "num_attention_heads",
                "attention_head_dim"):
        if int(config.get(key, -1)) != int(transformer.get(key, -2)):
            return f"ControlNet {name}: {key} {config.get(key)}, the transformer's is {transformer.get(key)}"
    return ""


class FluxControlNets:
    """The ControlNets a FLUX.1 pipeline serves and its transformer's residual variant."""

    def __init__(self, pipe: FluxPipeline, folder: Path, nets: dict[str, Path], label: str = "") -> None:
        path = folder / "transformer_controlnet" / "model.onnx"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no transformer_controlnet/model.onnx (export the model with "
                                 "`sdserve engines export --controlnet` to serve ControlNet)")
        if pipe.editor is None:
            raise ModelLoadError(f"{folder} has no vae_encoder/model.onnx: FLUX.1 ControlNets take VAE-encoded "
                                 "control images")
        self.transformer = OrtModel(pipe.runtime, path, "transformer_controlnet" + label)
        self.path, self.denoiser = path, str(pipe.transformer.component)
        """The residual transformer's graph and the component whose LoRA weights it takes (``transformer``)."""
        inputs = self.transformer.inputs
        self.blocks = [f"{BLOCK}{k}" for k in range(sum(n.startswith(BLOCK) for n in inputs))]
        self.singles = [f"{SINGLE}{k}" for k in range(sum(n.startswith(SINGLE) for n in inputs))]
        if not self.blocks or any(n not in inputs for n in [*self.blocks, *self.singles]):
            raise ModelLoadError(f"{path}: not a FLUX.1 transformer exported with residual inputs")
        self.dtype = self.transformer.input_dtype(self.blocks[0])
        self.nets: dict[str, FluxControlNet] = {}
        self.refused: dict[str, str] = {}
        """ControlNets that do not fit: name -> why (a unit naming one is refused with it)."""
        for name, net_folder in sorted(nets.items()):
            config = read_json(net_folder / "config.json")
            why = unfit(name, config, pipe.config)
            if not why and config.get("guidance_embeds") and not pipe.guidance_input:
                why = f"ControlNet {name} embeds guidance, this model's transformer takes none"
            if why:
                log.warning("ControlNet %s refused: %s", name, why)
                self.refused[name] = why
                continue
            model = OrtModel(pipe.runtime, net_folder / "model.onnx", f"controlnet_{name}" + label)
            if model.output_dtype() != self.dtype:
                raise ModelLoadError(f"ControlNet {name}: residuals of {np.dtype(model.output_dtype()).name}, the "
                                     f"transformer takes {np.dtype(self.dtype).name} (export both alike)")
            self.nets[name] = FluxControlNet(name, model, int(config["num_layers"]), int(config["num_single_layers"]),
                                             config.get("num_mode") is not None, bool(config.get("guidance_embeds")))
        counts = {len(self.blocks) + len(self.singles)} | {n.blocks + n.singles for n in self.nets.values()}
        self.sums = {count: OrtModel(pipe.runtime, sum_graph(count, self.dtype), f"flux_controlnet_sum{count}" + label)
                     for count in sorted(counts)}
        """Adds one unit's samples to the others', per count: a ControlNet's samples (units of one depth), or one per
        transformer block (units of several depths)."""

    def attach_lora(self, manager: Any) -> None:
        """Give the residual transformer the LoRA variant of ``manager`` (engines/lora/manager.py LoraManager), or
        None while no file adapts the transformer; called wherever the plain transformer's variant is attached (boot,
        refresh). A residual transformer whose weights are not the transformer's gets none (logged): a unit with a
        transformer LoRA is then refused."""
        try:
            self.transformer.variant = manager.residual_variant(self.path, self.denoiser)
        except ModelLoadError as exc:
            log.warning("LoRA with ControlNet not served: %s", exc)
            self.transformer.variant = None

    def lora(self, adapters: Adapters | None) -> Adapters | None:
        """The adapters the residual transformer runs with: the transformer's merged tensors under its own component
        name, or None (its base session) when the batch has none for the transformer."""
        weights = adapters.of(self.denoiser) if adapters is not None else None
        return Adapters({self.transformer.component: weights}) if weights is not None else None

    def _control_latents(self, pipe: FluxPipeline, unit: ControlUnit, width: int, height: int) -> np.ndarray:
        """The unit's image VAE-encoded (the posterior's mean), scaled and shifted, packed: [1, N, 4C]."""
        encoder = pipe.editor.encoder
        name = next(iter(encoder.inputs))
        pixels = prepare_image(unit, width, height)[None] * 2.0 - 1.0
        out = ENCODER_OUTPUT if ENCODER_OUTPUT in encoder.outputs else encoder.outputs[0]
        moments = run(encoder, {name: pixels}, [out], None)[0].astype(np.float32)
        g = pipe.geometry
        mean = moments[:, :g.latent_channels]
        latents = (mean - np.float32(g.shift_factor)) * np.float32(g.scaling_factor)
        return pack_latents(latents) if pipe.packed else latents

    def start(self, pipe: FluxPipeline, batch: Batch, state: DitDenoising) -> ControlRun:
        """The request's units on the device: control latents, scales and modes per row, activity per evaluation."""
        rows, tokens = int(state.model_in.shape()[0]), int(state.model_in.shape()[1])
        control = ControlRun()
        for k, unit in enumerate(batch.control):
            net = self.nets.get(unit.model)
            if net is None and unit.model in self.refused:
                raise InvalidRequestError(self.refused[unit.model], param="controlnet.model")
            if net is None:
                raise InvalidRequestError(f"unknown ControlNet {unit.model!r}; this server has "
                                          f"{sorted(self.nets) or 'none'}", param="controlnet.model")
            model = net.model
            cond = np.repeat(self._control_latents(pipe, unit, batch.width, batch.height), rows, axis=0)
            host: dict[str, np.ndarray] = {"controlnet_cond": cond,
                                           "conditioning_scale": np.full((rows,), unit.weight, np.float32)}
            if net.union:
                host["controlnet_mode"] = np.full((rows, 1), union_mode(unit), np.int64)
                host |= union_rope(pipe, state)
            feeds: dict[str, Feed] = {n: pipe.runtime.upload(f"flux_control{k}_{n}", v.astype(model.input_dtype(n)))
                                      for n, v in host.items()}
            keep = tuple(not (i / state.evaluations < unit.guidance_start
                              or (i + 1) / state.evaluations > unit.guidance_end) for i in range(state.evaluations))
            control.units.append(ActiveUnit(net, feeds, keep))
        if any(net.singles == 0 for net in (u.net for u in control.units)) and self.singles:
            inner = int(pipe.config["num_attention_heads"]) * int(pipe.config["attention_head_dim"])
            control.zeros = pipe.runtime.upload("flux_control_zeros", np.zeros((rows, tokens, inner), self.dtype))
        return control

    def run(self, pipe: FluxPipeline, state: DitDenoising, control: ControlRun, active: list[ActiveUnit]) -> None:
        """The state's next evaluation with its ``active`` units: their samples summed (by sample where the units'
        ControlNets have one depth, as FluxMultiControlNetModel; else per block), one per block into the residual
        transformer."""
        i = state.next_eval
        base: dict[str, Feed] = {"hidden_states": state.model_in, "timestep": state.timesteps[i], **state.feeds}
        rows, tokens = int(state.model_in.shape()[0]), int(state.model_in.shape()[1])
        inner = int(pipe.config["num_attention_heads"]) * int(pipe.config["attention_head_dim"])
        depths = {(unit.net.blocks, unit.net.singles) for unit in active}
        total: list[ort.OrtValue] = []
        for k, unit in enumerate(active):
            net = unit.net
            names = [f"{NET_BLOCK}{j}" for j in range(net.blocks)] + [f"{NET_SINGLE}{j}" for j in range(net.singles)]
            outputs = [pipe.runtime.buffer(f"flux_control_res{k % 2}_{j}", (rows, tokens, inner), self.dtype)
                       for j in range(len(names))]
            feeds = {n: base[n] for n in SHARED if n in net.model.inputs and n in base}
            net.model.run({"hidden_states": state.model_in, "timestep": state.timesteps[i],
                           "rope_cos": base["rope_cos"], "rope_sin": base["rope_sin"], **feeds, **unit.feeds},
                          dict(zip(names, outputs, strict=True)))
            mine = outputs if len(depths) == 1 else self._per_block(outputs[:net.blocks], outputs[net.blocks:],
                                                                     control.zeros)
            if not total:
                total = mine
                continue
            sums = [pipe.runtime.buffer(f"flux_control_sum{k % 2}_{j}", (rows, tokens, inner), self.dtype)
                    for j in range(len(mine))]  # FluxMultiControlNetModel: summed in unit order
            self.sums[len(mine)].run({**{f"a{j}": a for j, a in enumerate(total)},
                                      **{f"b{j}": b for j, b in enumerate(mine)}},
                                     {f"sum{j}": out for j, out in enumerate(sums)})
            total = sums
        if len(depths) == 1:
            blocks, _ = next(iter(depths))
            total = self._per_block(total[:blocks], total[blocks:], control.zeros)
        residuals = dict(zip([*self.blocks, *self.singles], total, strict=True))
        lora = self.lora(state.adapters)
        self.transformer.run({**base, **residuals}, {"out_hidden_states": state.model_out}, lora)
        if lora is not None and state.adapters is not None and self.transformer.component in lora.adapted:
            state.adapters.adapted.add(self.denoiser)  # the transformer ran with its LoRA (as the residual one)

    def _per_block(self, blocks: list[ort.OrtValue], singles: list[ort.OrtValue],
                   zeros: ort.OrtValue | None) -> list[ort.OrtValue]:
        """One residual per transformer block: diffusers' ``samples[k // ceil(blocks / len(samples))]``."""
        mapped = []
        for count, samples in ((len(self.blocks), blocks), (len(self.singles), singles)):
            if not samples:
                assert zeros is not None or count == 0
                mapped += [zeros] * count
                continue
            mapped += [samples[j] for j in block_sources(count, len(samples))]
        return [value for value in mapped if value is not None]


def block_sources(blocks: int, samples: int) -> list[int]:
    """Which of a ControlNet's ``samples`` each of ``blocks`` transformer blocks adds: diffusers'
    ``index_block // ceil(blocks / samples)`` (FLUX.1 dev's 19 double blocks take InstantX's 5 samples four at a
    time, the last block the fifth)."""
    interval = ceil(blocks / samples)
    return [k // interval for k in range(blocks)]


def union_rope(pipe: FluxPipeline, state: DitDenoising) -> dict[str, np.ndarray]:
    """The union kind's rope tables: its mode token leads the text tokens, all at position zero (diffusers'
    ``txt_ids[:1]`` prepended), then the packed image tokens: the pipeline's own tables for one more text token."""
    states = state.feeds["encoder_hidden_states"]
    text = int((states.shape() if isinstance(states, ort.OrtValue) else states.shape)[1])
    longer = DitConditioning(np.zeros((1, text + 1, 1), np.float32), None, (), ())  # position_feeds reads its length
    tables: dict[str, np.ndarray] = pipe.position_feeds(longer, *state.latent_size)
    return tables


def union_mode(unit: ControlUnit) -> int:
    """The union ControlNet's mode of ``unit`` (InstantX: canny 0, tile 1, depth 2, blur 3, pose 4, gray 5, low
    quality 6): the unit's ``union_mode``, else 0."""
    return int(unit.union_mode or 0)


def start(pipe: FluxPipeline, batch: Batch, state: DitDenoising) -> None:
    """Give ``state`` the request's control set (nothing without units). InvalidRequestError when the pipeline
    serves no ControlNet, or with a LoRA on the transformer while the residual transformer has no LoRA variant (a
    server whose boot did not attach it: FluxControlNets.attach_lora), a step cache or reference images."""
    if not batch.control:
        return
    controls: FluxControlNets | None = getattr(pipe, "controls", None)
    if controls is None:
        raise InvalidRequestError("this model serves no ControlNet (no ControlNet folder or no "
                                  "transformer_controlnet/model.onnx)", param="controlnet")
    if state.adapters is not None and state.adapters.of(controls.denoiser) and controls.transformer.variant is None:
        raise InvalidRequestError("ControlNet with a LoRA on the transformer is not served by this server (the "
                                  "residual transformer has no LoRA variant)", param="controlnet")
    if state.cache is not None or state.first_block is not None:
        raise InvalidRequestError("the step cache is not served with ControlNet", param="cache")
    if state.extra is not None:
        raise InvalidRequestError("ControlNet is not served with reference images", param="controlnet")
    setattr(state, STATE_KEY, controls.start(pipe, batch, state))


def run_controlled(pipe: FluxPipeline, states: Sequence[DitDenoising]) -> list[DitDenoising]:
    """Run the evaluation of every state with a unit active at its next step (one call set per state); the others
    are returned for the plain joined call."""
    plain = []
    for state in states:
        control: ControlRun | None = getattr(state, STATE_KEY, None)
        active = [u for u in control.units if u.keep[state.next_eval]] if control is not None else []
        if not active:
            plain.append(state)
            continue
        pipe.controls.run(pipe, state, control, active)
    return plain


def attach(pipe: FluxPipeline, folder: Path, nets: dict[str, Path], label: str = "") -> FluxControlNets:
    """Give ``pipe`` (a FluxPipeline loaded from ``folder``) the ControlNets ``nets`` (name -> exported folder)."""
    controls = FluxControlNets(pipe, folder, nets, label)
    pipe.controls = controls
    return controls
