"""Output-level step cache for every family: a request's denoiser evaluation is skipped, and its last output
reused, while the output is estimated to have barely changed (no model split, so one session per denoiser,
TensorRT engines included).

The decision is EasyCache's "transformation rate" rule (Zhou et al. 2025, "Less is Enough: Training-Free Video
Diffusion Acceleration via Runtime-Adaptive Caching"), with mean absolute values as the norm, as ComfyUI's
EasyCache node and stable-diffusion.cpp's ``easycache`` apply it:

- at every computed evaluation ``i`` the rate ``k = |out_i - out_last| / |in_i - in_(i-1)|`` (the output's change
  since the last computed evaluation over the input's change in one evaluation) and ``|out_i|`` are recorded;
- at a later evaluation the output's relative change is estimated as ``k * |in_j - in_(j-1)| / |out_last|`` and
  accumulated since the last computed evaluation; while the sum stays under the threshold the evaluation reuses;
- the first ``warmup`` fraction of evaluations (at least two: the rate needs two computed ones) and the last
  ``final`` fraction (at least one) are always computed, and at most ``max_reuse`` evaluations in a row reuse.

One deliberate difference: a reused evaluation takes the last output as it is, not EasyCache's ``in_j + (out_last
- in_last)``. The served denoisers predict noise, velocity or v (epsilon / flow / v-prediction), which change slowly
along the trajectory, while their input (the noisy latents) moves by the whole step: adding the input's change
would carry the step's move into the prediction. Keeping the output also costs nothing: the reusing row's output
buffer still holds it, so the row is simply left out of the tick's denoiser call (step-level batching included).

A request decides as a whole: the norms run over all its rows (CFG's two halves and every image), as diffusers'
cache hooks do over the batch tensor. Each decision costs one small graph (Sub, Abs, ReduceMean on the device) and
two float32 scalars brought to the host per evaluation: the only per-tick host copies of a cached request.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from onnx import helper

from engines.numerics.step_graph import elem_type, serialize
from engines.types.request import CacheUse, StepCache


def build_probe_graph(dtype: type[np.generic]) -> bytes:
    """``a``, ``b`` (any shape, ``dtype``) -> ``change`` = mean|a - b| and ``norm`` = mean|a| (float32 scalars),
    and ``copy`` = a (the value the next evaluation compares against)."""
    elem = elem_type(dtype)
    f32 = elem_type(np.float32)
    inputs = [helper.make_tensor_value_info("a", elem, None), helper.make_tensor_value_info("b", elem, None)]
    outputs = [helper.make_tensor_value_info("change", f32, []), helper.make_tensor_value_info("norm", f32, []),
               helper.make_tensor_value_info("copy", elem, None)]
    cast = [] if elem == f32 else [helper.make_node("Cast", ["a"], ["a32"], to=f32),
                                   helper.make_node("Cast", ["b"], ["b32"], to=f32)]
    a, b = ("a", "b") if elem == f32 else ("a32", "b32")
    nodes = [*cast,
             helper.make_node("Sub", [a, b], ["diff"]),
             helper.make_node("Abs", ["diff"], ["absdiff"]),
             helper.make_node("ReduceMean", ["absdiff"], ["change"], keepdims=0),
             helper.make_node("Abs", [a], ["absa"]),
             helper.make_node("ReduceMean", ["absa"], ["norm"], keepdims=0),
             helper.make_node("Identity", ["a"], ["copy"])]
    return serialize(nodes, "sdserve_cache_probe", inputs, outputs, [])


class Runnable(Protocol):
    def run(self, feeds: dict[str, Any], outputs: dict[str, ort.OrtValue], adapters: Any = None) -> None: ...


@dataclass
class Probe:
    """One probe session per element type (the denoiser's input and output types may differ)."""

    sessions: dict[str, Runnable]

    @classmethod
    def build(cls, make: Callable[[bytes, str], Runnable], dtypes: Sequence[type[np.generic]]) -> Probe:
        return cls({np.dtype(d).name: make(build_probe_graph(d), f"cache_probe_{np.dtype(d).name}")
                    for d in dict.fromkeys(np.dtype(d).type for d in dtypes)})

    def measure(self, value: ort.OrtValue, ring: list[ort.OrtValue], host: np.ndarray,
                scalars: dict[str, ort.OrtValue]) -> tuple[float, float]:
        """(mean|value - ring[0]|, mean|value|) through ``scalars`` (OrtValues over ``host[0]``, ``host[1]``);
        ``value`` is copied into ring[1] and the ring turns, so ring[0] holds it for the next measure."""
        session = self.sessions[np.dtype(_dtype_of(value)).name]
        session.run({"a": value, "b": ring[0]}, {**scalars, "copy": ring[1]})
        ring.reverse()
        return float(host[0]), float(host[1])


def _dtype_of(value: ort.OrtValue) -> type[np.generic]:
    return np.float16 if value.data_type() == "tensor(float16)" else np.float32


def _scalar(host: np.ndarray, index: int) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(host[index:index + 1].reshape(()))


@dataclass
class OutputCache:
    """One request's output-level cache state (engines/numerics/step_cache.py): its buffers live on the device
    under the request's scope, its decisions are made on two host scalars per evaluation."""

    spec: StepCache
    evaluations: int
    probe: Probe
    inputs: list[ort.OrtValue]
    """[previous evaluation's input, scratch]: turned by every measure."""
    outputs: list[ort.OrtValue]
    """[last computed output, scratch]."""
    host: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.float32))
    rate: float | None = None
    """``k``: the output's change over the input's at the last computed evaluation (None until two ran)."""
    out_norm: float = 0.0
    input_change: float | None = None
    accumulated: float = 0.0
    consecutive: int = 0
    reused: int = 0
    decisions: list[bool] = field(default_factory=list)
    """Per evaluation decided so far: True where the last output was reused."""
    seen_input: bool = False
    seen_output: bool = False
    scalars: dict[str, ort.OrtValue] = field(default_factory=dict)
    """The probe's two outputs over ``host``, made once per request (not per evaluation)."""

    def __post_init__(self) -> None:
        self.scalars = {"change": _scalar(self.host, 0), "norm": _scalar(self.host, 1)}

    @classmethod
    def start(cls, spec: StepCache, evaluations: int, probe: Probe, model_in: ort.OrtValue,
              model_out: ort.OrtValue, buffer: Callable[[str, tuple[int, ...], type[np.generic]], ort.OrtValue]
              ) -> OutputCache:
        """The cache for one request, its comparison buffers allocated now (under the request's scope)."""
        shape_in, shape_out = tuple(model_in.shape()), tuple(model_out.shape())
        d_in, d_out = _dtype_of(model_in), _dtype_of(model_out)
        return cls(spec, evaluations, probe,
                   [buffer(f"cache_in{k}", shape_in, d_in) for k in range(2)],
                   [buffer(f"cache_out{k}", shape_out, d_out) for k in range(2)])

    def forced(self, i: int) -> bool:
        """Evaluations always computed: the warm-up (at least 2), the last ones (at least 1), after
        ``max_reuse`` reuses in a row, and while the rate is unknown."""
        warmup = max(2, math.ceil(self.spec.warmup * self.evaluations))
        final = max(1, math.ceil(self.spec.final * self.evaluations))
        return i < warmup or i >= self.evaluations - final or self.consecutive >= self.spec.max_reuse or \
            self.rate is None or self.out_norm <= 0.0

    def reuse(self, i: int, model_in: ort.OrtValue) -> bool:
        """Decide evaluation ``i`` before the denoiser call: True reuses the last output (the caller leaves this
        request out of the call)."""
        change, _ = self.probe.measure(model_in, self.inputs, self.host, self.scalars)
        self.input_change = change if self.seen_input else None
        self.seen_input = True
        skip = False
        if not self.forced(i) and self.rate is not None:
            self.accumulated += self.rate * change / self.out_norm
            skip = self.accumulated < self.spec.threshold
        if skip:
            self.consecutive += 1
            self.reused += 1
        else:
            self.accumulated = 0.0
            self.consecutive = 0
        self.decisions.append(skip)
        return skip

    def computed(self, model_out: ort.OrtValue) -> None:
        """After the denoiser wrote this request's output: the rate and the output norm for later decisions."""
        change, norm = self.probe.measure(model_out, self.outputs, self.host, self.scalars)
        if self.seen_output and self.input_change:
            self.rate = change / self.input_change
        self.seen_output = True
        self.out_norm = norm

    def use(self) -> CacheUse:
        return CacheUse(self.spec, self.reused, len(self.decisions))


def partition(states: Sequence[Any]) -> list[Any]:
    """The states whose next evaluation runs the denoiser: each cached state decides now (a reusing one keeps its
    output buffer as it is and is left out of the call)."""
    return [s for s in states if s.cache is None or not s.cache.reuse(s.next_eval, s.model_in)]


def record(states: Sequence[Any]) -> None:
    """After the denoiser call: each cached state that ran records its output's change."""
    for s in states:
        if s.cache is not None:
            s.cache.computed(s.model_out)


def cache_use(state: Any) -> CacheUse | None:
    cache = getattr(state, "cache", None)
    return cache.use() if isinstance(cache, OutputCache) else None
