"""A safetensors reader for untrusted LoRA files, on numpy alone (no torch, never pickle).

The format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [b, e]},
"__metadata__": {str: str}}``, then the tensor bytes, offsets relative to the end of the header. Every number in
the header is checked before any tensor is read: the header size against a limit, each tensor's offsets inside
the file, its byte length equal to its shape times its element size, no overlap, no unknown dtype. A file that
fails any of these raises LoraFileError naming the file and what is wrong; nothing is read past what was checked.
A header JSON nested too deep or holding an integer over Python's digit limit is refused the same way.

A file is read in one pass through a ``Stream`` that hashes every byte: at the scan the header, each tensor's
values (NaN, infinity and out-of-range values refused) and the file's sha256 come from the same read; at a merge
the factors are read the same way and used only if that read hashes to the sha256 the scan recorded.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from engines.errors import InvalidRequestError

DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8")}
"""What LoRA weights come in; BF16 is widened to float32 by hand (numpy has no bfloat16)."""
BF16 = "BF16"
CHUNK = 1 << 22
"""Bytes read at a time (a multiple of every element size)."""
MAX_VALUE = 65504.0
"""float16's largest finite value: a LoRA factor beyond it is refused (check_values)."""


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


class Stream:
    """One pass over an opened LoRA file, front to back, hashing every byte it reads or skips: the digest is of
    the bytes this reader saw, so what was checked at the scan, or merged later, is exactly what was hashed (a file
    rewritten between a hash and a read cannot slip other bytes in under the old hash)."""

    def __init__(self, f: BinaryIO, name: str, size: int) -> None:
        self.f, self.name, self.size = f, name, size
        self.pos = 0
        self._digest = hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        while len(data) < n:  # a short read is not the end of a regular file until read() says so
            more = self.f.read(n - len(data))
            if not more:
                raise LoraFileError(f"LoRA file {self.name} changed while being read (it ends at byte "
                                    f"{self.pos + len(data)}, not {self.size})")
            data += more
        self._digest.update(data)
        self.pos += n
        return data

    def skip_to(self, pos: int) -> None:
        while self.pos < pos:
            self.read(min(CHUNK, pos - self.pos))

    def finish(self) -> str:
        """Reads (and hashes) the rest: the file's sha256 (LoraFileError when it is longer than when opened)."""
        self.skip_to(self.size)
        if self.f.read(1):
            raise LoraFileError(f"LoRA file {self.name} changed while being read (it grew past {self.size} bytes)")
        return self._digest.hexdigest()


def read_header(stream: Stream, max_header_bytes: int, max_file_bytes: int) -> Header:
    """The file's checked header, read from the start of ``stream`` (LoraFileError on any inconsistency)."""
    size, name = stream.size, stream.name
    if size > max_file_bytes:
        raise LoraFileError(f"LoRA file {name} is {size} bytes, over this server's limit of {max_file_bytes} "
                            "([runtime.lora] max_file_mb)")
    if size < 8:
        raise LoraFileError(f"LoRA file {name} is truncated: {size} bytes, shorter than a safetensors header")
    (length,) = struct.unpack("<Q", stream.read(8))
    if length > max_header_bytes:
        raise LoraFileError(f"LoRA file {name} declares a {length}-byte header, over the limit of "
                            f"{max_header_bytes} ([runtime.lora] max_header_kb)")
    if 8 + length > size:
        raise LoraFileError(f"LoRA file {name} is truncated: its header says {length} bytes, the file holds "
                            f"{size - 8} after the length")
    raw = stream.read(length)
    try:
        parsed = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # not UTF-8, not JSON, or an integer over Python's 4,300-digit conversion limit
        raise LoraFileError(f"LoRA file {name} is not a safetensors file: its header is not JSON "
                            f"({str(exc)[:200]})") from None
    except RecursionError:
        raise LoraFileError(f"LoRA file {name} is not a safetensors file: its header nests too deep") from None
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


def _in_order(header: Header) -> list[tuple[str, TensorEntry]]:
    return sorted(header.tensors.items(), key=lambda kv: kv[1].begin)


def check_values(stream: Stream, header: Header) -> None:
    """Every tensor's values, read in file order a chunk at a time: LoraFileError for a NaN, an infinity, or a
    value beyond float16's range (no trained factor is that large; it would overflow a float16 model's weight), so
    a file that could only poison its requests' images is refused at the scan, not found out by a 500 later."""
    for key, t in _in_order(header):
        stream.skip_to(header.data_start + t.begin)
        remaining = t.end - t.begin
        while remaining:
            piece = stream.read(min(CHUNK, remaining))
            remaining -= len(piece)
            values = _as_float(piece, t.dtype)
            if values.size and not float(np.abs(values).max()) <= MAX_VALUE:  # NaN compares false: refused too
                raise LoraFileError(f"LoRA file {stream.name}: tensor {key} holds NaN, infinite or out-of-range "
                                    f"values (beyond +-{MAX_VALUE:g}): a broken file, refused")


def _as_float(raw: bytes, dtype: str) -> np.ndarray:
    """The values of ``raw``: float32 for BF16 (widened by hand), else the stored dtype (no copy)."""
    if dtype == BF16:
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype=DTYPES[dtype])


def read_tensors(stream: Stream, header: Header, keys: list[str]) -> dict[str, np.ndarray]:
    """The named tensors, read in file order through ``stream`` (which hashes every byte, the others' too):
    F32/F16/F64 in their stored dtype (read-only views of the bytes read, no copy), BF16 widened to float32. The
    caller compares ``stream.finish()`` with the hash it trusts before using them."""
    wanted = set(keys)
    out: dict[str, np.ndarray] = {}
    for key, t in _in_order(header):
        if key not in wanted:
            continue
        stream.skip_to(header.data_start + t.begin)
        out[key] = _as_float(stream.read(t.end - t.begin), t.dtype).reshape(t.shape)
    return out


def memory_bytes(header: Header, keys: list[str]) -> int:
    """Host bytes ``read_tensors`` holds for ``keys`` (BF16 is widened to 4 bytes a value)."""
    return sum(t.end - t.begin if t.dtype != BF16 else 2 * (t.end - t.begin)
               for t in (header.tensors[k] for k in set(keys)))
