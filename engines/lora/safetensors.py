"""A safetensors reader for untrusted LoRA files, on numpy alone (no torch, never pickle).

The format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [b, e]},
"__metadata__": {str: str}}``, then the tensor bytes, offsets relative to the end of the header. Every number in
the header is checked before any tensor is read: the header size against a limit, each tensor's offsets inside
the file, its byte length equal to its shape times its element size, no overlap, no unknown dtype. A file that
fails any of these raises LoraFileError naming the file and what is wrong; nothing is read past what was checked.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.errors import InvalidRequestError

DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}
"""What LoRA weights come in; BF16 is widened to float32 by hand (numpy has no bfloat16)."""
BF16 = "BF16"


class LoraFileError(InvalidRequestError):
    """A LoRA file that cannot be used: the message names the file and the problem (a 400/422, never a 500)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="loras")


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: the tensors' places in the file and the string metadata."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


def read_header(path: Path, max_header_bytes: int, max_file_bytes: int) -> Header:
    """The file's checked header (LoraFileError on any inconsistency)."""
    size = path.stat().st_size
    name = path.name
    if size > max_file_bytes:
        raise LoraFileError(f"LoRA file {name} is {size} bytes, over this server's limit of {max_file_bytes} "
                            "([runtime.lora] max_file_mb)")
    if size < 8:
        raise LoraFileError(f"LoRA file {name} is truncated: {size} bytes, shorter than a safetensors header")
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > max_header_bytes:
            raise LoraFileError(f"LoRA file {name} declares a {length}-byte header, over the limit of "
                                f"{max_header_bytes} ([runtime.lora] max_header_kb)")
        if 8 + length > size:
            raise LoraFileError(f"LoRA file {name} is truncated: its header says {length} bytes, the file holds "
                                f"{size - 8} after the length")
        raw = f.read(length)
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraFileError(f"LoRA file {name} is not a safetensors file: its header is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise LoraFileError(f"LoRA file {name}: the safetensors header is not a JSON object")
    return _check(name, parsed, 8 + length, size)


def _check(name: str, parsed: dict[str, Any], data_start: int, size: int) -> Header:
    meta = parsed.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise LoraFileError(f"LoRA file {name}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for key, entry in parsed.items():
        tensors[key] = _entry(name, key, entry, size - data_start)
    spans = sorted((t.begin, t.end, k) for k, t in tensors.items())
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise LoraFileError(f"LoRA file {name}: tensors {a} and {b} overlap")
    return Header(tensors, dict(meta), data_start)


def _entry(name: str, key: str, entry: Any, data_bytes: int) -> TensorEntry:
    if not isinstance(entry, dict):
        raise LoraFileError(f"LoRA file {name}: tensor {key} has no dtype/shape/data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES and dtype != BF16:
        raise LoraFileError(f"LoRA file {name}: tensor {key} has dtype {dtype!r}; LoRA weights must be F32, F16, "
                            "BF16 or F64")
    if not (isinstance(shape, list) and len(shape) <= 4 and all(isinstance(d, int) and 0 <= d < 2**31
                                                                 for d in shape)):
        raise LoraFileError(f"LoRA file {name}: tensor {key} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise LoraFileError(f"LoRA file {name}: tensor {key} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    itemsize = 2 if dtype == BF16 else DTYPES[dtype].itemsize
    if not 0 <= begin <= end <= data_bytes:
        raise LoraFileError(f"LoRA file {name} is truncated or corrupt: tensor {key} lies at bytes {begin}-{end} "
                            f"of a {data_bytes}-byte data section")
    if end - begin != math.prod(shape) * itemsize:
        raise LoraFileError(f"LoRA file {name}: tensor {key} holds {end - begin} bytes, its shape {shape} needs "
                            f"{math.prod(shape) * itemsize}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def read_tensors(path: Path, header: Header, keys: list[str]) -> dict[str, np.ndarray]:
    """The named tensors as float32 arrays (read after ``read_header`` checked their places)."""
    out: dict[str, np.ndarray] = {}
    with path.open("rb") as f:
        for key in keys:
            t = header.tensors[key]
            f.seek(header.data_start + t.begin)
            raw = f.read(t.end - t.begin)
            if len(raw) != t.end - t.begin:
                raise LoraFileError(f"LoRA file {path.name} changed while being read (tensor {key} is short)")
            if t.dtype == BF16:
                wide = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
                array = wide.view(np.float32)
            else:
                array = np.frombuffer(raw, dtype=DTYPES[t.dtype]).astype(np.float32)
            out[key] = array.reshape(t.shape)
    return out
