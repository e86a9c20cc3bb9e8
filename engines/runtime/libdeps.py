"""Dependency closure of ONNX Runtime's provider libraries: which shared libraries each needs, which resolve, which
are missing, and which package ships each missing one. Reads ELF headers directly (no ldd, no loading)."""

from __future__ import annotations

import mmap
import os
import re
import struct
import subprocess
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

# Loaded with dlopen at session creation, so absent from DT_NEEDED but required all the same. cuFFT is not here: the
# 1.31.1 CUDA provider neither links it nor needs it at creation; it loads it lazily for Rfft/Irfft only ("cuFFT is
# unavailable for CUDA Execution Provider" in the provider library's strings), which Stable Diffusion never runs.
DLOPENED: dict[str, tuple[str, ...]] = {
    "CUDAExecutionProvider": ("libcudnn.so.9",),
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


# What the TensorRT provider needs from the pip TensorRT wheels (tensorrt-cu13-libs ships them in the
# `tensorrt_libs` package folder, off the loader's path). onnxruntime.preload_dlls() does not load TensorRT, so
# sdserve preloads these itself, by the same rule: a file that exists is loaded by its path.
TENSORRT_PRELOADS: tuple[tuple[str, ...], ...] = (
    ("tensorrt_libs", "libnvinfer.so.10"), ("tensorrt_libs", "libnvinfer_plugin.so.10"),
    ("tensorrt_libs", "libnvonnxparser.so.10"))
TENSORRT_BUILDER_GLOB = "libnvinfer_builder_resource.so.10*"
"""TensorRT dlopens its builder resource library (full version in the name, e.g. ``.so.10.13.0``) by bare name when
a builder is created ("Unable to load library: libnvinfer_builder_resource.so.10.x", NVIDIA/TensorRT issues #2218,
#3983): an engine build needs it found too, so it is preloaded from the wheel's folder like the others."""
# onnxruntime 1.31's list for CUDA 13 on Linux (onnxruntime/__init__.py, _get_nvidia_dll_paths), used only when the
# installed package no longer offers that function.
_ORT_CUDA13_PRELOADS: tuple[tuple[str, ...], ...] = (
    ("nvidia", "cu13", "lib", "libcublasLt.so.13"), ("nvidia", "cu13", "lib", "libcublas.so.13"),
    ("nvidia", "cu13", "lib", "libnvrtc.so.13"), ("nvidia", "cu13", "lib", "libcurand.so.10"),
    ("nvidia", "cu13", "lib", "libcufft.so.12"), ("nvidia", "cu13", "lib", "libcudart.so.13"),
    ("nvidia", "cudnn", "lib", "libcudnn.so.9"))
_PRELOADED: dict[bool, list[str]] = {}


def site_dir() -> Path:
    """The folder preload_dlls resolves its relative paths against: onnxruntime's parent (site-packages)."""
    import onnxruntime

    return Path(os.path.normpath(Path(onnxruntime.__file__).parent / ".."))


def ort_preload_paths() -> tuple[tuple[str, ...], ...]:
    """The (folders..., file) tuples onnxruntime.preload_dlls(cuda=True, cudnn=True) tries on Linux, read from the
    installed package itself so an upgrade that moves the wheels moves this too."""
    import onnxruntime

    paths = getattr(onnxruntime, "_get_nvidia_dll_paths", None)
    if paths is None:
        return _ORT_CUDA13_PRELOADS
    return tuple(tuple(p) for p in paths(False, True, True))


def preload_plan(site: Path | None = None, tensorrt: bool = True) -> dict[str, Path]:
    """soname -> file for every library the server preloads that exists: preload_dlls' list under ``site``, then
    the TensorRT wheel's. Once loaded, a later dlopen of that soname finds it whatever the search path."""
    root = site or site_dir()
    wanted = [*ort_preload_paths(), *(TENSORRT_PRELOADS if tensorrt else ())]
    plan: dict[str, Path] = {}
    for parts in wanted:
        candidate = root.joinpath(*parts)
        if candidate.is_file():
            plan.setdefault(parts[-1], candidate)
    if tensorrt:
        for candidate in sorted((root / TENSORRT_PRELOADS[0][0]).glob(TENSORRT_BUILDER_GLOB)):
            plan.setdefault(candidate.name, candidate)
    return plan


def preload(tensorrt: bool) -> list[str]:
    """Load what ``preload_plan`` names, as the server must before creating GPU sessions: provider libraries carry
    no RUNPATH, so pip CUDA/cuDNN/TensorRT libraries are found only this way (or through LD_LIBRARY_PATH).
    Calls onnxruntime.preload_dlls() (its printed complaints are returned, not printed), then the TensorRT wheel's
    libraries. Idempotent; returns what was loaded by path."""
    import contextlib
    import ctypes
    import io

    import onnxruntime

    if tensorrt in _PRELOADED:
        return list(_PRELOADED[tensorrt])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        onnxruntime.preload_dlls()
    loaded = []
    for soname, path in preload_plan(tensorrt=tensorrt).items():
        with contextlib.suppress(OSError):  # preflight reports what stays unresolved; session creation says why
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            loaded.append(f"{soname} ({path})")
    _PRELOADED[tensorrt] = [*loaded, *printed.getvalue().splitlines()]
    return list(_PRELOADED[tensorrt])


def search_dirs() -> list[Path]:
    """The loader's own directories for a library no RUNPATH names: LD_LIBRARY_PATH, then the standard library
    directories (the ld.so cache covers the rest). pip wheel folders are NOT here: the loader never looks there;
    they count only through ``preload_plan``, i.e. the files the server actually loads."""
    dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    dirs += [Path(p) for p in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
                               "/lib", "/usr/lib")]
    return [d for d in dirs if d.is_dir()]


def resolve(soname: str, extra: tuple[str, ...] = (), site: Path | None = None) -> str | None:
    """Where session creation will find ``soname``, in the loader's order: already loaded by the server's preload
    (the same files), the needing library's RPATH/RUNPATH (``extra``), LD_LIBRARY_PATH and the standard
    directories, then the ld.so cache. None: session creation would fail to load it."""
    planned = preload_plan(site).get(soname)
    if planned is not None:
        return str(planned)
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
    return library_closure(provider, capi_dir / PROVIDER_LIBRARIES[provider])


def library_closure(provider: str, root: Path) -> Closure:
    """The closure of any provider library ``root`` (a plugin EP's too: its RUNPATH, e.g. $ORIGIN, is honoured)."""
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
