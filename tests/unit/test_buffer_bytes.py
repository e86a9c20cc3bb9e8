"""The device buffers, host staging and per-step tables are bounded by bytes, not only by count: serving many
distinct sizes one at a time keeps what the caches hold under ``max_cached_bytes``, least recently used first.

ORT behaviour relied on: ``OrtValue.ortvalue_from_shape_and_type`` allocates shape x element size
(onnxruntime/python/onnxruntime_pybind_ortvalue.cc), which is what the cache counts for a device buffer."""

from __future__ import annotations

import math

import numpy as np

from engines.config import RuntimeSettings
from engines.runtime import buffers
from engines.runtime.buffers import DeviceBuffers
from engines.runtime.sessions import Runtime

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)
BUDGET = 4 << 20


class CountingHost:
    """A host allocator that counts the bytes it has handed out and not had back (as pinned memory would be)."""

    kind = "pinned"

    def __init__(self) -> None:
        self.live: dict[int, int] = {}

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        array = np.empty(shape, dtype)
        self.live[array.ctypes.data] = int(array.nbytes)
        return array

    def free(self, array: np.ndarray) -> None:
        self.live.pop(array.ctypes.data)

    def close(self) -> None:
        self.live.clear()


SIZES = [(8 + i, 8 + j) for i in range(17) for j in range(17)]
"""289 distinct latent sizes (64..192 px a side), as the hostile pass sent them."""


def one_request(device: DeviceBuffers, size: tuple[int, int]) -> None:
    """What one request of a new size leaves in the caches: latents, UNet output, image staging, step tables."""
    w, h = size
    device.buffer("latents", (1, 4, h, w), np.float32)
    device.buffer("unet_out", (2, 4, h, w), np.float16)
    device.staging("image", (1, 3, h * 8, w * 8), np.float32)
    device.upload_steps("coeffs", np.zeros((20 + w, 4), np.float32))


def counted(device: DeviceBuffers) -> int:
    """The bytes of every entry the caches hold, from the arrays and values themselves."""
    total = sum(math.prod(v.shape()) * np.dtype(v.numpy().dtype).itemsize for v in device._buffers.values())
    total += sum(int(array.nbytes) for array, _ in device._staging.values())
    total += sum(len(rows) * math.prod(rows[0].shape() or [1]) * 4 for rows in device._tables.values())
    return total


def test_289_distinct_sizes_one_at_a_time_stay_under_the_byte_budget() -> None:
    device = DeviceBuffers("cpu", 0, buffers.MAX_CACHED, max_cached_bytes=BUDGET)
    host = device._host = CountingHost()
    for size in SIZES:
        one_request(device, size)
        assert device.held_bytes <= BUDGET
        assert device.held_bytes == counted(device)
        assert sum(host.live.values()) == device.held["staging"]  # evicted staging was freed, the rest counted
    assert device.evicted["staging"] > 0 and device.evicted["buffers"] > 0
    assert len(device._buffers) < buffers.MAX_CACHED  # the bytes bound, not the count, did the evicting


def test_without_the_byte_bound_the_same_sizes_hold_many_times_the_budget() -> None:
    """The pre-change bound (entries only) on the same sequence: the caches keep 256 sizes' worth of bytes."""
    device = DeviceBuffers("cpu", 0, buffers.MAX_CACHED, max_cached_bytes=1 << 60)
    for size in SIZES:
        one_request(device, size)
    assert device.held_bytes > 10 * BUDGET


def test_a_reused_shape_survives_while_other_sizes_churn() -> None:
    device = DeviceBuffers("cpu", 0, buffers.MAX_CACHED, max_cached_bytes=BUDGET)
    device._host = CountingHost()
    kept = device.buffer("latents", (1, 4, 64, 64), np.float32)
    stage, _ = device.staging("image", (1, 3, 128, 128), np.float32)
    for size in SIZES:
        one_request(device, size)
        assert device.buffer("latents", (1, 4, 64, 64), np.float32) is kept
        assert device.staging("image", (1, 3, 128, 128), np.float32)[0] is stage
        assert device.held_bytes <= BUDGET


def test_an_entry_larger_than_the_budget_is_kept_alone_and_goes_first_after() -> None:
    device = DeviceBuffers("cpu", 0, buffers.MAX_CACHED, max_cached_bytes=1 << 20)
    small = device.buffer("small", (16,), np.float32)
    big = device.buffer("big", (1 << 19,), np.float32)  # 2 MiB: over the budget alone
    assert list(device._buffers.values()) == [big] and device.held_bytes == 2 << 20
    assert small.numpy().shape == (16,)  # a value the caller still holds stays alive after eviction
    device.buffer("next", (16,), np.float32)
    assert device.held_bytes == 64 and device.evicted["buffers"] == 2


def test_the_runtime_takes_its_byte_budget_and_defaults_to_the_documented_one() -> None:
    assert Runtime(CPU).max_cached_bytes == buffers.MAX_CACHED_BYTES
    runtime = Runtime(CPU, max_cached_bytes=BUDGET)
    for size in SIZES[:80]:
        one_request(runtime, size)
    assert 0 < runtime.held_bytes <= BUDGET
    runtime.close()
    assert runtime.held_bytes == 0
