"""Prune the image's venv to what the ONNX Runtime providers load (run inside the image build, by the venv's own
Python: ``prune.py VENV VARIANT``). What is not in the providers' closure is not shipped:

- the closure is the project's own (engines/runtime/libdeps.py): DT_NEEDED from each provider library the variant
  ships (CUDA; TensorRT too for ``trt``), plus what it dlopens (libdeps.DLOPENED), plus cuDNN's sub-libraries
  (libcudnn.so.9 dlopens its libcudnn_*.so.9 siblings by name), each walked through its own DT_NEEDED;
- plus what those NVIDIA libraries name for dlopen: a kept library under the wheel folders whose bytes contain a
  wheel library's soname pulls it in. That keeps NVRTC (cuBLASLt and cuDNN's engines name libnvrtc.so.13) and
  nvJitLink (cuDNN's tensor-IR engines): absent from every DT_NEEDED, loaded all the same;
- every other shared library under the NVIDIA wheels (nvidia/, tensorrt_libs/) is deleted: cuFFT (only the CUDA
  provider names it, lazily, for FFT ops Stable Diffusion never runs: libdeps.DLOPENED), cuFFTW, NVBLAS;
- headers, static libraries and test folders go too.
The build fails when the closure needs a library the venv lacks (other than the driver's, which the container
runtime injects). The record (kept / dropped, with sizes) is written to VENV/prune.json for the content record.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
try:
    import libdeps  # type: ignore[import-not-found]  # beside this file in the image build
except ImportError:  # a checkout
    from engines.runtime import libdeps

WHEEL_DIRS = ("nvidia", "tensorrt_libs")
FAMILIES = {"libcudnn.so.9": "libcudnn_*.so.9"}
"""A kept library -> the siblings it dlopens by name (cuDNN 9 splits itself into sub-libraries loaded on demand)."""
SONAME = re.compile(rb"lib[A-Za-z0-9_+-]+\.so(?:\.[0-9]+)*")
JUNK_SUFFIXES = (".a", ".rlib", ".h", ".hpp", ".cuh")
"""Static archives and headers: nothing loads them at run time (``.rlib``: the C2PA wheel's 31 MB Rust archive)."""
JUNK_DIRS = ("include", "tests")
JUNK_TREES = ("onnx/backend/test/data",)
"""onnx's backend conformance models (18 MB): data files no import reaches."""


def _walk(roots: list[Path], keep: dict[str, str], missing: dict[str, str]) -> None:
    """Add each root and everything its DT_NEEDED reaches to ``keep`` (soname -> path)."""
    queue = list(roots)
    while queue:
        path = queue.pop()
        info = libdeps.read_elf(path)
        for soname in info.needed:
            if soname in keep or soname in missing:
                continue
            found = libdeps.resolve(soname, info.search_paths)
            if found is None:
                missing[soname] = f"needed by {path.name}; shipped by {libdeps.shipped_by(soname)}"
                continue
            keep[soname] = found
            queue.append(Path(found))


def _wheel_libs(site: Path) -> list[Path]:
    return sorted(p for d in WHEEL_DIRS if (site / d).is_dir() for p in (site / d).rglob("*.so*") if p.is_file())


def _named(site: Path, keep: dict[str, str], missing: dict[str, str]) -> None:
    """Add the wheel libraries that kept wheel libraries name (dlopen by soname), to a fixed point."""
    available = _wheel_libs(site)
    scanned: set[str] = set()
    while True:
        todo = [Path(p) for p in keep.values() if p not in scanned and any(d in Path(p).parts for d in WHEEL_DIRS)]
        if not todo:
            return
        for path in todo:
            scanned.add(str(path))
            with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
                names = {m.decode() for m in SONAME.findall(data)}
            found = [p for p in available if p.name not in keep
                     and any(p.name == n or p.name.startswith(n + ".") for n in names)]
            keep.update({p.name: str(p) for p in found})
            _walk(found, keep, missing)


def named_unresolved(site: Path, keep: dict[str, str]) -> list[str]:
    """Sonames the kept wheel libraries name that no file in the venv answers (driver libraries aside): recorded
    before pruning, so a test can prove the pruned image lacks nothing more than the wheels never had."""
    names: set[str] = set()
    for path in (Path(p) for p in keep.values() if any(d in Path(p).parts for d in WHEEL_DIRS)):
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            names |= {m.decode() for m in SONAME.findall(data)}
    files = [p.name for p in _wheel_libs(site)]
    return sorted(n for n in names if n.startswith(("libcu", "libnv")) and "NVIDIA driver" not in
                  libdeps.shipped_by(n) and not any(f == n or f.startswith(n + ".") for f in files))


def closure(site: Path, variant: str) -> tuple[dict[str, str], dict[str, str]]:
    """(kept soname -> path, missing soname -> why) for the providers this variant ships."""
    providers = ["CUDAExecutionProvider", *(["TensorrtExecutionProvider"] if variant == "trt" else [])]
    keep: dict[str, str] = {}
    missing: dict[str, str] = {}
    capi = site / "onnxruntime" / "capi"
    for provider in providers:
        found = libdeps.provider_closure(provider, capi)
        keep.update(found.resolved)
        missing.update({k: f"needed by {found.needed_by[k]}; shipped by {v}" for k, v in found.missing.items()})
    for lib, pattern in FAMILIES.items():
        if lib in keep:
            siblings = sorted(Path(keep[lib]).parent.glob(pattern))
            keep.update({p.name: str(p) for p in siblings})
            _walk(siblings, keep, missing)
    _named(site, keep, missing)
    driver = {k: v for k, v in missing.items() if "NVIDIA driver" in v}
    return keep, {k: v for k, v in missing.items() if k not in driver}


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() and not path.is_symlink() else 0


def prune(site: Path, keep: dict[str, str]) -> dict[str, int]:
    """Delete what no provider loads and the junk; returns removed path (relative to site) -> bytes."""
    kept = {os.path.realpath(p) for p in keep.values()}
    removed: dict[str, int] = {}
    for top in (site / d for d in WHEEL_DIRS):
        for path in sorted(top.rglob("*.so*")) if top.is_dir() else []:
            if path.is_file() and os.path.realpath(path) not in kept:
                removed[str(path.relative_to(site))] = _size(path)
                path.unlink()
    for tree in (site / t for t in JUNK_TREES if (site / t).is_dir()):
        removed[str(tree.relative_to(site)) + "/"] = sum(_size(p) for p in tree.rglob("*"))
        shutil.rmtree(tree)
    for path in sorted(site.rglob("*")):
        if not path.exists():
            continue
        if path.is_dir() and path.name in JUNK_DIRS and (path.name != "include" or WHEEL_DIRS[0] in path.parts):
            removed[str(path.relative_to(site)) + "/"] = sum(_size(p) for p in path.rglob("*"))
            shutil.rmtree(path)
        elif path.is_file() and path.suffix in JUNK_SUFFIXES:
            removed[str(path.relative_to(site))] = _size(path)
            path.unlink()
    return removed


def main(venv: Path, variant: str) -> int:
    site = Path(sysconfig.get_path("purelib"))
    keep, missing = closure(site, variant)
    if missing:
        for soname, why in sorted(missing.items()):
            print(f"prune: the provider closure needs {soname}, which the image lacks ({why})", file=sys.stderr)
        return 1
    unresolved = named_unresolved(site, keep)
    removed = prune(site, keep)
    record = {"variant": variant, "kept": {k: [v, _size(Path(v))] for k, v in sorted(keep.items())},
              "named_unresolved": unresolved,
              "removed": removed, "removed_bytes": sum(removed.values())}
    (venv / "prune.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    libs = [p for p in removed if ".so" in p]
    print(f"prune: kept {len(keep)} libraries; removed {len(libs)} libraries and {len(removed) - len(libs)} "
          f"other paths, {record['removed_bytes'] / 1e6:.0f} MB")
    for path in libs:
        print(f"prune:   - {path} ({removed[path] / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
