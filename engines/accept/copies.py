"""`sdserve accept`: host<->device copies per denoising step, counted from an ONNX Runtime profile."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

# Op names of the copy nodes ONNX Runtime inserts between a device provider and the CPU
# (onnxruntime/core/optimizer/transformer_memcpy.cc, TransformerMemcpyImpl::AddCopyNode: node name
# GenerateNodeName("Memcpy"), op type "MemcpyFromHost" for host->device, "MemcpyToHost" for device->host).
MEMCPY_FROM_HOST = "MemcpyFromHost"
MEMCPY_TO_HOST = "MemcpyToHost"
# Names of CUPTI memcpy activity records, which the CUDA profiler adds as "Kernel" events in builds with
# ENABLE_CUDA_PROFILING (onnxruntime/core/providers/cuda/cupti_manager.cc, GetMemcpyKindString). Only the kinds that
# cross the host/device boundary count.
CUPTI_HOST_TO_DEVICE = frozenset({"MemcpyHostToDevice", "MemcpyHostToDeviceArray"})
CUPTI_DEVICE_TO_HOST = frozenset({"MemcpyDeviceToHost", "MemcpyDeviceArrayToHost"})
NOT_SEEN = ("Memcpy nodes only: inputs bound with bind_cpu_input are copied by the feed copy, and the per-step "
            "uploads (an ancestral sampler's noise; timesteps, coefficients and scales go up once per request) by "
            "OrtValue.update_inplace, neither of which is a node; on a one-node TensorRT graph 0 per step is "
            "therefore trivially true, which is why the pipeline's own copies per step are counted beside it")
"""What a profile without CUPTI records cannot show, stated with the count instead of a claim of zero copies."""


# ---------------------------------------------------------------------------------------------------------------------
# Host<->device copies from an ONNX Runtime profile
#
# The profile is the Chrome-trace JSON written by SessionOptions.enable_profiling (read from ONNX Runtime's source:
# onnxruntime/core/common/profiler.cc, Profiler::EndProfiling, writes a JSON array of {"cat", "pid", "tid", "dur",
# "ts", "ph": "X", "name", "args"}; cat is "Session", "Node", "Kernel" or "Api").
# onnxruntime/core/framework/sequential_executor.cc (KernelScope) records one "Node" event per kernel run named
# "<node name>_kernel_time" with args {"op_name": KernelDef().OpName(), "provider": ..., "node_index", ...}; some
# versions add "<node>_fence_before"/"_fence_after" Node events carrying op_name too (not counted: same kernel run).
# A session run is a "Session" event named "model_run".


def load_profile(path: Path | str) -> list[dict[str, Any]]:
    """The events of an ONNX Runtime profile file (a JSON array; a Chrome ``{"traceEvents": [...]}`` object too)."""
    data = json.loads(Path(path).read_text())
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise ValueError(f"{path}: not an ONNX Runtime profile (expected a JSON array of trace events)")
    return events


@dataclass(frozen=True)
class CopyCount:
    """Host<->device copies in one request's profile, per denoising step (one UNet run per step, CFG batched).

    Node copies are the MemcpyFromHost/MemcpyToHost kernels ONNX Runtime inserted into the graph; CUPTI copies are
    every cudaMemcpy the CUDA profiler saw (present only in builds with CUDA profiling; they include the node copies,
    so the two are reported side by side, never added).
    """

    memcpy_from_host: int
    memcpy_to_host: int
    cupti_host_to_device: int
    cupti_device_to_host: int
    cupti_present: bool
    node_events: int
    """Kernel-run Node events seen at all: zero means the profile recorded no kernels, so zero copies proves nothing."""
    model_runs: int
    unet_runs: int
    max_per_step: float = 0.0
    host_copies_per_step: float | None = None
    """Host->device copies per denoising step the pipeline itself made (its uploads and host feeds, counted over two
    requests of different step counts: engines/runtime/sessions.py Runtime.host_reads). These are what a Memcpy
    count cannot see (NOT_SEEN), so this is the part of the check that can fail on a one-node TensorRT graph.
    None when not measured."""

    _derived: ClassVar[tuple[str, ...]] = ("node_copies", "per_step", "cupti_per_step", "ok")

    @property
    def node_copies(self) -> int:
        return self.memcpy_from_host + self.memcpy_to_host

    @property
    def per_step(self) -> float:
        return self.node_copies / self.unet_runs

    @property
    def cupti_per_step(self) -> float:
        return (self.cupti_host_to_device + self.cupti_device_to_host) / self.unet_runs

    @property
    def ok(self) -> bool:
        cupti_ok = not self.cupti_present or self.cupti_per_step <= self.max_per_step
        host_ok = self.host_copies_per_step is None or self.host_copies_per_step <= self.max_per_step
        return self.node_events > 0 and self.per_step <= self.max_per_step and cupti_ok and host_ok

    def summary(self) -> str:
        text = (f"{self.per_step:.2f} per step ({self.memcpy_from_host} {MEMCPY_FROM_HOST}, {self.memcpy_to_host} "
                f"{MEMCPY_TO_HOST} over {self.unet_runs} UNet runs; allowed {self.max_per_step:g})")
        if self.host_copies_per_step is not None:
            text = f"pipeline host->device copies {self.host_copies_per_step:.2f} per step; Memcpy nodes " + text
        if self.cupti_present:
            text += f"; CUPTI {self.cupti_per_step:.2f} per step"
        else:
            text += f"; counts {NOT_SEEN}"
        if not self.node_events:
            text += "; the profile recorded no kernel runs"
        return text


def _node_op(event: Mapping[str, Any]) -> str | None:
    """The op name of a kernel-run Node event, None for anything else (fence events included)."""
    name = str(event.get("name", ""))
    if event.get("cat") != "Node" or name.endswith(("_fence_before", "_fence_after")):
        return None
    args = event.get("args")
    op = args.get("op_name") if isinstance(args, Mapping) else None
    return op if isinstance(op, str) else None


def count_copies(events: Iterable[Mapping[str, Any]], unet_runs: int, max_per_step: float = 0.0,
                 host_copies_per_step: float | None = None) -> CopyCount:
    """Count host<->device copies in profile ``events`` (one or more sessions' files concatenated), next to the
    pipeline's own host->device copies per step when measured."""
    if unet_runs <= 0:
        raise ValueError(f"unet_runs must be positive, got {unet_runs}")
    ops: dict[str, int] = {}
    kernels: dict[str, int] = {}
    runs = 0
    cupti = False
    for event in events:
        op = _node_op(event)
        if op is not None:
            ops[op] = ops.get(op, 0) + 1
        elif event.get("cat") == "Kernel":
            name = str(event.get("name", ""))
            kernels[name] = kernels.get(name, 0) + 1
            cupti = cupti or name.startswith("Memcpy")
        elif event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
    return CopyCount(ops.get(MEMCPY_FROM_HOST, 0), ops.get(MEMCPY_TO_HOST, 0),
                     sum(kernels.get(n, 0) for n in CUPTI_HOST_TO_DEVICE),
                     sum(kernels.get(n, 0) for n in CUPTI_DEVICE_TO_HOST), cupti or bool(kernels),
                     sum(ops.values()), runs, unet_runs, max_per_step, host_copies_per_step)
