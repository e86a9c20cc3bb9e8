"""An ONNX file's initializer element counts and types, read from the protobuf's field headers through a memory
map: the weights' bytes are never read or copied (onnx.load would hold an inline model whole). The wire format is
protobuf's (varint keys, length-delimited fields); the field numbers are onnx.proto's ModelProto.graph (7),
GraphProto.initializer (5) and node (1), TensorProto.dims (1), data_type (2), name (8), data_location (14)."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from engines.errors import ModelLoadError


@dataclass
class Scan:
    """What a model.onnx holds, read from its field headers: the weights' bytes are skipped, never read."""

    elements: dict[int, int] = field(default_factory=dict)
    """ONNX data type -> initializer elements."""
    weight_names: set[str] = field(default_factory=set)
    """Initializers a MatMul, Gemm or Conv takes as its weight (a LoRA's targets)."""
    shapes: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    """Initializer name -> (data type, dims)."""
    external: set[str] = field(default_factory=set)


def _varint(buf: mmap.mmap, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: mmap.mmap, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, a, b) of each field of the message ``buf[start:end]`` (protobuf wire format): a
    varint's value as (value, value), a length-delimited field's bytes as (start, end); fixed-size ones skipped."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield number, wire, value, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield number, wire, pos, pos + length
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {pos}")


def _tensor(buf: mmap.mmap, start: int, end: int, scan: Scan) -> None:
    dims: list[int] = []
    dtype, name, location = 1, "", ""
    for number, wire, a, b in _fields(buf, start, end):
        if number == 1:  # dims: one varint each, or packed
            dims += [a] if wire == 0 else _packed(buf, a, b)
        elif number == 2:
            dtype = a
        elif number == 8:
            name = bytes(buf[a:b]).decode()
        elif number == 13:  # external_data entries: key, value
            entry = {k: bytes(buf[s:e]).decode() for k, _, s, e in _fields(buf, a, b)}
            location = entry.get(2, "") if entry.get(1) == "location" else location
    scan.elements[dtype] = scan.elements.get(dtype, 0) + math.prod(dims)
    scan.shapes[name] = (dtype, tuple(dims))
    if location:
        scan.external.add(location)


def _packed(buf: mmap.mmap, start: int, end: int) -> list[int]:
    out, pos = [], start
    while pos < end:
        value, pos = _varint(buf, pos)
        out.append(value)
    return out


def _node(buf: mmap.mmap, start: int, end: int, scan: Scan) -> None:
    inputs, op = [], ""
    for number, _, a, b in _fields(buf, start, end):
        if number == 1:
            inputs.append(bytes(buf[a:b]).decode())
        elif number == 4:
            op = bytes(buf[a:b]).decode()
    if op in ("MatMul", "Gemm", "Conv") and len(inputs) > 1:
        scan.weight_names.add(inputs[1])


def scan_onnx(path: Path) -> Scan:
    """The initializers (types, dims, external files) and LoRA-targetable weights of ``path``, from a memory map
    whose weight pages are never touched. ModelLoadError when it is not a readable ONNX model."""
    scan = Scan()
    try:
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for number, _, a, b in _fields(buf, 0, len(buf)):
                if number != 7:  # ModelProto.graph
                    continue
                for inner, _, s, e in _fields(buf, a, b):
                    if inner == 5:  # GraphProto.initializer
                        _tensor(buf, s, e, scan)
                    elif inner == 1:  # GraphProto.node
                        _node(buf, s, e, scan)
    except (OSError, ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not a readable ONNX model ({exc})") from exc
    scan.weight_names &= set(scan.shapes)
    return scan


# ---- the folder's components --------------------------------------------------------------------------------------
