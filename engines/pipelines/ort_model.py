"""One component session with IO binding (``OrtModel``), used by every pipeline: IO names, ranks and dtypes come
from the session; a batch's LoRA weights are bound on its variant; a preallocated output's element type checked."""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import numpy as np
import onnxruntime as ort

from engines.artifacts import MANIFEST, TRT_DIR, read_manifest
from engines.errors import InferenceError
from engines.lora.active import Adapters
from engines.numerics.rows import ShapeFeed
from engines.runtime.sessions import Runtime, numpy_dtype

Feed: TypeAlias = ort.OrtValue | np.ndarray


class OrtModel:
    """One component session; IO names, ranks and dtypes come from the session, never hard-coded."""

    def __init__(self, runtime: Runtime, model: Path | bytes, name: str, fp32: bool = False,
                 extra: dict[str, str] | None = None) -> None:
        """``fp32``: TensorRT may not pick fp16 kernels for this component (Runtime.session); ``extra``: more
        session config entries."""
        self.name = name
        self.component = name.split("@")[0]
        """The name without a size label (``unet@512x512`` -> ``unet``): the key of a batch's LoRA weights."""
        self.runtime = runtime
        self.source = model
        """The model file (or in-process graph) the session loaded: what placement is judged against."""
        self.session = runtime.session(model, name, extra=extra, fp32=fp32)
        self.variant: OrtModel | None = None
        """The LoRA variant (engines/lora/targets.py): the same graph with its adaptable weights overridable. A
        batch with LoRA weights for this component runs on it with them bound; every other batch on ``session``."""
        self.provider = str(self.session.get_providers()[0])
        """The provider this session runs on first (get_providers() after the policy's checks)."""
        self.ran_on = self.provider
        """The provider of the session the last run used: the variant's for a batch with LoRA weights (the variant
        is built in process, so under a TensorRT policy it runs on CUDA: engines/runtime/sessions.session_providers),
        which is what ``x-sdserve-provider`` must name."""
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}

    def input_dtype(self, name: str) -> type[np.generic]:
        return numpy_dtype(self.inputs[name].type)

    def output_dtype(self, index: int = 0) -> type[np.generic]:
        return numpy_dtype(self.session.get_outputs()[index].type)

    def bound(self, adapters: Adapters | None = None) -> tuple[ort.InferenceSession, ort.IOBinding]:
        """The session this batch runs on and a binding with its LoRA weights bound: the variant with the batch's
        merged weights when ``adapters`` has some for this component, else the base session. The adaptable
        components of every pipeline are run with the batch's adapters, and the run is recorded in them, so no
        component can run its base weights while the response and the signed manifest say its LoRA applied."""
        weights = adapters.of(self.component) if adapters is not None and self.variant is not None else None
        ran = self.variant if weights is not None and self.variant is not None else self
        self.ran_on = ran.provider
        if weights is not None and adapters is not None:
            adapters.adapted.add(self.component)
        binding = ran.session.io_binding()
        for name, weight in (weights or {}).items():  # this batch's merged LoRA weights, never the base's
            binding.bind_ortvalue_input(name, weight)
        return ran.session, binding

    def run(self, feeds: dict[str, Feed], outputs: dict[str, ort.OrtValue], adapters: Adapters | None = None) -> None:
        """One call through IO binding; ``adapters``: the batch's LoRA weights (the adaptable components only)."""
        session, binding = self.bound(adapters)
        for name, value in feeds.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:  # a host feed: copied to the device by this run (per request only, never per step)
                host = np.require(value, requirements="C")  # keeps rank 0
                binding.bind_cpu_input(name, host.view(np.ndarray))
                if not isinstance(value, ShapeFeed):  # a shape is read where it lies: no copy to stage
                    self.runtime.note_host_read(f"{self.name}:{name}", host)
        for name, value in outputs.items():
            check_output_type(self.name, name, value.data_type(), self.output_types.get(name, ""))
            binding.bind_ortvalue_output(name, value)
        self.runtime.run(session, binding, self.component, outputs)  # a large batch's decode trims the arena


def check_output_type(component: str, name: str, bound: str, declared: str) -> None:
    """A preallocated output must have the element type the session writes. ORT checks a bound output's shape,
    not its type, and TensorRT writes through the raw pointer: a float32 result in a float16 buffer (a text encoder
    whose output dtype differs from the UNet's hidden dtype) would corrupt memory silently."""
    if declared and bound != declared:
        raise InferenceError(f"{component}: output {name!r} is bound to a {bound} buffer but the session writes "
                             f"{declared}: refusing to run (a buffer of another element type is corrupted, not "
                             "converted)")


def tensorrt_fp16(session: ort.InferenceSession) -> bool:
    """Whether the session runs on TensorRT with ``trt_fp16_enable`` on (its provider options as ORT reports them)."""
    options = session.get_provider_options().get("TensorrtExecutionProvider")
    return options is not None and str(options.get("trt_fp16_enable", "0")).lower() in ("1", "true")


def built_fp16(source: Path | bytes, component: str) -> bool:
    """Whether a prebuilt TensorRT engine (``trt/<WxH>/<component>_ctx.onnx``) was built with fp16 for this
    component: its engine manifest's build_flags say fp16 and do not list it in fp32_components (engines built
    before that list existed included)."""
    if not isinstance(source, Path) or source.parent.parent.name != TRT_DIR or \
            not (source.parent.parent / MANIFEST).is_file():
        return False
    flags = read_manifest(source.parent.parent / MANIFEST).get("build_flags", {})
    return bool(flags.get("fp16")) and component not in flags.get("fp32_components", [])
