"""First-block cache for the DiT families (Flux.1, SD 3 / 3.5) on ONNX Runtime, without torch: the decision and
the skip of diffusers' ``apply_first_block_cache`` (diffusers/hooks/first_block_cache.py, 0.42), per request.

The transformer comes in three parts (engines/build/dit_split.py writes them, ``export_dit(first_block=True)``):
``transformer_first`` runs the embeddings and the first block and gives the first block's hidden-state residual
(its output minus its input); ``transformer_rest`` runs every later block and the head and gives the tail residual
(last block's hidden output minus the first block's); ``transformer_skip`` is the head applied to ``first block
output + cached tail residual``, which is what the model computes on a skipped step once the hook has let every
later block pass its input through.

The decision, as the hook's ``_should_compute_remaining_blocks``: the first evaluation of a request always runs
the rest; later, ``mean|r - r_prev| / mean|r_prev|`` over the whole batch tensor (every row of the request, CFG's
negative rows included, as diffusers' one transformer call sees them), where ``r_prev`` is the residual of the last
evaluation that *ran* the rest (a skip leaves it as it was); the rest runs when the ratio is above the threshold.
The two means are reduced on the device by a small graph; only those two float32 scalars come to the host. The
ratio is divided in float32, as torch divides the two means.

Per request (``FirstBlockState``): two residual buffers (current, previous; swapped when the rest ran) and the tail
residual, all on the device, allocated by ``FirstBlockRunner.start`` under the request's Runtime scope. The
intermediates of one evaluation (the first block's hidden and encoder states and the embedded ``temb``) live only
within ``run`` and are shared buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from engines.errors import InferenceError, ModelLoadError
from engines.lora.active import Adapters
from engines.numerics.step_graph import elem_type, serialize
from engines.pipelines.ort_model import Feed, OrtModel
from engines.pipelines.unet_family import read_json
from engines.runtime.sessions import Runtime, numpy_dtype

FIRST = "transformer_first"
REST = "transformer_rest"
SKIP = "transformer_skip"
PARTS = (FIRST, REST, SKIP)
"""Folders of the parts, each with a ``model.onnx``."""
MID = ("first_hidden_states", "first_encoder_hidden_states", "temb")
"""What the first part hands to the rest (and, but for the encoder states, to the skip head)."""


NONE = ("the first-block step cache needs the transformer exported in parts (`sdserve engines export "
        "--first-block`); this model has none: use method 'output'")
"""Why ``cache.method = "first-block"`` is refused by a model whose folder holds no parts."""
UNSERVED = ("the first-block step cache is not served for {family}: its transformer is not exported in parts; use "
            "method 'output'")
PREBUILT = ("this model has the first-block cache's transformer parts, but this profile serves the transformer "
            "from prebuilt engines ({what}) that do not cover them, and the parts are not loaded beside those "
            "engines (they would be a second, uncounted copy of the transformer's weights on the device): the "
            "first-block cache needs the parts on the CUDA provider (a profile without TensorRT artifacts, e.g. "
            "--profile cuda); use method 'output'")


@dataclass(frozen=True)
class PartsDecision:
    """Whether a pipeline loads the first-block cache's parts, and, when not, what a request for the cache is told."""

    present: bool
    """The folder holds all three parts."""
    load: bool
    refusal: str = ""
    """The 422 message of a ``first-block`` request when not loaded ("" when loaded)."""


def decide_parts(folder: Path, family: str, served: bool, prebuilt: str = "") -> PartsDecision:
    """The one rule for the parts (FlowPipeline loads by it, engines/health/memory_plan.py counts by it): loaded
    when the family serves them (``served``), the folder holds them and the transformer does not come from prebuilt
    engines that leave them out (``prebuilt``: what those are, "" when nothing is prebuilt or the prebuilt set
    covers the parts). Never loaded silently beside such engines: the refusal says they exist and why unused."""
    present = all((folder / part / "model.onnx").is_file() for part in PARTS)
    if not served:
        return PartsDecision(present, False, UNSERVED.format(family=family))
    if not present:
        return PartsDecision(False, False, NONE)
    if prebuilt:
        return PartsDecision(True, False, PREBUILT.format(what=prebuilt))
    return PartsDecision(True, True)


