"""Server benchmarks on the tiny model (this machine, same run, ratios):

1. server overhead: end-to-end latency at concurrency 1 over a direct pipeline call (target <= 1.05);
2. micro-batching: throughput at concurrency 16 with max_batch=4 over max_batch=1 (target >= 1.3x at 64x64);
3. `sdserve bench` at concurrency 1..32 against the dev profile (queue 32, max_batch 4): p50/p95/p99, 429 share,
   with the plot committed (docs/assets/bench_cpu.png, shown on the benchmarks page).

Every ratio docs/benchmarks.md quotes is rendered here from the results (median and range over the runs), never typed.

    python benchmarks/bench_server.py --model models/tiny [--rounds 3] [--write-readme docs/benchmarks.md]
    python benchmarks/bench_server.py --repeats 2 --rounds 1 --requests 4 --levels 1,2   (smallest settings)
    python benchmarks/bench_server.py --from-results benchmarks/results/server_cpu.json \
        --write-readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
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

from engines.config import RuntimeSettings
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec
from server.cli import bench

ROOT = Path(__file__).parents[1]
PLOT = ROOT / "docs" / "assets" / "bench_cpu.png"
"""The concurrency plot, beside the docs page that shows it (a docs site serves only what lies under docs/)."""
SIZE, STEPS = 64, 20


def _config(tmp: Path, max_batch: int) -> Path:
    text = (ROOT / "configs" / "dev.toml").read_text()
    text = text.replace("max_batch = 4", f"max_batch = {max_batch}")
    text = text.replace("[watchdog]\ninterval_s = 5.0", "[watchdog]\nenabled = false\ninterval_s = 5.0")
    path = tmp / f"batch{max_batch}.toml"
    path.write_text(text)
    return path


class Server:
    def __init__(self, model: Path, config: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(config),
                                      "--model", str(model), "--port", "0"], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True)
        assert self.proc.stderr is not None
        self.url = ""
        for line in self.proc.stderr:
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                self.url = match.group(1)
                break
        threading.Thread(target=lambda: [None for _ in self.proc.stderr or []], daemon=True).start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.url}/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def overhead(model: Path, tmp: Path, n: int) -> dict[str, float]:
    """Direct calls and HTTP requests alternate, so machine noise hits both sides alike."""
    server = Server(model, _config(tmp, 1))
    pipe = StableDiffusionOnnx(model, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    batch = Batch((ImageSpec("a lighthouse on a cliff at dusk", seed=1),), SIZE, SIZE, STEPS, "euler")
    body = {"prompt": "a lighthouse on a cliff at dusk", "seed": 1, "size": f"{SIZE}x{SIZE}", "steps": STEPS,
            "scheduler": "euler"}
    direct, e2e = [], []
    try:
        with httpx.Client(timeout=60) as client:
            for i in range(n + 3):  # the first 3 rounds warm both sides
                t = time.perf_counter()
                pipe(batch)
                d = time.perf_counter() - t
                t = time.perf_counter()
                assert client.post(f"{server.url}/v1/images/generations", json=body).status_code == 200
                if i >= 3:
                    direct.append(d)
                    e2e.append(time.perf_counter() - t)
    finally:
        server.close()
    d, e = statistics.median(direct), statistics.median(e2e)
    return {"direct_pipeline_s": round(d, 4), "server_e2e_s": round(e, 4), "ratio": round(e / d, 3)}


def throughput(model: Path, tmp: Path, requests: int, rounds: int = 3) -> dict[str, object]:
    """Images/min at concurrency 16 for max_batch 1, 4 and 8, alternating within each round; per-round ratios
    (each against the max_batch=1 run of the same round) with their median and range."""
    runs: dict[int, list[float]] = {1: [], 4: [], 8: []}
    for _ in range(rounds):
        for max_batch in runs:
            server = Server(model, _config(tmp, max_batch))
            try:
                async def level(url: str = server.url) -> bench.Level:
                    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
                        return await bench.run_level(client, url, 16, requests, 300,
                                                     {"size": f"{SIZE}x{SIZE}", "steps": STEPS, "n": 1})
                runs[max_batch].append(asyncio.run(level()).images_per_minute)
            finally:
                server.close()
    out: dict[str, object] = {f"max_batch_{mb}_images_per_min": round(statistics.median(v), 1)
                              for mb, v in runs.items()}
    out["runs"] = {str(mb): [round(x, 1) for x in v] for mb, v in runs.items()}
    for mb, key in ((4, "ratio"), (8, "ratio_8")):
        ratios = [b / a for a, b in zip(runs[1], runs[mb], strict=True)]
        out[key] = round(statistics.median(ratios), 3)
        out[f"{key}_runs"] = [round(r, 3) for r in ratios]
    return out


def concurrency(model: Path, tmp: Path, requests: int, levels: list[int], results: Path) -> dict[str, object]:
    server = Server(model, _config(tmp, 4))
    try:
        result = asyncio.run(bench.bench(server.url, levels, requests, 300, f"{SIZE}x{SIZE}", STEPS))
    finally:
        server.close()
    bench.write(result, results / "bench_cpu.json")
    bench.plot(result, PLOT)
    return result


def _range(t: dict[str, object], key: str) -> str:
    runs: list[float] = t.get(f"{key}_runs") or []  # type: ignore[assignment]
    if not runs:
        return "ratio of medians; no range recorded (older run)"
    return f"median of per-run ratios, range {min(runs)}–{max(runs)}x over {len(runs)} runs"


def table(o: dict[str, float], t: dict[str, object], c: dict[str, object]) -> str:
    met = "met" if float(t["ratio"]) >= 1.3 else "NOT met"  # type: ignore[arg-type]
    lines = [f"Tiny model, {SIZE}x{SIZE}, {STEPS} steps, Euler, this 2-core machine (server and client share it).", "",
             "| measure | value | target |", "|---|---|---|",
             f"| server overhead: e2e at concurrency 1 / direct pipeline call | {o['server_e2e_s']}s / "
             f"{o['direct_pipeline_s']}s = **{o['ratio']}** | <= 1.05 |",
             f"| micro-batching: images/min at concurrency 16, max_batch=4 / max_batch=1 "
             f"| {t['max_batch_4_images_per_min']} / {t['max_batch_1_images_per_min']} → **{t['ratio']}x**, "
             f"{_range(t, 'ratio')} | >= 1.3x ({met}) |",
             f"| ... with max_batch=8 / max_batch=1 | {t['max_batch_8_images_per_min']} / "
             f"{t['max_batch_1_images_per_min']} → **{t['ratio_8']}x**, {_range(t, 'ratio_8')} | |",
             "", "`sdserve bench` against the dev profile (queue 32, max_batch 4), "
             f"{c['per_level']} requests per level:", "",
             "| concurrency | ok | 429 share | p50 (s) | p95 (s) | p99 (s) | images/min |",
             "|---|---|---|---|---|---|---|"]
    for lv in c["levels"]:  # type: ignore[attr-defined]
        share = lv["rejected_429"] / lv["requests"] if lv["requests"] else 0
        lines.append(f"| {lv['concurrency']} | {lv['ok']} | {share:.0%} | {lv['p50_s']} | {lv['p95_s']} | "
                     f"{lv['p99_s']} | {lv['images_per_minute']} |")
    lines += ["", "![latency and throughput vs concurrency](assets/bench_cpu.png)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    parser.add_argument("--repeats", type=int, default=20, help="interleaved direct/e2e pairs for the overhead")
    parser.add_argument("--rounds", type=int, default=3, help="micro-batching rounds (max_batch 1, 4, 8 each)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--levels", default="1,4,8,16,32", help="sdserve bench concurrency levels")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "server_cpu.json")
    parser.add_argument("--from-results", type=Path, default=None, help="render saved results; run nothing")
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    if args.from_results is not None:
        saved = json.loads(args.from_results.read_text())
        o, t = saved["overhead"], saved["throughput"]
        c = json.loads((args.from_results.parent / "bench_cpu.json").read_text())
    else:
        with tempfile.TemporaryDirectory() as tmp:
            o = overhead(args.model, Path(tmp), args.repeats)
            print("overhead", o, flush=True)
            t = throughput(args.model, Path(tmp), args.requests, args.rounds)
            print("throughput", t, flush=True)
            c = concurrency(args.model, Path(tmp), args.requests, [int(x) for x in args.levels.split(",")],
                            args.out.parent)
        args.out.write_text(json.dumps({"overhead": o, "throughput": t}, indent=2) + "\n")
    text = table(o, t, c)
    print(text)
    write_section(args.write_readme, "server", text)


if __name__ == "__main__":
    main()
