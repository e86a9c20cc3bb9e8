"""Contention on this node, observed over a window: host CPU pressure (``/proc/pressure/cpu``), steal time
(``/proc/stat``), the load average per usable CPU, and other processes on the GPU (NVML's running compute
processes). The watchdog reads it around each canary so that "slow right now" can be told apart from "the fast
path broke": load is shared by every replica on the node, a broken fast path is this replica's own.

Pure file reads (no psutil); a signal the kernel does not expose here is None, never a guess."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Counters:
    """Raw cumulative counters at one instant (deltas of two give a window)."""

    at: float
    psi_some_us: int | None
    """/proc/pressure/cpu ``some total``: microseconds in which at least one runnable task waited for a CPU."""
    steal_ticks: int | None
    total_ticks: int | None


@dataclass(frozen=True)
class Contention:
    """What competed with this replica during one window (a canary, a batch)."""

    window_s: float
    cpu_pressure_percent: float | None
    """Share of the window in which a runnable task waited for a CPU (PSI "some"); None without PSI."""
    steal_percent: float | None
    """CPU time the hypervisor gave to other guests, % of all CPU time in the window; None without /proc/stat."""
    load_per_cpu: float | None
    """1-minute load average over the CPUs this process may use."""
    gpu_other_processes: int | None
    """Compute processes on our GPU besides this one (time-sliced neighbours); None without NVML."""

    def as_dict(self) -> dict[str, float | int | None]:
        return {"window_s": round(self.window_s, 3),
                "cpu_pressure_percent": _round(self.cpu_pressure_percent),
                "steal_percent": _round(self.steal_percent), "load_per_cpu": _round(self.load_per_cpu),
                "gpu_other_processes": self.gpu_other_processes}


@dataclass(frozen=True)
class ContentionThresholds:
    cpu_pressure_percent: float = 20.0
    steal_percent: float = 5.0
    load_per_cpu: float = 1.5
    """Used only where PSI is not exposed (the load average counts this process's own threads too)."""


def explanations(c: Contention, t: ContentionThresholds) -> list[str]:
    """Which observed signals explain slowness (empty: nothing on this node competed measurably)."""
    found = []
    if c.cpu_pressure_percent is not None and c.cpu_pressure_percent >= t.cpu_pressure_percent:
        found.append(f"host CPU pressure {c.cpu_pressure_percent:.0f}% of the window")
    if c.steal_percent is not None and c.steal_percent >= t.steal_percent:
        found.append(f"CPU steal {c.steal_percent:.1f}%")
    if c.cpu_pressure_percent is None and c.load_per_cpu is not None and c.load_per_cpu >= t.load_per_cpu:
        found.append(f"load {c.load_per_cpu:.2f} per CPU")
    if c.gpu_other_processes:
        found.append(f"{c.gpu_other_processes} other process(es) on the GPU")
    return found


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def _psi_some_us(root: Path) -> int | None:
    try:
        text = (root / "pressure" / "cpu").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
            return int(fields["total"]) if fields.get("total", "").isdigit() else None
    return None


def _stat_ticks(root: Path) -> tuple[int | None, int | None]:
    try:
        first = (root / "stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None, None
    if first[0] != "cpu" or len(first) < 9:
        return None, None
    values = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    return values[7], sum(values)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ContentionProbe:
    """``read()`` at the start of a window, ``since(start)`` at its end. ``gpu_processes`` (e.g.
    NvmlTelemetry.other_processes) counts the GPU's other compute processes."""

    def __init__(self, gpu_processes: Callable[[], int | None] | None = None, root: Path = PROC) -> None:
        self.gpu_processes, self.root = gpu_processes, root
        self.cpus = _cpus()

    def read(self) -> Counters:
        steal, total = _stat_ticks(self.root)
        return Counters(time.monotonic(), _psi_some_us(self.root), steal, total)

    def since(self, start: Counters) -> Contention:
        end = self.read()
        window = max(1e-6, end.at - start.at)
        pressure = None
        if start.psi_some_us is not None and end.psi_some_us is not None:
            pressure = min(100.0, 100.0 * (end.psi_some_us - start.psi_some_us) / (window * 1e6))
        steal = None
        if None not in (start.steal_ticks, start.total_ticks, end.steal_ticks, end.total_ticks):
            ticks = (end.total_ticks or 0) - (start.total_ticks or 0)
            steal = 100.0 * ((end.steal_ticks or 0) - (start.steal_ticks or 0)) / ticks if ticks > 0 else 0.0
        return Contention(window, pressure, steal, self._load(), self._gpu())

    def _load(self) -> float | None:
        try:
            return float((self.root / "loadavg").read_text().split()[0]) / self.cpus
        except (OSError, ValueError, IndexError):
            return None

    def _gpu(self) -> int | None:
        if self.gpu_processes is None:
            return None
        try:
            return self.gpu_processes()
        except Exception:  # NVML hiccups must not take the watchdog's contention report down
            return None
