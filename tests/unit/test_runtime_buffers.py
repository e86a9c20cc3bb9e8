"""Device buffers and host staging are reused per shape and bounded (LRU)."""

from __future__ import annotations

import numpy as np

from engines.config import RuntimeSettings
from engines.runtime import buffers
from engines.runtime.sessions import Runtime

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


def test_buffers_are_reused_per_shape_and_bounded() -> None:
    rt = Runtime(CPU)
    first = rt.buffer("latents", (1, 4, 8, 8), np.float32)
    assert rt.buffer("latents", (1, 4, 8, 8), np.float32) is first
    for i in range(rt.max_cached + 10):
        rt.buffer("x", (i + 1,), np.float32)
        rt.staging("y", (i + 1,), np.float32)
    assert len(rt._buffers) == rt.max_cached and len(rt._staging) == rt.max_cached
    assert rt.max_cached >= buffers.MAX_CACHED


def test_staging_output_shares_memory_with_its_ortvalue() -> None:
    rt = Runtime(CPU)
    host, value = rt.staging("image", (2, 3), np.float32)
    host[:] = 7.0
    assert np.array_equal(value.numpy(), np.full((2, 3), 7.0, np.float32))
    assert rt.host.kind == "pageable"
