"""Dependency closure of ONNX Runtime's provider libraries: which shared libraries each needs, which resolve, which
are missing, and which package ships each missing one. Reads ELF headers directly (no ldd, no loading)."""

from __future__ import annotations

import mmap
import os
import re
import struct
import subprocess
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 1, 5, 15, 29
PT_LOAD, PT_DYNAMIC = 1, 2

# soname prefix -> what ships it. CUDA 13 wheels are unsuffixed (nvidia-cublas 13.x), cuDNN is nvidia-cudnn-cu13.
SHIPPED_BY: tuple[tuple[str, str], ...] = (
    ("libcublasLt.so", "pip nvidia-cublas (CUDA 13) or the CUDA 13 toolkit"),
    ("libcublas.so", "pip nvidia-cublas (CUDA 13) or the CUDA 13 toolkit"),
    ("libcudart.so", "pip nvidia-cuda-runtime (onnxruntime-gpu[cuda]) or the CUDA 13 toolkit"),
    ("libcurand.so", "pip nvidia-curand (onnxruntime-gpu[cuda]) or the CUDA 13 toolkit"),
    ("libcufft.so", "pip nvidia-cufft (onnxruntime-gpu[cuda]) or the CUDA 13 toolkit"),
    ("libnvrtc.so", "pip nvidia-cuda-nvrtc (onnxruntime-gpu[cuda]) or the CUDA 13 toolkit"),
    ("libcudnn", "pip nvidia-cudnn-cu13 (onnxruntime-gpu[cudnn]) or Debian/Ubuntu libcudnn9-cuda-13"),
    ("libnvinfer", "pip tensorrt-cu13-libs 10.x (pin tensorrt-cu13==10.*; TensorRT 11 does not load)"),
    ("libnvonnxparser", "pip tensorrt-cu13-libs 10.x (pin tensorrt-cu13==10.*; TensorRT 11 does not load)"),
    ("libcuda.so", "the NVIDIA driver on the host (in containers: the NVIDIA container toolkit, --gpus)"),
    ("libnvidia-ml.so", "the NVIDIA driver on the host (in containers: the NVIDIA container toolkit, --gpus)"),
)

# Loaded with dlopen at session creation, so absent from DT_NEEDED but required all the same.
DLOPENED: dict[str, tuple[str, ...]] = {
    "CUDAExecutionProvider": ("libcudnn.so.9", "libcufft.so.12"),
    "TensorrtExecutionProvider": (),
}
PROVIDER_LIBRARIES = {"CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
                      "TensorrtExecutionProvider": "libonnxruntime_providers_tensorrt.so"}


def shipped_by(soname: str) -> str:
    for prefix, package in SHIPPED_BY:
        if soname.startswith(prefix):
            return package
    return "the operating system"


@dataclass(frozen=True)
class ElfInfo:
    needed: tuple[str, ...]
    search_paths: tuple[str, ...]


@lru_cache(maxsize=256)
def read_elf(path: Path) -> ElfInfo:
    """DT_NEEDED entries and RPATH/RUNPATH of a 64-bit little-endian ELF file (memory-mapped: provider libraries
    are hundreds of MB and only their headers and dynamic section are touched)."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _parse_elf(data, path)


def _parse_elf(data: mmap.mmap, path: Path) -> ElfInfo:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return ElfInfo((), ())
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + off) for off in range(0, dynamic[1], 16)]
    strtab_addr = next(v for t, v in entries if t == DT_STRTAB)
    strtab = next(off + strtab_addr - vaddr for vaddr, off, size in loads if vaddr <= strtab_addr < vaddr + size)

    def string(offset: int) -> str:
        end = data.find(b"\0", strtab + offset)
        return data[strtab + offset:end].decode()

    needed = tuple(string(v) for t, v in entries if t == DT_NEEDED)
    paths = tuple(p.replace("$ORIGIN", str(path.parent)) for t, v in entries if t in (DT_RPATH, DT_RUNPATH)
                  for p in string(v).split(":") if p)
    return ElfInfo(needed, paths)


@lru_cache(maxsize=1)
def _ld_cache() -> dict[str, str]:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for match in re.finditer(r"^\s*(\S+) \(([^)]*)\) => (\S+)$", out, re.MULTILINE):
        if "x86-64" in match.group(2) or "64bit" in match.group(2) or os.uname().machine not in ("x86_64",):
            found.setdefault(match.group(1), match.group(3))
    return found


def search_dirs() -> list[Path]:
    """Where the loader (and onnxruntime.preload_dlls) would look: LD_LIBRARY_PATH, pip nvidia-*/tensorrt wheels,
    the CUDA toolkit, and the standard library directories."""
    dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    site = Path(sysconfig.get_paths()["purelib"])
    for pattern in ("nvidia/*/lib", "nvidia/cu13/lib", "tensorrt_libs"):
        dirs += sorted(site.glob(pattern))
    dirs += [Path(p) for p in ("/usr/local/cuda/lib64", "/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                               "/lib64", "/usr/lib64", "/lib", "/usr/lib")]
    return [d for d in dirs if d.is_dir()]


def resolve(soname: str, extra: tuple[str, ...] = ()) -> str | None:
    for directory in [*(Path(p) for p in extra), *search_dirs()]:
        candidate = directory / soname
        if candidate.exists():
            return str(candidate)
    return _ld_cache().get(soname)


@dataclass
class Closure:
    provider: str
    library: str
    resolved: dict[str, str] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    """soname -> what ships it"""
    needed_by: dict[str, str] = field(default_factory=dict)


def provider_closure(provider: str, capi_dir: Path) -> Closure:
    """Walk DT_NEEDED from the provider library, plus the libraries it dlopens, breadth-first."""
    root = capi_dir / PROVIDER_LIBRARIES[provider]
    closure = Closure(provider, str(root))
    queue: list[tuple[str, Path]] = []
    info = read_elf(root)
    for name in (*info.needed, *DLOPENED.get(provider, ())):
        queue.append((name, root))
    seen: set[str] = set()
    while queue:
        soname, parent = queue.pop(0)
        if soname in seen:
            continue
        seen.add(soname)
        closure.needed_by[soname] = parent.name
        found = resolve(soname, read_elf(parent).search_paths if parent.exists() else ())
        if found is None:
            closure.missing[soname] = shipped_by(soname)
            continue
        closure.resolved[soname] = found
        if not soname.startswith(("libc.so", "libm.so", "libdl.so", "librt.so", "libpthread.so", "ld-linux")):
            queue.extend((n, Path(found)) for n in read_elf(Path(found)).needed)
    return closure
