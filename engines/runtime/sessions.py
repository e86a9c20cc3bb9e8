"""ONNX Runtime sessions under the provider policy, and device buffers for IO binding."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines.config import RuntimeSettings
from engines.errors import ArtifactError, GpuUnavailableError, ModelLoadError, PlacementError
from engines.protocol import OrtEvent, SessionInfo
from engines.runtime import placement
from engines.runtime.ortlog import capture_ort_output
from engines.runtime.pinned import HostAllocator, PageableAllocator, PinnedAllocator

log = logging.getLogger(__name__)
MAX_CACHED = 128
"""Device buffers / host staging buffers kept per (tag, shape, dtype); least recently used go first."""

_ORT_TYPES: dict[str, type[np.generic]] = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def numpy_dtype(ort_type: str) -> type[np.generic]:
    try:
        return _ORT_TYPES[ort_type]
    except KeyError:
        raise ValueError(f"unsupported tensor type {ort_type}") from None


def provider_options(settings: RuntimeSettings, model_dir: Path | None = None,
                     total_memory: int | None = None) -> list[tuple[str, dict[str, str]]]:
    """The (provider, options) list sessions are built with, in priority order, as strings ORT accepts."""
    out: list[tuple[str, dict[str, str]]] = []
    for name in settings.providers:
        if name == "CUDAExecutionProvider":
            c = settings.cuda
            opts = {"device_id": str(settings.device_id), "arena_extend_strategy": c.arena_extend_strategy,
                    "cudnn_conv_algo_search": c.cudnn_conv_algo_search,
                    "do_copy_in_default_stream": str(int(c.do_copy_in_default_stream)),
                    "enable_cuda_graph": str(int(c.enable_cuda_graph)), "prefer_nhwc": str(int(c.prefer_nhwc)),
                    "use_tf32": str(int(c.use_tf32))}
            if total_memory:
                opts["gpu_mem_limit"] = str(int(total_memory * c.gpu_mem_limit_fraction))
        elif name == "TensorrtExecutionProvider":
            t = settings.tensorrt
            cache = Path(t.engine_cache_path)
            if not cache.is_absolute() and model_dir is not None:
                cache = model_dir / cache
            opts = {"device_id": str(settings.device_id), "trt_fp16_enable": str(t.fp16),
                    "trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache),
                    "trt_timing_cache_enable": str(t.timing_cache),
                    "trt_timing_cache_path": str(cache.parent / "timing")}
        else:
            opts = {}
        out.append((name, opts))
    return out


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


class Runtime:
    """Builds sessions for one device under one policy and owns the device buffers bound to them."""

    def __init__(self, settings: RuntimeSettings, model_dir: Path | None = None) -> None:
        self.settings = settings
        self.device = settings.device
        self.device_id = settings.device_id if self.device == "cuda" else 0
        self._providers = provider_options(settings, model_dir)
        self.reports: dict[str, SessionReport] = {}
        self._host: HostAllocator | None = None
        self._staging: OrderedDict[tuple[str, tuple[int, ...], str], tuple[np.ndarray, ort.OrtValue]] = OrderedDict()
        self._buffers: OrderedDict[tuple[str, tuple[int, ...], str], ort.OrtValue] = OrderedDict()

    def session(self, model: Path | bytes, name: str) -> ort.InferenceSession:
        """A session on the policy's providers, verified. Without allow_cpu: ORT's silent CPU retry is disabled,
        the providers in use must be the policy's, and the placement audit must find no compute op on the CPU."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = self.settings.ort_log_severity
        if self.settings.intra_op_threads:
            so.intra_op_num_threads = self.settings.intra_op_threads
        if self.settings.placement_audit:
            so.add_session_config_entry(placement.CONFIG_KEY, "1")
        if self.settings.disable_cpu_ep_fallback and not self.settings.allow_cpu:
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        names = [p for p, _ in self._providers]
        kwargs: dict[str, Any] = {} if self.settings.allow_cpu else {"enable_fallback": 0}
        source = model if isinstance(model, bytes) else str(model)
        report = SessionReport(name, names)
        self.reports[name] = report
        error: Exception | None = None
        with capture_ort_output(name) as captured:
            try:
                sess = ort.InferenceSession(source, sess_options=so, providers=names,
                                            provider_options=[o for _, o in self._providers], **kwargs)
            except Exception as exc:  # ORT raises RuntimeError/Fail/NoSuchFile, all plain Exceptions
                error = exc
        report.log_lines, report.events = captured.lines, list(captured.events)
        if error is not None:
            detail = "; ".join(e.line for e in captured.events if e.severity == "error") or str(error).strip()
            if self.device == "cuda":
                raise GpuUnavailableError(f"{name}: cannot create a session on {names}: {detail}") from error
            raise ModelLoadError(f"{name}: cannot create a session: {str(error).strip()}") from error
        report.providers_used = list(sess.get_providers())
        if self.settings.placement_audit:
            report.placement = placement.audit(sess, name, frozenset(self.settings.cpu_allowlist))
        enforce(report, self.settings)
        log.info("session %s on %s", name, report.providers_used)
        return sess

    def buffer(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue:
        """A device tensor reused across steps and requests of the same shape (bounded LRU)."""
        key = (tag, shape, np.dtype(dtype).name)
        value = self._buffers.get(key)
        if value is None:
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)
            self._buffers[key] = value
            while len(self._buffers) > MAX_CACHED:
                self._buffers.popitem(last=False)
        else:
            self._buffers.move_to_end(key)
        return value

    @property
    def host(self) -> HostAllocator:
        """Pinned on a GPU (created on first use, so a failed GPU boot never touches libcudart), pageable on CPU."""
        if self._host is None:
            self._host = PinnedAllocator() if self.device == "cuda" else PageableAllocator()
        return self._host

    def staging(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> tuple[np.ndarray, ort.OrtValue]:
        """A host array (pinned on a GPU) and a CPU OrtValue over the same memory, reused per shape. Bound as an
        output, ORT copies the device result straight into it; as a copy source it feeds update_inplace."""
        key = (tag, shape, np.dtype(dtype).name)
        if key not in self._staging:
            array = self.host.empty(shape, dtype)
            self._staging[key] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            while len(self._staging) > MAX_CACHED:  # bounded like the device buffers; pinned memory is freed
                old, _ = self._staging.popitem(last=False)[1]
                self.host.free(old)
        self._staging.move_to_end(key)
        return self._staging[key]

    def upload(self, tag: str, array: np.ndarray) -> ort.OrtValue:
        """Copy a host array into the reusable device buffer ``tag``; on a GPU through a pinned staging buffer."""
        value = self.buffer(tag, tuple(array.shape), array.dtype.type)
        if self.device == "cpu":
            value.update_inplace(np.ascontiguousarray(array))
            return value
        stage, _ = self.staging(tag, tuple(array.shape), array.dtype.type)
        np.copyto(stage, array)
        value.update_inplace(stage)
        return value

    def close(self) -> None:
        self._buffers.clear()
        self._staging.clear()
        if self._host is not None:
            self._host.close()


def enforce(report: SessionReport, settings: RuntimeSettings) -> None:
    """Refuse a session the policy does not allow: non-allowlisted ops on the CPU (PlacementError), or providers
    other than the policy's, or an ORT fallback (GpuUnavailableError). The dev policy (allow_cpu) accepts all."""
    if settings.allow_cpu:
        return
    if report.placement is not None and not report.placement.ok:
        p = report.placement
        raise PlacementError(f"{report.name}: ops placed on the CPU that the policy forbids: {p.disallowed} "
                             f"(compute ops among them: {p.compute_on_cpu}; e.g. {', '.join(p.examples[:3])})")
    if not report.providers_used or report.providers_used[0] not in report.providers_requested:
        raise GpuUnavailableError(f"{report.name}: ONNX Runtime placed the session on {report.providers_used}, "
                                  f"policy requires {report.providers_requested}")
    fallback = [e for e in report.events if e.kind == "cpu_fallback"]
    if fallback:
        raise GpuUnavailableError(f"{report.name}: ONNX Runtime fell back: {fallback[0].line}")
    rebuild = [e for e in report.events if e.kind == "engine_rebuild"]
    if rebuild and settings.tensorrt.forbid_engine_build:
        raise ArtifactError(f"{report.name}: TensorRT would build an engine on this node ({rebuild[0].line[:200]});"
                            " engines are artifacts: build them offline with `sdserve engines build`")
    if rebuild:
        log.warning("%s: TensorRT is building an engine on this node (allowed by the profile): %s", report.name,
                    rebuild[0].line[:200])
