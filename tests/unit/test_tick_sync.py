"""One synchronize per step-batching tick on a shared stream, one per run on separate streams; the buffer caches
sized from max_running (engines/runtime/buffers.py, engines/runtime/pinned.py, engines/runtime/sessions.py).

The sessions here are fakes behind the run call (DeviceBuffers.run only calls ``run_with_iobinding``); the run
options they receive are ONNX Runtime's real ``RunOptions``. The key they carry is
``disable_synchronize_execution_providers`` (include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engines.config import CudaOptions, RuntimeSettings
from engines.errors import GpuUnavailableError
from engines.runtime import buffers
from engines.runtime.buffers import NO_SYNC, DeviceBuffers
from engines.runtime.pinned import ComputeStream, HostStream
from engines.runtime.sessions import CUDA, STREAM_PLACEHOLDER, TRT, Runtime, provider_options, session_providers

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


class FakeValue:
    def __init__(self, device: str = "cuda") -> None:
        self.device = device

    def shape(self) -> list[int]:
        return [1, 4, 8, 8]

    def device_name(self) -> str:
        return self.device


class FakeSession:
    """Records whether each run was asked to skip its end-of-run synchronize."""

    def __init__(self) -> None:
        self.skipped: list[bool] = []

    def run_with_iobinding(self, binding: Any, options: ort.RunOptions | None = None) -> None:
        self.skipped.append(options is not None and _entry(options) == "1")


def _entry(options: ort.RunOptions) -> str:
    try:
        return str(options.get_run_config_entry(NO_SYNC))
    except RuntimeError:  # not set
        return ""


class CountingStream:
    kind = "cuda"
    address = STREAM_PLACEHOLDER

    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1

    def close(self) -> None:
        return None


def _tick(device: DeviceBuffers, session: FakeSession, runs: int, host_output_at: int = -1) -> None:
    with device.one_tick():
        for k in range(runs):
            out = FakeValue("cpu" if k == host_output_at else "cuda")
            device.run(session, None, "rows_concat2", {"out": out})


def test_a_tick_on_a_shared_stream_synchronizes_once() -> None:
    device, session, stream = DeviceBuffers("cuda", 0), FakeSession(), CountingStream()
    device.stream = stream
    _tick(device, session, 9)
    assert session.skipped == [True] * 9
    assert stream.synchronized == 1
    assert (device.syncs.last_tick_runs, device.syncs.last_tick_syncs, device.syncs.total) == (9, 1, 1)


def test_on_separate_streams_every_run_synchronizes() -> None:
    """Without one stream for all sessions, skipping a run's synchronize would let the next session's stream read
    a buffer the previous one is still writing: nothing is skipped."""
    device, session = DeviceBuffers("cuda", 0), FakeSession()
    assert device.stream is None
    _tick(device, session, 9)
    assert session.skipped == [False] * 9
    assert (device.syncs.last_tick_runs, device.syncs.last_tick_syncs) == (9, 9)


def test_a_run_that_writes_host_memory_inside_a_tick_synchronizes() -> None:
    """The step cache's probe writes two scalars to host memory that are read right after the run: that run keeps
    its synchronize (which also finishes every run deferred before it); the runs after it are deferred again and
    the tick's end waits for them."""
    device, session, stream = DeviceBuffers("cuda", 0), FakeSession(), CountingStream()
    device.stream = stream
    _tick(device, session, 5, host_output_at=2)
    assert session.skipped == [True, True, False, True, True]
    assert stream.synchronized == 1 and device.syncs.last_tick_syncs == 2
    _tick(device, session, 3, host_output_at=2)  # the host run is the last: nothing is left to wait for
    assert stream.synchronized == 1 and device.syncs.last_tick_syncs == 1


def test_runs_outside_a_tick_synchronize_and_a_failed_tick_still_waits() -> None:
    device, session, stream = DeviceBuffers("cuda", 0), FakeSession(), CountingStream()
    device.stream = stream
    device.run(session, None, "vae_decoder", {"out": FakeValue()})
    assert session.skipped == [False] and device.syncs.total == 1

    def failing_tick() -> None:
        with device.one_tick():
            device.run(session, None, "unet", {"out": FakeValue()})
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        failing_tick()
    assert stream.synchronized == 1 and device.syncs.ticks == 1


def test_the_cpu_runtime_is_one_host_stream() -> None:
    runtime = Runtime(CPU)
    assert isinstance(runtime.stream, HostStream) and runtime.stream_state["shared"]


