"""What `sdserve engines build` of a DiT folder needs from the node before it starts: host RAM at the build's peak,
device memory while building, and disk (and device memory when served) per size; and the refusal when the node
cannot hold it. Qwen-Image is the case that matters: its 20B transformer is 38 GiB in bf16, and every served size
adds an engine of that size.

The weights come from the memory plan's per-component records (engines/health/memory_plan.py ``component``: the
export's headers, or the config's parameter counts, engines/health/param_counts.py), at the engine precision the
TensorRT plan builds (engines/build/trtplan_dit.py ``precision``). Components build one at a time
(engines/build/trt_build.py), so the peak is the largest component's. ESTIMATES, not measurements (no TensorRT
build of a DiT has run on a node yet):

- **Host** (``HOST_ENGINE_COPIES``): ONNX Runtime holds the parsed graph's weights (the ONNX file's bytes; external
  data is read, not only mapped, when the TensorRT parser takes the initializers), TensorRT's builder holds the
  network's weights at the engine precision, and the serialized engine is one more host buffer before it is written:
  the file + 2 x the engine, plus ``OVERHEAD``. For Qwen-Image's transformer exported in bf16: 38 + 2 x 38 + 2 GiB,
  ~3x its weights (the issue's 2-3x); exported in fp32: 76 + 76 + 2 GiB.
- **Device** while building (``DEVICE_ENGINE_COPIES``): the engine's weights and the builder's copy of them during
  tactic timing, plus ``OVERHEAD`` (workspace, CUDA context).
- **Disk**: per served size, one engine per component (its weights at the engine precision; the context model is
  a few kB). Served, each size's engines are on the device at once (the memory plan's TensorRT line).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.errors import ArtifactError
from engines.health.memory_plan import GIB, OVERHEAD, Served, component, layout

HOST_ENGINE_COPIES = 2
"""ESTIMATE: TensorRT's builder's copy of the weights and the serialized engine, each at the engine precision."""
DEVICE_ENGINE_COPIES = 2
"""ESTIMATE: the engine's weights and the builder's working copy during tactic timing."""


@dataclass(frozen=True)
class BuildEstimate:
    """A DiT folder's TensorRT build, per the module docstring's rules (bytes)."""

    model: str
    sizes: int
    engines: dict[str, int]
    """Component -> its engine's bytes (weights at the engine precision)."""
    precision: dict[str, str]
    largest: str
    """The component whose build sets the peaks."""
    host_peak: int
    device_build_peak: int
    disk_per_size: int
    disk_total: int
    device_served: int
    """Every size's engines' weights on the device at once (activations apart: the memory plan has them)."""

    def lines(self) -> list[str]:
        """What `sdserve doctor` prints."""
        big = self.largest
        return [f"TensorRT build estimate — {self.model}, {self.sizes} served size(s) (estimates, not measured)",
                *(f"  engine {c:<15} {self.precision[c]:<5} {_gib(n):>11} per size" for c, n in self.engines.items()),
                f"  host RAM peak while building ({big}): {_gib(self.host_peak)}",
                f"  device memory peak while building ({big}): {_gib(self.device_build_peak)}",
                f"  disk: {_gib(self.disk_per_size)} per size, {_gib(self.disk_total)} for {self.sizes} size(s); "
                f"device for the served engines' weights: {_gib(self.device_served)}"]


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def estimate(folder: Path, sizes: int) -> BuildEstimate:
    """The build estimate of a DiT folder served at ``sizes`` sizes; ModelLoadError when it is no served family."""
    lay = layout(folder)
    served = Served(1024, 1024, 1, max(1, sizes))
    parts = [component(folder, name, kind, lay, served, None) for name, kind in lay.parts.items()]
    engines = {c.name: c.weights for c in parts if c.source != "missing"}
    files = {c.name: c.file_bytes for c in parts}
    largest = max(engines, key=lambda c: files[c] + HOST_ENGINE_COPIES * engines[c])
    per_size = sum(engines.values())
    return BuildEstimate(folder.name, served.sizes, engines, {c.name: c.dtype for c in parts if c.name in engines},
                         largest, files[largest] + HOST_ENGINE_COPIES * engines[largest] + OVERHEAD,
                         DEVICE_ENGINE_COPIES * engines[largest] + OVERHEAD, per_size, per_size * served.sizes,
                         per_size * served.sizes)


def host_memory() -> tuple[int, str]:
    """The node's host RAM and where it was read: the physical memory (``os.sysconf``), or the cgroup v2 limit of
    this process's container when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    source = "physical memory"
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text(encoding="utf-8").strip()
    except OSError:
        return total, source
    if limit.isdigit() and int(limit) < total:
        return int(limit), "the container's cgroup memory.max"
    return total, source


def free_disk(folder: Path) -> int:
    """Free bytes on the file system the engines are written to (inside the model folder)."""
    return shutil.disk_usage(folder).free


def require_fits(found: BuildEstimate, folder: Path) -> dict[str, Any]:
    """ArtifactError (exit 23) naming the model, the numbers and what to change when the node's host RAM or the
    model folder's free disk cannot hold the build; else the readings."""
    ram, ram_source = host_memory()
    disk = free_disk(folder)
    short = []
    if found.host_peak > ram:
        short.append(f"host RAM: the build of {found.largest} peaks at about {_gib(found.host_peak)}, this node has "
                     f"{_gib(ram)} ({ram_source})")
    if found.disk_total > disk:
        short.append(f"disk: {found.sizes} size(s) x {_gib(found.disk_per_size)} of engines = "
                     f"{_gib(found.disk_total)}, {folder} has {_gib(disk)} free")
    if short:
        raise ArtifactError(f"TensorRT build of {found.model} refused before starting: " + "; ".join(short)
                            + " (estimates: `sdserve doctor` prints them; build on a node with more host RAM or "
                            "disk, serve fewer sizes, or export at a lower precision with `sdserve engines export "
                            "--dtype bf16`)")
    return {"host_ram": ram, "host_ram_source": ram_source, "free_disk": disk}
