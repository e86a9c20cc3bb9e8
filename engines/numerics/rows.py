"""Rows of several requests in one denoiser call (step-level batching), joined and split on the device.

Each running request keeps its own device state (latents, history, the UNet's input and output; Runtime.scoped).
At a tick the UNet inputs of every request in the running set are joined along the batch axis by one ``Concat``
call per input (a graph per number of requests up to ``JOIN_MAX``; more are joined in a chain), the UNet runs
once, and one call of a graph of ``Slice`` nodes copies each request's rows of the output back into its own output
buffer; nothing comes to the host. One call per input instead of one per request and input: a tick of four
requests makes 9 small calls (3 joins, the split, 4 step graphs) instead of 17, each a fixed cost on a CPU and a
launch on a GPU. A decode of a few of a request's images takes
their rows of the latents the same way (``take``). Concat and Slice are exact copies, so a row's
result differs from its solo run only by the UNet's own batch-size numerics (within 1/255 on the images:
tests/integration/test_step_batching.py). ``Slice`` reads its ``starts``/``ends`` from host memory on CUDA (the
kernel registers inputs 1-4 as OrtMemTypeCPUInput, onnxruntime/core/providers/cuda/tensor/slice.cc), so they are
shape feeds, not host->device copies.

One session per (element type, rank, number of requests) is created at load, never on a request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from engines.numerics.step_graph import elem_type, serialize


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


def build_concat_graph(dtype: type[np.generic], rank: int, count: int = 2) -> bytes:
    """``out = Concat(x0, ..., x<count-1>, axis=0)``: the rows of each input in order."""
    elem = elem_type(dtype) if np.dtype(dtype).kind == "f" else _int_elem(dtype)
    names = [f"x{k}" for k in range(count)]
    ins = [helper.make_tensor_value_info(n, elem, [f"{n}_rows", *_dims(rank)[1:]]) for n in names]
    out = helper.make_tensor_value_info("out", elem, ["rows", *_dims(rank)[1:]])
    return serialize([helper.make_node("Concat", names, ["out"], axis=0)], "sdserve_rows_concat", ins, [out], [])


def build_split_graph(dtype: type[np.generic], rank: int, count: int) -> bytes:
    """``out<k> = x[starts<k>:ends<k>]`` along axis 0 for every k < ``count`` (int64 [1] bounds): every part's
    rows in one call. Slice, not Split: Slice's bounds are read from host memory on CUDA (see the module doc), so
    they stay shape feeds."""
    elem = elem_type(dtype) if np.dtype(dtype).kind == "f" else _int_elem(dtype)
    x = helper.make_tensor_value_info("x", elem, _dims(rank))
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [0])
    bounds, outs, nodes = [], [], []
    for k in range(count):
        bounds += [helper.make_tensor_value_info(f"{n}{k}", TensorProto.INT64, [1]) for n in ("starts", "ends")]
        outs.append(helper.make_tensor_value_info(f"out{k}", elem, [f"rows{k}", *_dims(rank)[1:]]))
        nodes.append(helper.make_node("Slice", ["x", f"starts{k}", f"ends{k}", "axes"], [f"out{k}"]))
    return serialize(nodes, "sdserve_rows_split", [x, *bounds], outs, [axes])


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


JOIN_MAX = 4
"""Requests one join or split call takes at most (the default max_batch: a tick of 1-image requests); a tick of more
requests chains the calls."""
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
        self._concat = {(self._key(d, r), n): make(build_concat_graph(d, r, n), f"rows_concat{n}_{self._key(d, r)}")
                        for d, r in dict.fromkeys(kinds) for n in range(2, JOIN_MAX + 1)}
        self._slices = {self._key(d, r): make(build_slice_graph(d, r), f"rows_slice_{self._key(d, r)}")
                        for d, r in dict.fromkeys([out, *takes])}
        self._slice = self._slices[self._key(*out)]
        self._splits = {n: make(build_split_graph(*out, n), f"rows_split{n}_{self._key(*out)}")
                        for n in range(2, JOIN_MAX + 1)}

    @staticmethod
    def _key(dtype: type[np.generic], rank: int) -> str:
        return f"{np.dtype(dtype).name}_r{rank}"

    def join(self, tag: str, values: Sequence[ort.OrtValue]) -> ort.OrtValue:
        """The rows of every value in order, in one device tensor (the value itself when there is one): one call
        per ``JOIN_MAX`` values."""
        joined, k = list(values), 0
        while len(joined) > 1:
            part = joined[:JOIN_MAX]
            shape = tuple(part[0].shape())
            dtype = _numpy_type(part[0])
            out = self.buffers.buffer(f"rows_{tag}{k}", (sum(v.shape()[0] for v in part), *shape[1:]), dtype)
            self._concat[(self._key(dtype, len(shape)), len(part))].run(
                {f"x{i}": value for i, value in enumerate(part)}, {"out": out})
            joined, k = [out, *joined[JOIN_MAX:]], k + 1
        return joined[0]

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
        """Copy consecutive row ranges of ``joined`` into ``parts`` (their row counts sum to joined's): one call per
        ``JOIN_MAX`` parts."""
        offset = 0
        for first in range(0, len(parts), JOIN_MAX):
            chunk = parts[first:first + JOIN_MAX]
            feeds: dict[str, ort.OrtValue | np.ndarray] = {"x": joined}
            outputs = {}
            for k, part in enumerate(chunk):
                rows = part.shape()[0]
                suffix = k if len(chunk) > 1 else ""
                feeds[f"starts{suffix}"], feeds[f"ends{suffix}"] = _shape(offset), _shape(offset + rows)
                outputs[f"out{suffix}"] = part
                offset += rows
            (self._splits[len(chunk)] if len(chunk) > 1 else self._slice).run(feeds, outputs)
        if offset != joined.shape()[0]:
            raise ValueError(f"split {joined.shape()[0]} rows into parts of {offset}")


def _shape(value: int) -> ShapeFeed:
    return shape_feed([value])


_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(double)": np.float64}


def _numpy_type(value: ort.OrtValue) -> type[np.generic]:
    return _TYPES[value.data_type()]  # type: ignore[return-value]