def test_the_shared_stream_option_sets_carry_the_address_as_decimal() -> None:
    """CUDAExecutionProviderInfo::FromProviderOptions parses ``user_compute_stream`` as a decimal size_t; the
    TensorRT parser in the binding takes only ``user_compute_stream`` (it refuses has_user_compute_stream)."""
    settings = RuntimeSettings()
    options = dict(provider_options(settings, None, 80 << 30, STREAM_PLACEHOLDER))
    assert options[CUDA]["user_compute_stream"] == str(STREAM_PLACEHOLDER)
    assert options[CUDA]["has_user_compute_stream"] == "1"
    assert options[TRT]["user_compute_stream"] == str(STREAM_PLACEHOLDER)
    assert "has_user_compute_stream" not in options[TRT]
    in_process = dict(session_providers(settings, True, None, None, STREAM_PLACEHOLDER))
    assert list(in_process) == [CUDA] and in_process[CUDA]["user_compute_stream"] == str(STREAM_PLACEHOLDER)
    plain = dict(provider_options(settings))
    assert "user_compute_stream" not in plain[CUDA] and "user_compute_stream" not in plain[TRT]


def test_without_a_cuda_runtime_the_engine_falls_back_to_per_session_streams_and_says_why() -> None:
    """No GPU here: libcudart refuses (or is absent), so no stream; the sessions get no stream address and every
    run synchronizes (correct, slower), with the reason in stream_state."""
    settings = RuntimeSettings(cuda=CudaOptions(shared_compute_stream=True))
    runtime = Runtime(settings, total_memory=80 << 30)
    assert runtime.stream is None
    assert not runtime.stream_state["shared"]
    assert "could not be created" in runtime.stream_state["reason"]
    off = Runtime(RuntimeSettings(), total_memory=80 << 30)
    assert off.stream_state == {"shared": False, "reason": "runtime.cuda.shared_compute_stream is off"}


class FakeCudart:
    """libcudart's four stream calls as ctypes would make them (the argument objects are ctypes values)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[str] = []
        self.fail = fail

        def call(name: str) -> Any:
            def f(*args: Any) -> int:
                self.calls.append(name)
                if name == "cudaStreamCreate":
                    args[0]._obj.value = 0xABC000
                return 2 if name == self.fail else 0
            return f

        for name in ("cudaSetDevice", "cudaStreamCreate", "cudaStreamSynchronize", "cudaStreamDestroy"):
            setattr(self, name, call(name))


def test_the_compute_stream_is_created_synchronized_and_destroyed_through_cudart() -> None:
    cudart = FakeCudart()
    stream = ComputeStream(1, cudart)
    assert stream.address == 0xABC000
    stream.synchronize()
    stream.close()
    assert cudart.calls == ["cudaSetDevice", "cudaStreamCreate", "cudaSetDevice", "cudaStreamSynchronize",
                            "cudaSetDevice", "cudaStreamSynchronize", "cudaStreamDestroy"]
    with pytest.raises(GpuUnavailableError, match="cudaStreamCreate failed with CUDA error 2"):
        ComputeStream(0, FakeCudart(fail="cudaStreamCreate"))


def _load(device: DeviceBuffers, requests: int, per_request: int, unscoped: int) -> None:
    """What a full running set touches each step: every request's entries under its scope, then the unscoped."""
    for _step in range(3):
        for r in range(requests):
            with device.scoped(f"run{r}/"):
                for k in range(per_request):
                    device.buffer(f"b{k}", (1, 4, 8, 8), np.float32)
                    device.staging(f"s{k}", (1, 4, 8, 8), np.float32)
                device.upload_steps("coeffs", np.zeros((4, 3), dtype=np.float32))
        for k in range(unscoped):
            device.buffer(f"rows_{k}", (2, 4, 8, 8), np.float32)


def test_a_full_running_set_never_evicts_its_buffers() -> None:
    """max_running requests' worth of entries (production: 32 x up to 13 each, more with the step cache) stay
    cached: the churn counter stays 0. The old fixed bound (256 entries) evicts under the same load, freeing and
    re-allocating pinned staging every step."""
    runtime = Runtime(CPU, max_running=32)
    assert runtime.max_cached >= 32 * buffers.ENTRIES_PER_REQUEST + buffers.CACHE_HEADROOM
    _load(runtime, 32, buffers.ENTRIES_PER_REQUEST - 1, buffers.CACHE_HEADROOM)
    assert runtime.evicted == {"buffers": 0, "staging": 0, "tables": 0}
    old = DeviceBuffers("cpu", 0, buffers.MAX_CACHED)
    _load(old, 32, buffers.ENTRIES_PER_REQUEST - 1, buffers.CACHE_HEADROOM)
    assert old.evicted["buffers"] > 0 and old.evicted["staging"] > 0
    assert Runtime(CPU, max_running=1).max_cached == buffers.MAX_CACHED  # never below the floor
    assert Runtime(CPU, max_running=256).max_cached == 256 * buffers.ENTRIES_PER_REQUEST + buffers.CACHE_HEADROOM
