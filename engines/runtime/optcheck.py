"""Provider options through ONNX Runtime's real option parser, on any machine, GPU or not.

Why: an option dict that only a test asserts can be wrong in a way nothing shows until a GPU node boots. ORT's
Python binding parses the TensorRT provider's options itself, *before* the provider library loads
(``CreateExecutionProviderFactoryInstance`` in onnxruntime/python/onnxruntime_pybind_state.cc): an unknown key raises
``Invalid TensorRT EP option: <key>`` and a bad value raises too (``trt_fp16_enable=maybe``), on a CPU machine as on
a GPU node. A key the parser knows gets past it and the session fails later, only at library loading (a WARNING,
and the session is built on what remains). So the two outcomes tell a bad option from a missing library.

How: the same two calls the Python wrapper makes (onnxruntime/python/onnxruntime_inference_collection.py,
``InferenceSession._create_inference_session``): ``C.InferenceSession(options, model_bytes, False, False)`` then
``initialize_session(providers, provider_options, set())``, on a probe model whose inputs have the component's
names, element types and ranks (so the profile shapes name real inputs), each read by one Identity node. What the
wrapper does first, ``_register_ep_custom_ops`` (it loads the TensorRT plugin library and raises "Please install
TensorRT libraries" where there is none), is not part of option parsing and is not called.

The CUDA provider's options are parsed inside its provider library (``CUDAExecutionProviderInfo::FromProviderOptions``
in onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc, reached through the provider bridge), which a
machine without CUDA cannot load: the Python binding passes any key through. Those keys are checked here against
the names that file parses (``CUDA_OPTION_KEYS``), and the values against its enumerations; on a GPU node the real
parser decides as well.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx.helper as oh
import onnxruntime as ort
from onnxruntime.capi import _pybind_state as C

from engines.runtime.ortlog import capture_ort_output
from engines.types.snapshot import OrtEvent

TRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
PROBE_IR_VERSION = 9
"""onnx's default IR version is newer than ORT 1.31.1 loads; 9 is one it does."""

CUDA_OPTION_KEYS = frozenset({
    "device_id", "has_user_compute_stream", "user_compute_stream", "gpu_mem_limit", "arena_extend_strategy",
    "cudnn_conv_algo_search", "do_copy_in_default_stream", "gpu_external_alloc", "gpu_external_free",
    "gpu_external_empty_cache", "cudnn_conv_use_max_workspace", "enable_cuda_graph", "cudnn_conv1d_pad_to_nc1d",
    "tunable_op_enable", "tunable_op_tuning_enable", "tunable_op_max_tuning_duration_ms",
    "enable_skip_layer_norm_strict_mode", "prefer_nhwc", "use_ep_level_unified_stream", "use_tf32",
    "fuse_conv_bias", "sdpa_kernel"})
"""The option names ``CUDAExecutionProviderInfo::FromProviderOptions`` parses (namespace ``provider_option_names``
in onnxruntime/core/providers/cuda/cuda_execution_provider_info.cc); its ``ProviderOptionsParser`` refuses any
other name."""
CUDA_ENUMS = {"arena_extend_strategy": frozenset({"kNextPowerOfTwo", "kSameAsRequested"}),
              "cudnn_conv_algo_search": frozenset({"EXHAUSTIVE", "HEURISTIC", "DEFAULT"})}
"""Mapped values in the same file (``arena_extend_strategy_mapping``, ``ort_cudnn_conv_algo_search_mapping``)."""
CUDA_BOOLS = frozenset({"do_copy_in_default_stream", "cudnn_conv_use_max_workspace", "enable_cuda_graph",
                        "cudnn_conv1d_pad_to_nc1d", "tunable_op_enable", "tunable_op_tuning_enable",
                        "enable_skip_layer_norm_strict_mode", "prefer_nhwc", "use_ep_level_unified_stream",
                        "use_tf32", "fuse_conv_bias", "has_user_compute_stream"})
_BOOL_TEXT = frozenset({"0", "1", "true", "false", "True", "False"})
_REJECTED = re.compile(r"Invalid [A-Za-z]+ EP option|\[ERROR\] \[TensorRT\]|Unknown provider option|\bstoull\b")
PATH_SUFFIX = "_path"
"""Options naming a file or folder (engine, timing and context caches): redirected into a scratch folder for the
probe, so a probe on a GPU node writes nothing next to the model."""


