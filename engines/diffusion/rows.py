"""Rows of several requests in one denoiser call (step-level batching), joined and split on the device.

Each running request keeps its own device state (latents, history, the UNet's input and output; Runtime.scoped).
At a tick the UNet inputs of every request in the running set are joined along the batch axis by a two-input
``Concat`` graph applied in a chain, the UNet runs once, and a ``Slice`` graph copies each request's rows of the
output back into its own output buffer; nothing comes to the host. A decode of a few of a request's images takes
their rows of the latents the same way (``take``). Concat and Slice are exact copies, so a row's
result differs from its solo run only by the UNet's own batch-size numerics (within 1/255 on the images:
tests/integration/test_step_batching.py). ``Slice`` reads its ``starts``/``ends`` from host memory on CUDA (the
kernel registers inputs 1-4 as OrtMemTypeCPUInput, onnxruntime/core/providers/cuda/tensor/slice.cc), so they are
shape feeds, not host->device copies.

One session per (element type, rank) is created at load, never on a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from engines.diffusion.step_graph import elem_type, serialize


class ShapeFeed(np.ndarray):
    """An int64 shape a graph input takes (a Reshape's target): ORT's CUDA and TensorRT providers read shape inputs
    from host memory (CUDA kernels register them as OrtMemTypeCPUInput), so binding it from the host is no
    host->device copy and the staging check (Runtime.host_reads) does not count it. ``shape_feed(dims)`` makes one."""


def shape_feed(dims: Sequence[int]) -> ShapeFeed:
    return np.asarray(dims, dtype=np.int64).view(ShapeFeed)


class Runnable(Protocol):
    def run(self, feeds: dict[str, ort.OrtValue | np.ndarray], outputs: dict[str, ort.OrtValue]) -> None: ...


class Buffers(Protocol):
    def buffer(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue: ...


def _dims(rank: int) -> list[str]:
    return [f"d{k}" for k in range(rank)]


def build_concat_graph(dtype: type[np.generic], rank: int) -> bytes:
    """``out = Concat(a, b, axis=0)``: the rows of ``a`` then those of ``b``."""
    elem = elem_type(dtype) if np.dtype(dtype).kind == "f" else _int_elem(dtype)
    a, b = (helper.make_tensor_value_info(n, elem, [f"{n}0", *_dims(rank)[1:]]) for n in ("a", "b"))
    out = helper.make_tensor_value_info("out", elem, ["rows", *_dims(rank)[1:]])
    return serialize([helper.make_node("Concat", ["a", "b"], ["out"], axis=0)], "sdserve_rows_concat", [a, b], [out],
                     [])


def build_slice_graph(dtype: type[np.generic], rank: int) -> bytes:
    """``out = x[starts:ends]`` along axis 0 (``starts``, ``ends``: int64 [1])."""
    elem = elem_type(dtype) if np.dtype(dtype).kind == "f" else _int_elem(dtype)
    x = helper.make_tensor_value_info("x", elem, _dims(rank))
    bounds = [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("starts", "ends")]
    out = helper.make_tensor_value_info("out", elem, ["rows", *_dims(rank)[1:]])
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    return serialize([helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["out"])], "sdserve_rows_slice",
                     [x, *bounds], [out], [axes])


def _int_elem(dtype: type[np.generic]) -> int:
    return {np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32}[np.dtype(dtype)]


LATENTS: tuple[tuple[type[np.generic], int], ...] = ((np.float32, 3), (np.float32, 4))
"""The latents' kinds (float32; packed tokens or channels-first images): a decode takes a few images of them."""


class RowPacker:
    """Joins per-request tensors along rows and splits a joined output back, on the device."""

    def __init__(self, buffers: Buffers, make: Callable[[bytes, str], Runnable],
                 kinds: Sequence[tuple[type[np.generic], int]], out: tuple[type[np.generic], int],
                 takes: Sequence[tuple[type[np.generic], int]] = LATENTS) -> None:
        """``kinds``: the (dtype, rank) of every input to join; ``out``: the output's, to split; ``takes``: those
        a part of is taken (``take``: the latents a decode reads a few images of)."""
        self.buffers = buffers
        self._concat = {self._key(d, r): make(build_concat_graph(d, r), f"rows_concat_{self._key(d, r)}")
                        for d, r in dict.fromkeys(kinds)}
        self._slices = {self._key(d, r): make(build_slice_graph(d, r), f"rows_slice_{self._key(d, r)}")
                        for d, r in dict.fromkeys([out, *takes])}
        self._slice = self._slices[self._key(*out)]

    @staticmethod
    def _key(dtype: type[np.generic], rank: int) -> str:
        return f"{np.dtype(dtype).name}_r{rank}"

    def join(self, tag: str, values: Sequence[ort.OrtValue]) -> ort.OrtValue:
        """The rows of every value in order, in one device tensor (the value itself when there is one)."""
        joined = values[0]
        for k, value in enumerate(values[1:], start=1):
            shape = tuple(value.shape())
            dtype = _numpy_type(value)
            out = self.buffers.buffer(f"rows_{tag}{k}", (joined.shape()[0] + shape[0], *shape[1:]), dtype)
            self._concat[self._key(dtype, len(shape))].run({"a": joined, "b": value}, {"out": out})
            joined = out
        return joined

    def take(self, tag: str, value: ort.OrtValue, start: int, stop: int) -> ort.OrtValue:
        """Rows ``start:stop`` of ``value`` in a device tensor of their own (the value itself when that is all of
        it)."""
        shape = tuple(value.shape())
        if (start, stop) == (0, shape[0]):
            return value
        dtype = _numpy_type(value)
        out = self.buffers.buffer(f"rows_take_{tag}", (stop - start, *shape[1:]), dtype)
        self._slices[self._key(dtype, len(shape))].run({"x": value, "starts": _shape(start), "ends": _shape(stop)},
                                                       {"out": out})
        return out

    def split(self, joined: ort.OrtValue, parts: Sequence[ort.OrtValue]) -> None:
        """Copy consecutive row ranges of ``joined`` into ``parts`` (their row counts sum to joined's)."""
        offset = 0
        for part in parts:
            rows = part.shape()[0]
            self._slice.run({"x": joined, "starts": _shape(offset), "ends": _shape(offset + rows)}, {"out": part})
            offset += rows
        if offset != joined.shape()[0]:
            raise ValueError(f"split {joined.shape()[0]} rows into parts of {offset}")


def _shape(value: int) -> ShapeFeed:
    return shape_feed([value])


_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(double)": np.float64}


def _numpy_type(value: ort.OrtValue) -> type[np.generic]:
    return _TYPES[value.data_type()]  # type: ignore[return-value]
