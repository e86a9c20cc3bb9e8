"""Host staging buffers. On a GPU: page-locked memory from cudaHostAlloc (ctypes on libcudart), so host<->device
copies run at full PCIe/NVLink speed instead of through a pageable bounce buffer. On the CPU: plain numpy memory.
ORT 1.31 cannot allocate pinned OrtValues itself ('Unsupported device type: cuda_pinned')."""

from __future__ import annotations

import ctypes
import math
from typing import Protocol

import numpy as np

from engines.errors import GpuUnavailableError
from engines.runtime.libdeps import resolve


class HostAllocator(Protocol):
    kind: str

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray: ...

    def free(self, array: np.ndarray) -> None: ...

    def close(self) -> None: ...


class PageableAllocator:
    kind = "pageable"

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def free(self, array: np.ndarray) -> None:
        return None

    def close(self) -> None:
        return None


class PinnedAllocator:
    """cudaHostAlloc/cudaFreeHost through libcudart; every buffer is freed on close()."""

    kind = "pinned"

    def __init__(self, soname: str = "libcudart.so.13") -> None:
        path = resolve(soname)
        try:
            self._cudart = ctypes.CDLL(path or soname)
        except OSError as exc:
            raise GpuUnavailableError(f"pinned host memory needs {soname}: {exc}") from exc
        self._cudart.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        self._cudart.cudaHostAlloc.restype = ctypes.c_int
        self._cudart.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self._cudart.cudaFreeHost.restype = ctypes.c_int
        self._pointers: list[int] = []

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
        ptr = ctypes.c_void_p()
        status = self._cudart.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0)
        if status != 0 or not ptr.value:
            raise GpuUnavailableError(f"cudaHostAlloc({nbytes} bytes) failed with CUDA error {status}")
        self._pointers.append(ptr.value)
        raw = memoryview((ctypes.c_byte * nbytes).from_address(ptr.value)).cast("B")
        array: np.ndarray = np.frombuffer(raw, dtype=np.dtype(dtype), count=math.prod(shape)).reshape(shape)
        return array

    def free(self, array: np.ndarray) -> None:
        address = array.ctypes.data
        if address in self._pointers:
            self._pointers.remove(address)
            self._cudart.cudaFreeHost(ctypes.c_void_p(address))

    def close(self) -> None:
        while self._pointers:
            self._cudart.cudaFreeHost(ctypes.c_void_p(self._pointers.pop()))
