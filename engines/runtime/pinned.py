"""Host staging buffers. On a GPU: page-locked memory from cudaHostAlloc (ctypes on libcudart), so host<->device
copies run at full PCIe/NVLink speed instead of through a pageable bounce buffer. On the CPU: plain numpy memory.
ORT 1.31 cannot allocate pinned OrtValues itself ('Unsupported device type: cuda_pinned')."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Protocol

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


CUDART = "libcudart.so.13"


class CudaPointerAttributes(ctypes.Structure):
    """``struct cudaPointerAttributes`` as CUDA 13 lays it out (driver_types.h): the memory type, the device, the
    device and host aliases, then ``long reserved[8]`` (64 bytes on LP64) the runtime zero-fills; 88 bytes in all.
    A definition that stops at ``hostPointer`` (24 bytes, the CUDA 10-12 documentation's struct) makes
    cudaPointerGetAttributes write 64 bytes past the caller's buffer under CUDA 13."""

    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 8)]


def memory_type(cudart: Any, address: int) -> int:
    """``cudaPointerGetAttributes(address).type`` (cudaMemoryType); GpuUnavailableError when the runtime refuses."""
    cudart.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(CudaPointerAttributes), ctypes.c_void_p]
    cudart.cudaPointerGetAttributes.restype = ctypes.c_int
    attributes = CudaPointerAttributes()
    status = cudart.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(address))
    if status != 0:
        raise GpuUnavailableError(f"cudaPointerGetAttributes({address:#x}) failed with CUDA error {status}")
    return int(attributes.type)


def load_cudart(soname: str = CUDART) -> ctypes.CDLL:
    """libcudart, found where session creation finds it (engines/runtime/libdeps.py: preloaded wheel, then the
    loader's own path)."""
    path = resolve(soname)
    try:
        return ctypes.CDLL(path or soname)
    except OSError as exc:
        raise GpuUnavailableError(f"pinned host memory needs {soname}: {exc}") from exc


def cuda_pci_bus_ids(cudart: Any = None) -> list[str] | None:
    """PCI bus id of each CUDA ordinal as this process numbers them (after CUDA_VISIBLE_DEVICES), from
    cudaGetDeviceCount/cudaDeviceGetPCIBusId (device queries: no context is created). None when libcudart cannot
    load or the runtime refuses (no driver): the caller then cannot map ordinals to NVML indices."""
    try:
        lib = cudart if cudart is not None else load_cudart()
    except GpuUnavailableError:
        return None
    count = ctypes.c_int(0)
    if lib.cudaGetDeviceCount(ctypes.byref(count)) != 0:
        return None
    ids = []
    for ordinal in range(count.value):
        buffer = ctypes.create_string_buffer(64)
        if lib.cudaDeviceGetPCIBusId(buffer, len(buffer), ordinal) != 0:
            return None
        ids.append(buffer.value.decode())
    return ids


class PinnedAllocator:
    """cudaHostAlloc/cudaFreeHost through libcudart on the served device; every buffer is freed on close().

    cudaSetDevice(device_id) comes first on every call: the current device is per host thread and defaults to
    ordinal 0, so without it the first CUDA call from a request thread creates a context on GPU 0 even when this
    process serves --device-id 1 (memory and a context on a card another process owns)."""

    kind = "pinned"

    def __init__(self, device_id: int = 0, cudart: Any = None) -> None:
        self.device_id = device_id
        self._cudart = cudart if cudart is not None else load_cudart()
        self._cudart.cudaSetDevice.argtypes = [ctypes.c_int]
        self._cudart.cudaSetDevice.restype = ctypes.c_int
        self._cudart.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        self._cudart.cudaHostAlloc.restype = ctypes.c_int
        self._cudart.cudaFreeHost.argtypes = [ctypes.c_void_p]
        self._cudart.cudaFreeHost.restype = ctypes.c_int
        self._pointers: list[int] = []

    def _on_device(self) -> None:
        status = self._cudart.cudaSetDevice(self.device_id)
        if status != 0:
            raise GpuUnavailableError(f"cudaSetDevice({self.device_id}) failed with CUDA error {status}")

    def empty(self, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        nbytes = max(1, math.prod(shape) * np.dtype(dtype).itemsize)
        self._on_device()
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
            self._on_device()
            self._cudart.cudaFreeHost(ctypes.c_void_p(address))

    def close(self) -> None:
        if self._pointers:
            self._on_device()
        while self._pointers:
            self._cudart.cudaFreeHost(ctypes.c_void_p(self._pointers.pop()))


class ComputeStream:
    """One CUDA stream (cudaStreamCreate through ctypes on libcudart) that every CUDA session of one engine runs
    its kernels on, passed as the provider option ``user_compute_stream``: the CUDA provider then keeps no stream
    of its own (``external_stream_`` and ``use_ep_level_unified_stream_`` in the CUDAExecutionProvider
    constructor, onnxruntime/core/providers/cuda/cuda_execution_provider.cc; the address is parsed as a decimal
    size_t by CUDAExecutionProviderInfo::FromProviderOptions, cuda_execution_provider_info.cc, which sets
    has_user_compute_stream from it), so the runs of a tick are ordered by the stream itself and one
    cudaStreamSynchronize at the tick's end waits for all of them.

    Blocking on purpose (cudaStreamCreate, not cudaStreamNonBlocking): the binding's own host<->device copies
    (``OrtValue.update_inplace``, ``OrtValue.numpy()``) are cudaMemcpy calls on the legacy default stream, which
    waits for a blocking stream's earlier work and makes its later work wait, so an upload between two runs of a
    tick cannot overtake the run that still reads the buffer it overwrites."""

    kind = "cuda"

    def __init__(self, device_id: int = 0, cudart: Any = None) -> None:
        self.device_id = device_id
        self._cudart = cudart if cudart is not None else load_cudart()
        for name, args in (("cudaSetDevice", [ctypes.c_int]), ("cudaStreamCreate", [ctypes.POINTER(ctypes.c_void_p)]),
                           ("cudaStreamSynchronize", [ctypes.c_void_p]), ("cudaStreamDestroy", [ctypes.c_void_p])):
            getattr(self._cudart, name).argtypes = args
            getattr(self._cudart, name).restype = ctypes.c_int
        self._call("cudaSetDevice", device_id)
        handle = ctypes.c_void_p()
        self._call("cudaStreamCreate", ctypes.byref(handle))
        if not handle.value:
            raise GpuUnavailableError("cudaStreamCreate returned no stream")
        self.address: int = handle.value
        """The cudaStream_t as an integer: the value of the ``user_compute_stream`` provider option."""

    def _call(self, name: str, *args: Any) -> None:
        status = getattr(self._cudart, name)(*args)
        if status != 0:
            raise GpuUnavailableError(f"{name} failed with CUDA error {status}")

    def synchronize(self) -> None:
        """Wait until every run and copy enqueued on the stream has finished (cudaStreamSynchronize)."""
        self._call("cudaSetDevice", self.device_id)
        self._call("cudaStreamSynchronize", ctypes.c_void_p(self.address))

    def close(self) -> None:
        """Wait for the stream, then destroy it; the sessions that ran on it must be gone or idle."""
        if self.address:
            self.synchronize()
            self._call("cudaStreamDestroy", ctypes.c_void_p(self.address))
            self.address = 0


class HostStream:
    """The CPU provider's "stream": every run has finished when it returns, so nothing is left to wait for and a
    tick's runs are ordered by the calling thread. A tick on the CPU still counts the one synchronisation a
    shared device stream would issue (Runtime.one_tick)."""

    kind = "host"
    address = 0

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None
