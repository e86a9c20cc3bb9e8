"""ONNX Runtime sessions under the provider policy, and device buffers for IO binding."""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engines.config import RuntimeSettings
from engines.errors import GpuUnavailableError, ModelLoadError

log = logging.getLogger(__name__)

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
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
                    "trt_timing_cache_enable": str(t.timing_cache)}
        else:
            opts = {}
        out.append((name, opts))
    return out


class Runtime:
    """Builds sessions for one device under one policy and owns the device buffers bound to them."""

    def __init__(self, settings: RuntimeSettings, model_dir: Path | None = None) -> None:
        self.settings = settings
        self.device = settings.device
        self.device_id = settings.device_id if self.device == "cuda" else 0
        self._providers = provider_options(settings, model_dir)
        self._buffers: OrderedDict[tuple[str, tuple[int, ...], str], ort.OrtValue] = OrderedDict()

    @property
    def providers(self) -> list[tuple[str, dict[str, str]]]:
        return list(self._providers)

    def session(self, model: Path | bytes, name: str) -> ort.InferenceSession:
        """A session on the policy's providers. Without allow_cpu, ORT's silent retry on CPU is disabled and any
        session whose providers are not the requested ones is refused."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.settings.intra_op_threads:
            so.intra_op_num_threads = self.settings.intra_op_threads
        names = [p for p, _ in self._providers]
        kwargs: dict[str, Any] = {} if self.settings.allow_cpu else {"enable_fallback": 0}
        source = model if isinstance(model, bytes) else str(model)
        try:
            sess = ort.InferenceSession(source, sess_options=so, providers=names,
                                        provider_options=[o for _, o in self._providers], **kwargs)
        except Exception as exc:  # ORT raises RuntimeError/Fail/NoSuchFile subclasses of Exception
            if self.device == "cuda":
                raise GpuUnavailableError(f"{name}: cannot create a session on {names}: "
                                          f"{str(exc).strip()}") from exc
            raise ModelLoadError(f"{name}: cannot create a session: {str(exc).strip()}") from exc
        used = sess.get_providers()
        if not self.settings.allow_cpu and used[0] not in names:
            raise GpuUnavailableError(f"{name}: ONNX Runtime placed the session on {used}, policy requires {names}")
        log.info("session %s on %s", name, used)
        return sess

    def buffer(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue:
        """A device tensor reused across steps and requests of the same shape (bounded LRU)."""
        key = (tag, shape, np.dtype(dtype).name)
        value = self._buffers.get(key)
        if value is None:
            value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, self.device_id)
            self._buffers[key] = value
            while len(self._buffers) > 128:
                self._buffers.popitem(last=False)
        else:
            self._buffers.move_to_end(key)
        return value

    def upload(self, tag: str, array: np.ndarray) -> ort.OrtValue:
        """Copy a host array into the reusable device buffer ``tag`` of its shape."""
        value = self.buffer(tag, tuple(array.shape), array.dtype.type)
        value.update_inplace(np.ascontiguousarray(array))
        return value

    def close(self) -> None:
        self._buffers.clear()
