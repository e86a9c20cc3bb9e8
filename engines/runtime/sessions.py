"""ONNX Runtime sessions under the provider policy (the device buffers they are bound to: buffers.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines.config import RuntimeSettings
from engines.errors import ArtifactError, GpuUnavailableError, ModelLoadError, PlacementError
from engines.runtime import enginecheck, placement, plugins
from engines.runtime.buffers import (
    DEFAULT_MAX_RUNNING,
    MAX_CACHED_BYTES,
    DeviceBuffers,
    cache_entries,
    device_arena,
    gpu_mem_limit,
    host_arena,
)
from engines.runtime.libdeps import preload
from engines.runtime.ortlog import capture_ort_output
from engines.runtime.pinned import ComputeStream, HostStream
from engines.types.snapshot import OrtEvent, SessionInfo

log = logging.getLogger(__name__)

_ORT_TYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def numpy_dtype(ort_type: str) -> type[np.generic]:
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise ValueError(f"unsupported tensor type {ort_type}") from None


UNSERVABLE_IO = ("tensor(bfloat16)", "tensor(float8", "tensor(float4", "tensor(int4)", "tensor(uint4)")
"""Graph input/output element types numpy has no dtype for. The pipelines feed and read host arrays and size device
buffers by numpy dtype, so a graph with such inputs or outputs is refused at load, by name; the same types inside a
graph whose inputs and outputs are fp32/fp16 (casts inside) are served: `sdserve engines export --dtype bf16`
writes such graphs."""
HALF_ELEMENTS = {16: "bfloat16"}
"""ONNX element types (TensorProto.BFLOAT16) ONNX Runtime's CPU provider has no compute kernels for (1.31: only
Cast, Transpose, Concat and other data movement)."""


def io_type_error(name: str, kind: str, arg: str, ort_type: str) -> ModelLoadError:
    return ModelLoadError(
        f"{name}: {kind} {arg!r} is {ort_type}: graph inputs and outputs must be tensor(float) or tensor(float16) "
        "(the pipeline feeds and reads them as numpy arrays, and numpy has no such type); bf16 inside the graph is "
        "served: export with `sdserve engines export --dtype bf16`, whose graphs keep fp32 inputs and outputs")


def check_io_types(name: str, session: ort.InferenceSession) -> None:
    """ModelLoadError (exit 11) naming the component, the input or output and its element type when it is one
    the pipelines cannot hold (UNSERVABLE_IO), instead of a ValueError at the first dtype lookup."""
    for kind, args in (("input", session.get_inputs()), ("output", session.get_outputs())):
        for arg in args:
            if str(arg.type).startswith(UNSERVABLE_IO):
                raise io_type_error(name, kind, arg.name, str(arg.type))


def half_compute_detail(name: str, model: Path | bytes, error: str) -> ModelLoadError | str:
    """Why ORT found no kernel (``NOT_IMPLEMENTED``) for a graph that holds bf16 (read from the file, weights
    not loaded): a ModelLoadError when its inputs or outputs are bf16 (``io_type_error``, whatever the provider),
    else a hint to append (bf16 compute needs the CUDA or TensorRT provider); "" for any other failure."""
    if "NOT_IMPLEMENTED" not in error:
        return ""
    import onnx

    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(str(model),
                                                                                    load_external_data=False)
    for kind, args in (("input", proto.graph.input), ("output", proto.graph.output)):
        for arg in args:
            element = HALF_ELEMENTS.get(arg.type.tensor_type.elem_type)
            if element is not None:
                return io_type_error(name, kind, arg.name, f"tensor({element})")
    if not any(t.data_type in HALF_ELEMENTS for t in proto.graph.initializer):
        return ""
    return (" (the graph computes in bfloat16: ONNX Runtime's CPU provider has no bfloat16 kernels, so a bf16 "
            "export is served on the CUDA or TensorRT provider; on the CPU serve an fp32 or fp16 export)")


TRT, CUDA, CPU = "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"
NO_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
CPU_NODES_REFUSED = "assigned to the default CPU EP"
"""What ORT raises when disable_cpu_ep_fallback refuses a session ("This session contains graph nodes that are
assigned to the default CPU EP, but fallback to CPU EP has been explicitly disabled", inference_session.cc)."""


def artifact_dirs(settings: RuntimeSettings, model_dir: Path | None) -> tuple[Path, ...]:
    """Folders whose files must not change while serving: TensorRT's (engine cache, context models) or the plugin
    EP's EP-context artifacts (<model>/ep/<name>); a write there is an on-node build."""
    if settings.plugin is not None and model_dir is not None:
        from engines.artifacts import ep_dir

        return (model_dir / ep_dir(settings.plugin.name),)
    if TRT in settings.providers:
        return enginecheck.watched_dirs(engine_cache_dir(settings, model_dir))
    return ()


def _cuda_options(settings: RuntimeSettings, total_memory: int | None, stream: int | None = None) -> dict[str, str]:
    c = settings.cuda
    opts = {"device_id": str(settings.device_id), "arena_extend_strategy": c.arena_extend_strategy,
            "cudnn_conv_algo_search": c.cudnn_conv_algo_search,
            "do_copy_in_default_stream": str(int(c.do_copy_in_default_stream)),
            "enable_cuda_graph": str(int(c.enable_cuda_graph)), "prefer_nhwc": str(int(c.prefer_nhwc)),
            "use_tf32": str(int(c.use_tf32))}
    limit = gpu_mem_limit(settings, total_memory)
    if limit:
        opts["gpu_mem_limit"] = str(limit)
    if stream:  # a decimal size_t (CUDAExecutionProviderInfo::FromProviderOptions); has_* follows from it
        opts.update(has_user_compute_stream="1", user_compute_stream=str(stream))
    return opts


STREAM_PLACEHOLDER = 0x7F00_0000_0000
"""A stream address for building and parsing the shared-stream option sets where no stream can be created (no
libcudart): the parsers read it as a number and never dereference it (sessions never run on it)."""


ENV_ALLOCATORS = "session.use_env_allocators"
"""Session config entry: the session allocates from the arenas registered with ORT's environment (buffers.py)."""


def engine_cache_dir(settings: RuntimeSettings, model_dir: Path | None) -> Path:
    cache = Path(settings.tensorrt.engine_cache_path)
    return model_dir / cache if not cache.is_absolute() and model_dir is not None else cache


def provider_options(settings: RuntimeSettings, model_dir: Path | None = None,
                     total_memory: int | None = None, stream: int | None = None) -> list[tuple[str, dict[str, str]]]:
    """The (provider, options) list sessions are built with, in priority order, as strings ORT accepts.
    ``total_memory``: the served device's total bytes (preflight's NVML observation) for gpu_mem_limit;
    ``stream``: the shared compute stream's address (runtime.cuda.shared_compute_stream), given to CUDA and
    TensorRT alike, so a session that splits its graph between them runs on the one stream too."""
    out: list[tuple[str, dict[str, str]]] = []
    for name in settings.providers:
        if name == CUDA:
            opts = _cuda_options(settings, total_memory, stream)
        elif name == TRT:
            t, cache = settings.tensorrt, engine_cache_dir(settings, model_dir)
            opts = {"device_id": str(settings.device_id), "trt_fp16_enable": str(t.fp16),
                    "trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
                    "trt_timing_cache_enable": str(t.timing_cache),
                    "trt_timing_cache_path": str(cache.parent / "timing")}
            if stream:  # parsed by the binding itself (onnxruntime_pybind_state.cc, std::stoull), which sets
                # has_user_compute_stream from it and refuses that key by name ("Invalid TensorRT EP option")
                opts["user_compute_stream"] = str(stream)
        else:
            opts = {}
        out.append((name, opts))
    return out


ENGINE_CACHE_KEYS = ("trt_engine_cache_enable", "trt_engine_cache_path", "trt_timing_cache_enable",
                     "trt_timing_cache_path")


def loading_prebuilt(options: dict[str, str]) -> dict[str, str]:
    """TensorRT options for an EP-context model: no engine or timing cache. The engine is found from the EPContext
    node's ep_cache_context, relative to the context model's folder (GetEpContextFromGraph in
    onnxruntime/core/providers/tensorrt/onnx_ctx_model_helper.cc); a cache path would only make the provider create
    folders ("Failed to create directory", tensorrt_execution_provider.cc), which fails on a read-only model mount."""
    return {k: v for k, v in options.items() if k not in ENGINE_CACHE_KEYS}


def session_providers(settings: RuntimeSettings, in_process: bool, model_dir: Path | None = None,
                      total_memory: int | None = None, stream: int | None = None) -> list[tuple[str, dict[str, str]]]:
    """The providers of one component: the policy's, except that graphs built in process get CUDA only.

    Why: such a graph (the 10-node scheduler step of engines/numerics/step_graph.py, the VAE input scale) has no
    prebuilt engine, so under a TensorRT policy TensorRT would build one on the node at the first request, and
    again per new shape. Its own policy is CUDA only: no build, the same math, still on the GPU."""
    providers = provider_options(settings, model_dir, total_memory, stream)
    if not in_process or TRT not in settings.providers:
        return providers
    rest = [(p, o) for p, o in providers if p != TRT]
    return rest if any(p == CUDA for p, _ in rest) else [(CUDA, _cuda_options(settings, total_memory, stream)), *rest]


@dataclass
class SessionReport:
    """What building one session showed: providers asked and used, classified ORT log lines, placement."""

    name: str
    providers_requested: list[str]
    providers_used: list[str] = field(default_factory=list)
    events: list[OrtEvent] = field(default_factory=list)
    log_lines: list[str] = field(default_factory=list)
    placement: placement.PlacementReport | None = None

    def to_model(self) -> SessionInfo:
        return SessionInfo(providers_requested=tuple(self.providers_requested),
                           providers_used=tuple(self.providers_used), ort_events=tuple(self.events),
                           ort_log=tuple(self.log_lines),
                           placement=self.placement.to_model() if self.placement else None)


class Runtime(DeviceBuffers):
    """Builds sessions for one device under one policy and owns the device buffers bound to them (DeviceBuffers)."""

    def __init__(self, settings: RuntimeSettings, model_dir: Path | None = None,
                 total_memory: int | None = None, max_running: int = DEFAULT_MAX_RUNNING,
                 max_cached_bytes: int = MAX_CACHED_BYTES) -> None:
        """``total_memory``: the served device's total bytes, from preflight (gpu_mem_limit_fraction needs it);
        ``max_running``: the scheduler's queue.max_running, which sizes the buffer caches (cache_entries);
        ``max_cached_bytes``: the bytes those caches hold together (MAX_CACHED_BYTES)."""
        super().__init__(settings.device, settings.device_id if settings.device == "cuda" else 0,
                         cache_entries(max_running), max_cached_bytes)
        self.settings = settings
        self.model_dir = model_dir
        self.total_memory = total_memory
        self.reports: dict[str, SessionReport] = {}
        self._engine_dirs = artifact_dirs(settings, model_dir)
        self._after_load = enginecheck.snapshot(self._engine_dirs)
        if self.device == "cpu" and settings.plugin is None:
            self.host_arena = host_arena()
        if self.device == "cuda":  # provider libraries have no RUNPATH: load the pip CUDA/TensorRT wheels first
            for line in preload(tensorrt=TRT in settings.providers):
                log.info("preload: %s", line)
            if settings.plugin is None and CUDA in settings.providers:
                self.arena = device_arena(settings, total_memory)  # before the first device OrtValue
        self.stream_state = self._shared_stream()
        """Whether the sessions share one stream (``shared``), its kind and address, or why not (``reason``)."""

    def _shared_stream(self) -> dict[str, Any]:
        """Set ``stream``: the CPU provider's HostStream (runs finish before they return); on CUDA with
        runtime.cuda.shared_compute_stream, a ComputeStream every session gets as ``user_compute_stream``. Where
        it cannot be created the runtime falls back to per-session streams (every run synchronizes, as ORT does by
        default: correct, only slower) and says why; a GPU that cannot give a stream fails the sessions anyway."""
        if self.settings.plugin is not None:
            return {"shared": False, "reason": "a plugin EP keeps its own streams"}
        if self.device == "cpu":
            self.stream = HostStream()
            return {"shared": True, "kind": "host", "address": 0}
        if not self.settings.cuda.shared_compute_stream:
            return {"shared": False, "reason": "runtime.cuda.shared_compute_stream is off"}
        try:
            self.stream = ComputeStream(self.settings.device_id)
        except GpuUnavailableError as exc:
            log.warning("no shared compute stream (%s): each session keeps its own and every run synchronizes", exc)
            return {"shared": False, "reason": f"the shared compute stream could not be created: {exc}"}
        return {"shared": True, "kind": "cuda", "address": self.stream.address}

    def _options(self, audit_only: bool = False, extra: dict[str, str] | None = None) -> ort.SessionOptions:
        """Session options under the policy; ``audit_only``: without disable_cpu_ep_fallback, to name the nodes a
        refused session would have put on the CPU; ``extra``: more session config entries (an EP-context dump)."""
        so = ort.SessionOptions()
        for key, value in (extra or {}).items():
            so.add_session_config_entry(key, value)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = self.settings.ort_log_severity
        if self.settings.intra_op_threads:
            so.intra_op_num_threads = self.settings.intra_op_threads
        so.add_session_config_entry("session.intra_op.allow_spinning", str(int(self.settings.intra_op_spinning)))
        if self.settings.placement_audit or audit_only:
            so.add_session_config_entry(placement.CONFIG_KEY, "1")
        if self.settings.disable_cpu_ep_fallback and not self.settings.allow_cpu and not audit_only:
            so.add_session_config_entry(NO_CPU_FALLBACK, "1")
        if self.arena.get("registered") or self.host_arena.get("registered"):
            so.add_session_config_entry(ENV_ALLOCATORS, "1")
        if self.settings.plugin is not None:
            plugins.add_to(so, self.settings.plugin)
        return so

    def session(self, model: Path | bytes, name: str, extra: dict[str, str] | None = None,
                fp32: bool = False) -> ort.InferenceSession:
        """A session on the component's providers, verified. Without allow_cpu: ORT's silent CPU retry is disabled,
        every provider asked for must be in use, nothing on the activation path may run on the CPU (placement by
        data flow), and a TensorRT component must load prebuilt engines (EP-context nodes, an unchanged cache).
        ``fp32``: TensorRT must not pick fp16 kernels for this component (``trt_fp16_enable`` off whatever the
        profile says), e.g. SDXL's force-upcast VAE."""
        providers = session_providers(self.settings, isinstance(model, bytes), self.model_dir, self.total_memory,
                                      self.stream.address if self.stream is not None else None)
        if fp32:
            providers = [(p, {**o, "trt_fp16_enable": "False"} if p == TRT else o) for p, o in providers]
        if self.settings.plugin is not None:
            providers = [(self.settings.plugin.name, dict(self.settings.plugin.options))]
        if TRT in [p for p, _ in providers] and not isinstance(model, bytes) and enginecheck.ep_context_nodes(model):
            providers = [(p, loading_prebuilt(o) if p == TRT else o) for p, o in providers]
        names = [p for p, _ in providers]
        report = SessionReport(name, names)
        self.reports[name] = report
        plugin = self.settings.plugin
        if TRT in names or (plugin is not None and plugin.require_artifacts and not isinstance(model, bytes)):
            report.events += enginecheck.ep_context_events(model, name)
            if not self.settings.allow_cpu:
                enginecheck.gate(report.name, report.events, forbid_builds(self.settings))
        before = enginecheck.snapshot(self._engine_dirs)
        sess = self._create(model, report, providers, extra)
        if self._engine_dirs:
            self._after_load = enginecheck.snapshot(self._engine_dirs)
            report.events += enginecheck.cache_events(before, self._after_load, f"{name}: session creation")
        report.providers_used = list(sess.get_providers())
        if self.settings.placement_audit:
            report.placement = placement.audit(sess, name, model, classify=not self.settings.allow_cpu,
                                               external_folder=external_folder(extra))
        enforce(report, self.settings)
        log.info("session %s on %s", name, report.providers_used)
        return sess

    def _create(self, model: Path | bytes, report: SessionReport, providers: list[tuple[str, dict[str, str]]],
                extra: dict[str, str] | None = None) -> ort.InferenceSession:
        names = [p for p, _ in providers]
        error: Exception | None = None
        with capture_ort_output(report.name) as captured:
            try:
                sess = self._construct(model, providers, extra=extra)
            except Exception as exc:  # ORT raises RuntimeError/Fail/NoSuchFile, all plain Exceptions
                error = exc
        report.log_lines, report.events = captured.lines, [*report.events, *captured.events]
        if error is not None:
            detail = "; ".join(e.line for e in captured.events if e.severity == "error") or str(error).strip()
            half = half_compute_detail(report.name, model, str(error))
            if isinstance(half, ModelLoadError):
                raise half from error
            detail += half
            if CPU_NODES_REFUSED in str(error):
                raise PlacementError(f"{report.name}: {self._cpu_nodes(model, providers)}") from error
            if not isinstance(model, bytes) and enginecheck.ep_context_nodes(model):
                raise prebuilt_load_error(report.name, names, model, f"{detail} {error}") from error
            if self.device == "cuda" or self.settings.plugin is not None:
                raise GpuUnavailableError(f"{report.name}: cannot create a session on {names}: {detail}") from error
            raise ModelLoadError(f"{report.name}: cannot create a session: {str(error).strip()}{half}") from error
        check_io_types(report.name, sess)
        return sess

    def _construct(self, model: Path | bytes, providers: list[tuple[str, dict[str, str]]],
                   audit_only: bool = False, extra: dict[str, str] | None = None) -> ort.InferenceSession:
        kwargs: dict[str, Any] = {} if self.settings.allow_cpu else {"enable_fallback": 0}
        source = model if isinstance(model, bytes) else str(model)
        # The audit's rebuild keeps only where a bytes model's weights are (it cannot load without it).
        options = self._options(audit_only, _external_only(extra) if audit_only else extra)
        if self.settings.plugin is not None:  # the EP is in the options (add_provider_for_devices), not providers=
            return ort.InferenceSession(source, sess_options=options, **kwargs)
        return ort.InferenceSession(source, sess_options=options, providers=[p for p, _ in providers],
                                    provider_options=[o for _, o in providers], **kwargs)

    def _cpu_nodes(self, model: Path | bytes, providers: list[tuple[str, dict[str, str]]]) -> str:
        """ORT refused the session (disable_cpu_ep_fallback) without naming a node: build it once more with CPU
        fallback allowed and the assignment recorded, to name the nodes that would have run on the CPU."""
        try:
            with capture_ort_output("placement audit"):
                sess = self._construct(model, providers, audit_only=True)
            found = placement.audit(sess, "audit", model, classify=False)  # names only: nothing to classify
        except Exception as exc:  # the second build can fail for its own reasons; say so, still refuse
            return f"{CPU_NODES_REFUSED} (the nodes could not be listed: {str(exc).strip()[:200]})"
        named = ", ".join(f"{op} {name}" for op, name in found.cpu_named[:8])
        more = f" and {len(found.cpu_named) - 8} more" if len(found.cpu_named) > 8 else ""
        return (f"{len(found.cpu_named)} node(s) the accelerator leaves on the CPU, refused by "
                f"session.disable_cpu_ep_fallback: {named}{more}")

    def check_engine_cache(self, stage: str) -> list[OrtEvent]:
        """Call after the first run at every served shape (the self-test warm-up): TensorRT builds an engine per
        new shape on first use, so the cache folder must be as session creation left it. Raises ArtifactError
        when the policy forbids on-node builds (and the profile does not allow the CPU); returns the events.

        What this can and cannot see: a prebuilt EP-context load carries no engine-cache options
        (``loading_prebuilt``), so TensorRT writes nothing there even if it compiled; for those sessions the
        evidence is that every TensorRT component was an EP-context model (``enginecheck.ep_context_events``,
        gated at creation). This listing catches the loads that do carry a cache (dev, plain models) and files
        changed under the artifact folder by anything else."""
        events = enginecheck.cache_events(self._after_load, enginecheck.snapshot(self._engine_dirs), stage)
        if events and not self.settings.allow_cpu:
            enginecheck.gate(stage, events, forbid_builds(self.settings))
        self._after_load = enginecheck.snapshot(self._engine_dirs)
        return events


# What a failed load of a prebuilt EP-context model said, classified. Only the artifact's own faults are exit 23;
# the node's (memory, driver, libraries) are the GPU path's (exit 20), whatever model was being loaded.
ARTIFACT_MARKERS = (
    "deserialize",  # onnx_ctx_model_helper.cc GetEpContextFromGraph "could not deserialize engine" (another
    # TensorRT or GPU, a damaged file); TensorRT's own "deserializeCudaEngine: Error Code 1: Serialization" too
    "can't find engine cache",  # ... the engine file ep_cache_context names is not beside the context model
    "ep_cache_context attribute",  # ... an absolute path, or one with '..', in ep_cache_context
    "not a valid EP Context node",  # ... ValidateEPCtxNode
    "Blob not found",  # OpenVINO plugin EP (plugin/ov_bin_manager.cc): the blob is another graph's or missing
    "INVALID_GRAPH")  # ORT's status for a graph the EP refuses to take from its context model (ov_compute.cc)
LOAD_FAILURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("a provider library is missing", ("Failed to load library", "cannot open shared object file",
                                       "Please install TensorRT libraries")),
    ("the NVIDIA driver refused", ("CUDA driver version is insufficient", "CUDA failure 35",
                                   "no CUDA-capable device", "CUDA failure 100")),
    ("the GPU is out of memory", ("out of memory", "cudaErrorMemoryAllocation", "CUDA failure 2:",
                                  "Failed to allocate", "bad_alloc")),
)


EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
"""Where ORT finds the external weights of a model given as bytes (tensorprotoutils.cc
ValidateExternalDataPathFromDir); every session built from those bytes needs it, the audit's too."""


def external_folder(extra: dict[str, str] | None) -> str | None:
    return (extra or {}).get(EXTERNAL_FOLDER)


def _external_only(extra: dict[str, str] | None) -> dict[str, str] | None:
    folder = external_folder(extra)
    return {EXTERNAL_FOLDER: folder} if folder else None


def classify_load_failure(text: str) -> str:
    """Why a prebuilt EP-context model did not load: "artifact mismatch" only for ORT's messages about the
    artifact itself; the node's faults first (a missing library or OOM can surface while loading any engine)."""
    lowered = text.lower()
    for reason, markers in LOAD_FAILURES:
        if any(m.lower() in lowered for m in markers):
            return reason
    if any(m.lower() in lowered for m in ARTIFACT_MARKERS):
        return "artifact mismatch"
    return "unclassified"


def prebuilt_load_error(name: str, providers: list[str], model: Path, text: str) -> ArtifactError | GpuUnavailableError:
    """ArtifactError (exit 23) for an artifact mismatch; GpuUnavailableError (exit 20) naming the node's fault (or
    "not classified as an artifact mismatch") otherwise."""
    reason, detail = classify_load_failure(text), " ".join(text.split())[:400]
    if reason == "artifact mismatch":
        return ArtifactError(f"artifact mismatch: {name}: {providers} cannot load the prebuilt EP-context model "
                             f"{model}: {detail}; rebuild it with `sdserve engines build` on the deployed versions")
    if reason == "unclassified":
        reason = "the failure is not one ORT reports for a mismatched artifact"
    return GpuUnavailableError(f"{name}: {providers} cannot load the prebuilt EP-context model {model}: {reason}: "
                               f"{detail}")