def build_change_graph(dtype: type[np.generic]) -> bytes:
    """``change`` float32 [2]: (mean |residual - previous|, mean |previous|) over every element, in float32."""
    f32, elem = TensorProto.FLOAT, elem_type(dtype)
    names = {"residual": "residual", "previous": "previous"}
    nodes = []
    if elem != f32:
        nodes += [helper.make_node("Cast", [n], [f"{n}_f"], to=f32) for n in names]
        names = {n: f"{n}_f" for n in names}
    nodes += [helper.make_node("Sub", [names["residual"], names["previous"]], ["delta"]),
              helper.make_node("Abs", ["delta"], ["delta_abs"]),
              helper.make_node("ReduceMean", ["delta_abs"], ["delta_mean"], keepdims=1),
              helper.make_node("Abs", [names["previous"]], ["previous_abs"]),
              helper.make_node("ReduceMean", ["previous_abs"], ["previous_mean"], keepdims=1),
              helper.make_node("Concat", ["delta_mean", "previous_mean"], ["both"], axis=0),
              helper.make_node("Reshape", ["both", "two"], ["change"])]
    two = helper.make_tensor("two", TensorProto.INT64, [1], [2])
    inputs = [helper.make_tensor_value_info(n, elem, ["B", "T", "D"]) for n in ("residual", "previous")]
    return serialize(nodes, "sdserve_first_block_change", inputs,
                     [helper.make_tensor_value_info("change", f32, [2])], [two])


@dataclass
class FirstBlockState:
    """One request's first-block cache: its threshold, residuals on the device and what it decided."""

    threshold: float
    residuals: list[ort.OrtValue]
    """[current, previous]: the first part writes the current one; swapped when the rest ran."""
    tail: ort.OrtValue
    """The tail residual of the last evaluation that ran the rest."""
    has_previous: bool = False
    computed: int = 0
    """Evaluations that ran the remaining blocks."""
    reused: int = 0
    """Evaluations that reused the cached tail residual (skipped the remaining blocks)."""
    ratios: list[float] = field(default_factory=list)
    """Per evaluation, the relative change the decision read (NaN for the first, which always computes)."""


