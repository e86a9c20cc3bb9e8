"""The row packer of step-level batching (engines/numerics/rows.py) on real ONNX Runtime sessions: one call joins up
to JOIN_MAX requests' rows and one call splits them back; more requests chain the calls. Concat and Slice copy, so
the results are exact."""

from __future__ import annotations

import numpy as np
import pytest

from engines.config import RuntimeSettings
from engines.numerics.rows import JOIN_MAX, RowPacker
from engines.pipelines.ort_model import OrtModel
from engines.runtime.sessions import Runtime


@pytest.fixture(scope="module")
def packer() -> tuple[Runtime, RowPacker]:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    rows = RowPacker(runtime, lambda m, name: OrtModel(runtime, m, name), [(np.float32, 4), (np.int64, 1)],
                     (np.float32, 4))
    return runtime, rows


@pytest.mark.parametrize("count", range(1, 2 * JOIN_MAX + 2))
def test_join_then_split_gives_every_request_its_own_rows_back(packer: tuple[Runtime, RowPacker],
                                                               count: int) -> None:
    """``count`` requests of 1-3 rows each (more than JOIN_MAX chain the calls): the joined tensor is their rows in
    order, and the split copies each request's rows back into its own buffer, exactly."""
    runtime, rows = packer
    rng = np.random.default_rng(count)
    arrays = [rng.standard_normal((1 + k % 3, 4, 2, 2), dtype=np.float32) for k in range(count)]
    steps = [np.full((len(a),), 10 * k, dtype=np.int64) for k, a in enumerate(arrays)]
    joined = rows.join("sample", [runtime.upload(f"in{k}", a) for k, a in enumerate(arrays)])
    np.testing.assert_array_equal(joined.numpy(), np.concatenate(arrays))
    timesteps = rows.join("timestep", [runtime.upload(f"t{k}", t) for k, t in enumerate(steps)])
    np.testing.assert_array_equal(timesteps.numpy(), np.concatenate(steps))
    doubled = runtime.upload("doubled", 2 * np.concatenate(arrays))
    parts = [runtime.buffer(f"out{k}", a.shape, np.float32) for k, a in enumerate(arrays)]
    rows.split(doubled, parts)
    for part, array in zip(parts, arrays, strict=True):
        np.testing.assert_array_equal(part.numpy(), 2 * array)


def test_a_split_whose_parts_do_not_cover_the_rows_is_refused(packer: tuple[Runtime, RowPacker]) -> None:
    runtime, rows = packer
    joined = runtime.upload("whole", np.zeros((5, 4, 2, 2), np.float32))
    with pytest.raises(ValueError, match="split 5 rows"):
        rows.split(joined, [runtime.buffer(f"short{k}", (2, 4, 2, 2), np.float32) for k in range(2)])
