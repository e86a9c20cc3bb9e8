"""Time from process start to /ready 200 for the tiny model, and watchdog detection latency (fault injected ->
/ready 503) and recovery (fault removed -> 200), on a real `sdserve serve` process (dev profile, CPU).

    python benchmarks/bench_readiness.py --model models/tiny [--runs 3] [--write-readme docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from readme import write_section

DEV = Path(__file__).parents[1] / "configs" / "dev.toml"
LIVELOCK = [{"sm_percent": 98, "memory_percent": 0, "power_w": 38, "power_limit_w": 300}]


def _profile(tmp: Path, interval: float) -> Path:
    text = DEV.read_text().replace("interval_s = 5.0", f"interval_s = {interval}")
    text = text.replace("idle_before_canary_s = 1.0", "idle_before_canary_s = 0.1")
    path = tmp / "profile.toml"
    path.write_text(text)
    return path


def _start(model: Path, config: Path) -> tuple[subprocess.Popen[str], str, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(config), "--model",
                             str(model), "--port", "0"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:  # keep draining stderr so the server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in proc.stderr or []], daemon=True).start()
            return proc, match.group(1), t0
    raise RuntimeError("server did not start")


def _until(url: str, status: int, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if httpx.get(f"{url}/ready").status_code == status:
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"/ready never returned {status}")


def _injected_latency(url: str) -> float:
    """Large against this boot's own canary baseline (p50 from /capabilities), so detection does not depend on how
    loaded the machine was at boot: max(0.5 s, 10 x the per-image boot p50)."""
    shapes = httpx.get(f"{url}/capabilities", timeout=30).json()["self_test"]["shapes"]
    return max(0.5, 10 * min(s["p50_s"] for s in shapes))


def run(model: Path, runs: int, interval: float) -> dict[str, object]:
    boot, latency_detect, latency_recover, livelock_detect = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        config = _profile(Path(tmp), interval)
        for _ in range(runs):
            proc, url, t0 = _start(model, config)
            try:
                boot.append(_until(url, 200) - t0)
                t = time.monotonic()
                httpx.put(f"{url}/debug/faults", json={"latency_s": _injected_latency(url)})
                latency_detect.append(_until(url, 503) - t)
                t = time.monotonic()
                httpx.put(f"{url}/debug/faults", json={"latency_s": 0})
                latency_recover.append(_until(url, 200) - t)
                t = time.monotonic()
                httpx.put(f"{url}/debug/faults", json={"telemetry_trace": LIVELOCK})
                livelock_detect.append(_until(url, 503) - t)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    med = {k: round(statistics.median(v), 3) for k, v in (("boot_to_ready_s", boot),
                                                           ("latency_injection_to_503_s", latency_detect),
                                                           ("latency_removed_to_200_s", latency_recover),
                                                           ("livelock_trace_to_503_s", livelock_detect))}
    return {"runs": runs, "watchdog_interval_s": interval, "drift_consecutive": 2, "recover_after": 2,
            "median": med, "raw": {"boot": boot, "latency_detect": latency_detect,
                                   "latency_recover": latency_recover, "livelock_detect": livelock_detect}}


def table(result: dict[str, object]) -> str:
    med = result["median"]
    rows = [("process start -> /ready 200 (tiny model, 2 canary shapes, 3 timed runs each)", "boot_to_ready_s"),
            ("latency injected (max(0.5 s, 10 × boot p50) per batch) -> /ready 503", "latency_injection_to_503_s"),
            ("latency removed -> /ready 200", "latency_removed_to_200_s"),
            ("livelock telemetry trace injected -> /ready 503", "livelock_trace_to_503_s")]
    lines = [f"Watchdog interval {result['watchdog_interval_s']} s, 2 strikes to degrade, 2 clean checks to recover; "
             f"median of {result['runs']} runs.", "", "| event | seconds |", "|---|---|"]
    lines += [f"| {label} | {med[key]} |" for label, key in rows]  # type: ignore[index]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=Path("models/tiny"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/readiness_cpu.json"))
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.model, args.runs, args.interval)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    write_section(args.write_readme, "readiness", table(result))


if __name__ == "__main__":
    main()