class FirstBlockRunner:
    """Runs one DiT transformer evaluation of a request through the parts, skipping the remaining blocks when the
    first block's residual barely changed (the module docstring)."""

    @staticmethod
    def available(folder: Path) -> bool:
        """Whether ``folder`` holds the parts (``export_dit(first_block=True)``)."""
        return all((folder / part / "model.onnx").is_file() for part in PARTS)

    def __init__(self, folder: Path, runtime: Runtime, label: str = "",
                 sources: dict[str, Path] | None = None) -> None:
        """ModelLoadError when a part is missing or its IO is not the split's; ``sources``: per part, the model to
        load instead of ``<part>/model.onnx`` (prebuilt EP-context models), as FlowPipeline takes them."""
        if not self.available(folder):
            missing = [p for p in PARTS if not (folder / p / "model.onnx").is_file()]
            raise ModelLoadError(f"{folder} has no {', '.join(missing)} (the first-block cache's parts: "
                                 "`sdserve engines export --first-block`)")
        given = sources or {}
        self.runtime = runtime
        self.first, self.rest, self.skip = (OrtModel(runtime, given.get(p, folder / p / "model.onnx"), p + label)
                                            for p in PARTS)
        self._check_io()
        residual = self.first.output_types["first_residual"]
        self.residual_dtype = numpy_dtype(residual)
        self.change = OrtModel(runtime, build_change_graph(self.residual_dtype), "first_block_change" + label)
        self.patch = int(read_json(folder / "transformer" / "config.json").get("patch_size", 1))
        shape = next(o.shape for o in self.first.session.get_outputs() if o.name == "first_residual")
        if not isinstance(shape[-1], int):
            raise ModelLoadError(f"{folder / FIRST}: first_residual's width is not static ({shape})")
        self.width = shape[-1]

    def _check_io(self) -> None:
        expected = {self.first: [*MID, "first_residual"], self.rest: ["out_hidden_states", "tail_residual"],
                    self.skip: ["out_hidden_states"]}
        for model, outputs in expected.items():
            if sorted(model.outputs) != sorted(outputs):
                raise ModelLoadError(f"{model.name}: outputs {model.outputs}, expected {outputs} (re-export the "
                                     "parts with `sdserve engines export --first-block`)")

    def start(self, model_in: ort.OrtValue, threshold: float) -> FirstBlockState:
        """A request's state for the transformer input ``model_in`` (Flux [rows, tokens, C]; SD 3 [rows, C, H,
        W]): its residual and tail buffers on the device, under the Runtime's current (the request's) scope."""
        if not threshold >= 0.0:
            raise ValueError(f"first-block cache threshold {threshold} must be >= 0")
        shape = self._residual_shape(model_in)
        buf = self.runtime.buffer
        return FirstBlockState(threshold, [buf("fbc_residual0", shape, self.residual_dtype),
                                           buf("fbc_residual1", shape, self.residual_dtype)],
                               buf("fbc_tail", shape, numpy_dtype(self.rest.output_types["tail_residual"])))

    def _residual_shape(self, model_in: ort.OrtValue) -> tuple[int, int, int]:
        dims = model_in.shape()
        if len(dims) == 3:  # Flux: packed tokens
            return dims[0], dims[1], self.width
        return dims[0], (dims[2] // self.patch) * (dims[3] // self.patch), self.width

    def run(self, state: Any) -> bool:
        """One transformer evaluation of ``state`` (a DitDenoising with ``first_block`` set) at its next step,
        written into ``state.model_out``; True when the remaining blocks were skipped."""
        cache: FirstBlockState = state.first_block
        adapters: Adapters | None = state.adapters
        if adapters is not None and adapters.of("transformer") is not None:
            raise InferenceError("the first-block cache runs the base transformer: a request with LoRA weights on "
                                 "the transformer must not use it")
        feeds: dict[str, Feed] = {"hidden_states": state.model_in, "timestep": state.timesteps[state.next_eval],
                                  **{k: v for k, v in state.feeds.items() if k in self.first.inputs}}
        mid = self._mid(cache.residuals[0], state.feeds["encoder_hidden_states"])
        self.first.run(feeds, {**mid, "first_residual": cache.residuals[0]})
        skip = self._decide(cache)
        latents = {} if "hidden_states" not in self.rest.inputs else {"hidden_states": state.model_in}
        if skip:
            self.skip.run({"first_hidden_states": mid["first_hidden_states"], "tail_residual": cache.tail,
                           "temb": mid["temb"], **latents}, {"out_hidden_states": state.model_out})
            cache.reused += 1
            return True
        extra = {k: state.feeds[k] for k in self.rest.inputs if k in state.feeds}
        self.rest.run({**mid, **extra, **latents}, {"out_hidden_states": state.model_out,
                                                    "tail_residual": cache.tail})
        cache.residuals.reverse()  # this residual is the one the next decisions compare with
        cache.has_previous = True
        cache.computed += 1
        return False

    def _mid(self, residual: ort.OrtValue, text: Feed) -> dict[str, ort.OrtValue]:
        """Buffers for the first part's hand-over: hidden as the residual, encoder [rows, text tokens, width]."""
        rows, tokens, width = residual.shape()
        text_tokens = text.shape()[1] if isinstance(text, ort.OrtValue) else text.shape[1]
        shapes = {"first_hidden_states": (rows, tokens, width),
                  "first_encoder_hidden_states": (rows, text_tokens, width), "temb": (rows, width)}
        return {name: self.runtime.buffer(f"fbc_{name}", shape, numpy_dtype(self.first.output_types[name]))
                for name, shape in shapes.items()}

    def _decide(self, cache: FirstBlockState) -> bool:
        """True to skip: the relative change of the first block's residual is not above the threshold."""
        if not cache.has_previous:
            cache.ratios.append(math.nan)
            return False
        host, out = self.runtime.staging("fbc_change", (2,), np.float32)
        self.change.run({"residual": cache.residuals[0], "previous": cache.residuals[1]}, {"change": out})
        with np.errstate(divide="ignore", invalid="ignore"):  # 0/0 is NaN (a skip), x/0 inf, as in torch
            ratio = float(np.float32(host[0]) / np.float32(host[1]))
        cache.ratios.append(ratio)
        return not ratio > cache.threshold