@dataclass(frozen=True)
class ParseResult:
    """What ORT's parser said about one provider's options."""

    provider: str
    accepted: bool
    """The option parser took every key and value."""
    loaded: bool
    """The provider came up (it is in get_providers()): only on a node with its libraries."""
    detail: str
    """The parser's refusal, or why the provider did not load (the first ORT line), or "" when it loaded."""

    def as_dict(self) -> dict[str, object]:
        return {"provider": self.provider, "accepted": self.accepted, "loaded": self.loaded, "detail": self.detail}


def probe_model(inputs: dict[str, tuple[int, int]] | None = None) -> bytes:
    """A model with one Identity node per input: ``name -> (onnx element type, rank)``; symbolic dims."""
    inputs = inputs or {"x": (onnx.TensorProto.FLOAT, 2)}
    values, outputs, nodes = [], [], []
    for i, (name, (elem, rank)) in enumerate(inputs.items()):
        dims = [f"{name}_d{k}" for k in range(rank)]
        values.append(oh.make_tensor_value_info(name, elem, dims))
        outputs.append(oh.make_tensor_value_info(f"out_{i}", elem, dims))
        nodes.append(oh.make_node("Identity", [name], [f"out_{i}"], name=f"probe_{i}"))
    model = oh.make_model(oh.make_graph(nodes, "option_probe", values, outputs),
                          opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = PROBE_IR_VERSION
    return bytes(model.SerializeToString())


def graph_input_types(path: Path) -> dict[str, tuple[int, int]]:
    """``name -> (element type, rank)`` of a model's inputs (initializers excluded), read without its weights."""
    graph = onnx.load(str(path), load_external_data=False).graph
    init = {i.name for i in graph.initializer}
    return {i.name: (i.type.tensor_type.elem_type, len(i.type.tensor_type.shape.dim))
            for i in graph.input if i.name not in init}


def _scratch(options: dict[str, str], folder: Path) -> dict[str, str]:
    return {k: (str(folder / Path(v).name) if k.endswith(PATH_SUFFIX) and v else v) for k, v in options.items()}


def cuda_problems(options: dict[str, str]) -> list[str]:
    """Keys and values the CUDA provider's own parser would refuse (see CUDA_OPTION_KEYS)."""
    problems = [f"unknown CUDA EP option {k!r}" for k in options if k not in CUDA_OPTION_KEYS]
    for key, allowed in CUDA_ENUMS.items():
        if key in options and options[key] not in allowed:
            problems.append(f"CUDA EP option {key}={options[key]!r} is not one of {sorted(allowed)}")
    for key in CUDA_BOOLS & options.keys():
        if options[key] not in _BOOL_TEXT:
            problems.append(f"CUDA EP option {key}={options[key]!r} is not a boolean")
    for key in ("device_id", "gpu_mem_limit"):
        if key in options and not options[key].isdigit():
            problems.append(f"CUDA EP option {key}={options[key]!r} is not a non-negative integer")
    return problems


def parse(provider: str, options: dict[str, str], inputs: dict[str, tuple[int, int]] | None = None) -> ParseResult:
    """Build a probe session with ``provider`` and ``options`` through ORT's binding; never raises for a refusal.

    ``accepted`` is False when the parser refused (the message says which key or value). A provider whose
    library cannot load here is ``accepted`` and not ``loaded``."""
    if provider == CUDA and (problems := cuda_problems(options)):
        return ParseResult(provider, False, False, "; ".join(problems))
    with tempfile.TemporaryDirectory(prefix="sdserve-optprobe-") as tmp:
        session = C.InferenceSession(ort.SessionOptions(), probe_model(inputs), False, False)
        with capture_ort_output(f"option probe {provider}", reemit=False) as captured:
            try:
                session.initialize_session([provider], [_scratch(options, Path(tmp))], set())
            except Exception as exc:  # the binding raises plain RuntimeError/Fail
                text = " ".join(str(exc).split())
                if _REJECTED.search(text):
                    return ParseResult(provider, False, False, text[text.rfind(")") + 1:].strip()[:400] or text)
                return ParseResult(provider, True, False, text[:400])
        loaded = provider in session.get_providers()
        return ParseResult(provider, True, loaded, "" if loaded else _why_not_loaded(captured.events))


def _why_not_loaded(events: list[OrtEvent]) -> str:
    libraries = [e.detail for e in events if e.kind == "provider_library_missing" and e.detail]
    if libraries:
        return f"parsed; the provider library cannot load here ({', '.join(dict.fromkeys(libraries))} missing)"
    lines = [e.line for e in events if e.severity in ("error", "warning")]
    return "parsed; the provider did not come up" + (f": {lines[0][:300]}" if lines else "")