def enforce(report: SessionReport, settings: RuntimeSettings) -> None:
    """Refuse a session the policy does not allow. GpuUnavailableError: a provider asked for is not in use (e.g.
    TensorRT failed to create and ORT went on with CUDA), a provider-creation failure was logged, or ORT fell
    back. PlacementError (exit 22): a CPU node on the activation path, named. ArtifactError: TensorRT built or
    would build an engine on this node. The dev policy (allow_cpu) accepts all."""
    if settings.allow_cpu:
        return
    _require_providers(report)
    p = report.placement
    if p is not None and not p.ok:
        raise PlacementError(f"{report.name}: {p.refusal()}")
    enginecheck.gate(report.name, report.events, forbid_builds(settings))


def forbid_builds(settings: RuntimeSettings) -> bool:
    """Whether an on-node build is refused: the plugin EP's require_artifacts, else TensorRT's forbid_engine_build."""
    return settings.plugin.require_artifacts if settings.plugin is not None else settings.tensorrt.forbid_engine_build


def _require_providers(report: SessionReport) -> None:
    """Every provider the component asked for must be in get_providers(): ORT builds the session with what
    remains when one fails to create (a WARNING, not an error: CreateExecutionProviderFactoryInstance in
    onnxruntime/python/onnxruntime_pybind_state.cc logs "Failed to create <provider>. Please reference ..." and
    returns no factory; the 1.31.1 binary holds those strings), so the first provider alone proves nothing."""
    missing = [p for p in report.providers_requested if p not in report.providers_used]
    failed = [e for e in report.events if e.kind == "provider_creation_failed"]
    if missing or failed or not report.providers_used or report.providers_used[0] == CPU:
        raise GpuUnavailableError(
            f"{report.name}: ONNX Runtime runs {report.providers_used}, the policy requires "
            f"{report.providers_requested}" + (f" ({', '.join(missing)} missing)" if missing else "")
            + f": {creation_failure(report.events)}")
    fallback = [e for e in report.events if e.kind == "cpu_fallback"]
    if fallback:
        raise GpuUnavailableError(f"{report.name}: ONNX Runtime fell back: {fallback[0].line}")


def creation_failure(events: list[OrtEvent]) -> str:
    """Why a provider did not come up, from the captured log: the libraries that did not load, else ORT's line."""
    libraries = [e.detail for e in events if e.kind == "provider_library_missing" and e.detail.startswith("lib")]
    failed = [e for e in events if e.kind == "provider_creation_failed"]
    if libraries:
        who = f"{', '.join(e.detail for e in failed)}: " if failed else ""
        return f"{who}cannot load {', '.join(dict.fromkeys(libraries))}"
    if failed:
        return "; ".join(e.line[e.line.find("Failed to create"):][:300] for e in failed)
    return "no provider-creation message was logged (check ort_log in the capability snapshot)"
