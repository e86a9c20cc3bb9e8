"""Extra latent tokens beside the noisy ones in every transformer call: the reference latents of instruction edits
(FLUX.1 Kontext: engines/pipelines/kontext.py; Qwen-Image-Edit), as diffusers' FluxKontextPipeline and
QwenImageEditPipeline (0.42) concatenate them with the latents along the token axis and drop the transformer's
output for them.

A pipeline returns them from its ``extra_tokens`` hook (engines/pipelines/flow.py) once per request: ``ExtraTokens``
holds per image the tokens (already scaled and packed as the transformer takes them) and their position ids, and
whether they go before or after the noisy tokens. ``FlowPipeline.begin`` puts them on the device once (repeated for
classifier-free guidance's rows) and hands them to ``position_feeds`` through ``DitConditioning.extra``; at every
evaluation ``ExtraJoin`` concatenates them with the transformer input (one ``Concat`` call) and copies the noisy
tokens' part of the output into the step's output (one ``Slice`` call), so the step graph, the step caches and the
row joins keep seeing the noisy tokens only. Rows with different extra tokens (another count or other ids: other
rope tables) never share a call: ``ExtraTokens.key`` tells them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, ValueInfoProto, helper

from engines.numerics.rows import Buffers, Runnable, shape_feed
from engines.numerics.step_graph import elem_type, serialize
from engines.runtime.sessions import Runtime


@dataclass(frozen=True)
class ExtraTokens:
    """One batch's extra latent tokens, from a pipeline's ``extra_tokens`` hook."""

    tokens: np.ndarray
    """float32 [images, extra, channels]: each image's extra tokens as the transformer takes them (packed)."""
    ids: np.ndarray
    """float32 [extra, axes]: their position ids, the same for every image of the batch (the rope tables are
    per batch)."""
    prepend: bool = False
    """Before the noisy tokens (else after them, as FLUX.1 Kontext and Qwen-Image-Edit put them)."""

    @property
    def key(self) -> Hashable:
        """What rows sharing one transformer call must have equal: the count, the ids and the side."""
        return self.tokens.shape[1:], self.ids.tobytes(), self.prepend

    def positions(self, noisy: np.ndarray) -> np.ndarray:
        """The position ids of the whole image sequence: ``noisy``'s with the extra ones on their side."""
        parts = [self.ids.astype(noisy.dtype), noisy] if self.prepend else [noisy, self.ids.astype(noisy.dtype)]
        return np.concatenate(parts)


@dataclass(frozen=True)
class ExtraState:
    """A running request's extra tokens on the device."""

    tokens: ort.OrtValue
    """[rows, extra, channels] in the transformer's input type (rows: the transformer input's, CFG's included)."""
    key: Hashable
    prepend: bool


class _Running(Protocol):
    @property
    def extra(self) -> ExtraState | None: ...


Running = TypeVar("Running", bound=_Running)


def by_extra(states: Sequence[Running]) -> list[list[Running]]:
    """The states grouped by their extra tokens' key (none: one group), in order: one transformer call each."""
    groups: dict[Hashable, list[Running]] = {}
    for state in states:
        groups.setdefault(state.extra.key if state.extra is not None else None, []).append(state)
    return list(groups.values())


def _tokens(dtype: type[np.generic], name: str) -> ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type(dtype), ["rows", f"{name}_tokens", "channels"])


class ExtraJoin:
    """The token-axis join of the transformer input and the strip of its output, sessions built at load."""

    def __init__(self, make: Callable[[bytes, str], Runnable], buffers: Buffers, model_in: type[np.generic],
                 model_out: type[np.generic]) -> None:
        self.buffers, self.model_in, self.model_out = buffers, model_in, model_out
        self._join = make(serialize([helper.make_node("Concat", ["a", "b"], ["out"], axis=1)], "sdserve_tokens_join",
                                    [_tokens(model_in, "a"), _tokens(model_in, "b")], [_tokens(model_in, "out")], []),
                          "flow_tokens_join")
        bounds = [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("starts", "ends")]
        axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
        self._strip = make(serialize([helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["out"])],
                                     "sdserve_tokens_strip", [_tokens(model_out, "x"), *bounds],
                                     [_tokens(model_out, "out")], [axes]), "flow_tokens_strip")

    def upload(self, runtime: Runtime, extra: ExtraTokens, copies: int) -> ExtraState:
        """The batch's extra tokens on the device, repeated for ``copies`` (CFG's negatives first, as the input)."""
        host = np.concatenate([extra.tokens] * copies).astype(self.model_in)
        return ExtraState(runtime.upload("dit_extra_tokens", host), extra.key, extra.prepend)

    def join(self, hidden: ort.OrtValue, extra: ort.OrtValue, prepend: bool) -> ort.OrtValue:
        """The transformer input with the extra tokens on their side."""
        rows, tokens, channels = hidden.shape()
        out = self.buffers.buffer("dit_extra_in", (rows, tokens + extra.shape()[1], channels), self.model_in)
        a, b = (extra, hidden) if prepend else (hidden, extra)
        self._join.run({"a": a, "b": b}, {"out": out})
        return out

    def output(self, noisy_out: ort.OrtValue, extra: ort.OrtValue) -> ort.OrtValue:
        """A buffer for the transformer's output over the whole sequence."""
        rows, tokens, channels = noisy_out.shape()
        return self.buffers.buffer("dit_extra_out", (rows, tokens + extra.shape()[1], channels), self.model_out)

    def strip(self, full: ort.OrtValue, into: ort.OrtValue, prepend: bool) -> None:
        """Copy the noisy tokens' part of ``full`` into ``into`` (the extra tokens' output is dropped)."""
        tokens, extra = into.shape()[1], full.shape()[1] - into.shape()[1]
        start = extra if prepend else 0
        self._strip.run({"x": full, "starts": shape_feed([start]), "ends": shape_feed([start + tokens])},
                        {"out": into})
