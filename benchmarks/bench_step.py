"""Step-level batching against micro-batching, same run, same machine, same model (the tiny one, dev profile):

1. **mixed**: four clients sending 4-image 50-step jobs back to back and a fifth sending a 1-image 4-step job every
   0.2 s (the head-of-line case of issue 40): per class p50/p95/p99 latency over its solo latency, first-step time,
   throughput (images/s);
2. **seed-like**: concurrency 8, 16 and 32 closed-loop clients, each request drawing its steps from {4, 20, 30, 50}
   and its size from {64, 128}: per step class p50/p95/p99, throughput, first-step time.

The two modes run one after the other on fresh servers (`queue.batching = "step"` / `"micro"`, everything else the
dev profile), in alternating order per round, so machine noise hits both alike. Targets on this machine: the short
jobs' p95 within 2x their solo latency under the mixed load, and throughput not below micro-batching's.

    python benchmarks/bench_step.py --model models/tiny [--seconds 20] [--levels 8,16,32] [--rounds 1]
        [--out benchmarks/results/step_cpu.json] [--write-readme docs/benchmarks.md]
    python benchmarks/bench_step.py --from-results benchmarks/results/step_cpu.json --write-readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from bench_server import Server
from readme import write_section

ROOT = Path(__file__).parents[1]
MODES = ("step", "micro")
URL = "/sdapi/v1/txt2img"


def _config(tmp: Path, mode: str) -> Path:
    text = (ROOT / "configs" / "dev.toml").read_text()
    text = re.sub(r'^batching = "\w+"', f'batching = "{mode}"', text, flags=re.M)
    text = text.replace("[watchdog]\ninterval_s = 5.0", "[watchdog]\nenabled = false\ninterval_s = 5.0")
    path = tmp / f"{mode}.toml"
    path.write_text(text)
    return path


def _first_step(response: httpx.Response) -> float:
    found = re.search(r"first-step;dur=([\d.]+)", response.headers.get("server-timing", ""))
    return float(found.group(1)) / 1000 if found else float("nan")


class Record:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    async def post(self, client: httpx.AsyncClient, cls: str, body: dict[str, Any]) -> None:
        start = time.perf_counter()
        response = await client.post(URL, json=body)
        self.rows.append({"class": cls, "status": response.status_code, "seconds": time.perf_counter() - start,
                          "first_step": _first_step(response) if response.status_code == 200 else float("nan"),
                          "images": body.get("batch_size", 1) if response.status_code == 200 else 0,
                          "end": time.perf_counter()})


def _body(steps: int, size: int = 64, n: int = 1, seed: int = 0) -> dict[str, Any]:
    return {"prompt": f"a benchmark picture {seed}", "steps": steps, "batch_size": n, "width": size, "height": size,
            "seed": seed, "sampler_name": "Euler"}


async def _solo(url: str, cases: dict[str, dict[str, Any]], repeats: int = 5) -> dict[str, float]:
    """Median latency of each case alone on the idle server (after one warm-up each)."""
    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for name, body in cases.items():
            await client.post(URL, json=body)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                response = await client.post(URL, json=body)
                response.raise_for_status()
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
    return out


async def _mixed(url: str, seconds: float) -> Record:
    record = Record()
    stop = time.perf_counter() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def long_client(k: int) -> None:
            seed = 1000 * k
            while time.perf_counter() < stop:
                seed += 1
                await record.post(client, "long (4 images, 50 steps)", _body(50, n=4, seed=seed))

        async def short_client() -> None:
            pending = []
            seed = 0
            while time.perf_counter() < stop:
                seed += 1
                pending.append(asyncio.create_task(record.post(client, "short (1 image, 4 steps)",
                                                               _body(4, seed=seed))))
                await asyncio.sleep(0.2)
            await asyncio.gather(*pending)

        await asyncio.gather(*(long_client(k) for k in range(4)), short_client())
    return record


async def _seedlike(url: str, seconds: float, concurrency: int, rng: random.Random) -> Record:
    record = Record()
    stop = time.perf_counter() + seconds
    plan = [(rng.choice((4, 20, 30, 50)), rng.choice((64, 128))) for _ in range(10_000)]
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < stop:
                steps, size = plan[i % len(plan)]
                i += concurrency
                await record.post(client, f"{steps} steps", _body(steps, size, seed=i))

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return record


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _summary(record: Record, started: float) -> dict[str, Any]:
    """Per class latency; throughput over the whole window, up to the last answer (requests in flight at the end
    of the sending window are waited for and counted)."""
    ok = [r for r in record.rows if r["status"] == 200]
    seconds = max((r["end"] for r in record.rows), default=started + 1) - started
    classes: dict[str, Any] = {}
    for cls in sorted({r["class"] for r in ok}):
        times = [r["seconds"] for r in ok if r["class"] == cls]
        first = [r["first_step"] for r in ok if r["class"] == cls]
        classes[cls] = {"count": len(times), "p50_s": _pct(times, 50), "p95_s": _pct(times, 95),
                        "p99_s": _pct(times, 99), "first_step_p50_s": _pct(first, 50),
                        "first_step_p95_s": _pct(first, 95)}
    return {"classes": classes, "images_per_s": sum(r["images"] for r in ok) / seconds,
            "requests": len(record.rows), "errors": sum(1 for r in record.rows if r["status"] != 200)}


async def run(model: Path, seconds: float, levels: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {"seconds": seconds, "levels": levels, "rounds": rounds, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                server = Server(model, _config(Path(tmp), mode))
                try:
                    solo = await _solo(server.url, {"short (1 image, 4 steps)": _body(4),
                                                    "long (4 images, 50 steps)": _body(50, n=4)})
                    began = time.perf_counter()
                    mixed = _summary(await _mixed(server.url, seconds), began)
                    seed = {}
                    for c in levels:
                        began = time.perf_counter()
                        seed[str(c)] = _summary(await _seedlike(server.url, seconds, c, random.Random(c)), began)
                finally:
                    server.close()
                results["runs"].append({"round": r, "mode": mode, "solo": solo, "mixed": mixed, "seedlike": seed})
                print(f"round {r} {mode}: mixed {json.dumps(mixed['classes'])} {mixed['images_per_s']:.2f} img/s",
                      file=sys.stderr)
    return results


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(results: dict[str, Any]) -> str:
    runs = results["runs"]

    def pick(mode: str) -> list[dict[str, Any]]:
        return [r for r in runs if r["mode"] == mode]

    short, long = "short (1 image, 4 steps)", "long (4 images, 50 steps)"
    lines = [f"Tiny model, dev profile (max_batch 4), this 2-core CPU; {results['rounds']} round(s) of "
             f"{results['seconds']:.0f} s per workload and mode, modes alternating; medians over rounds.", "",
             "**Mixed load** (four clients with 4-image 50-step jobs, one 1-image 4-step job every 0.2 s):", "",
             "| mode | class | solo p50 | p50 | p95 | p99 | p95 / solo | first step p50 | images/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for cls in (short, long):
            got = [r["mixed"]["classes"].get(cls) for r in pick(mode)]
            got = [g for g in got if g]
            solo = _med([r["solo"][cls] for r in pick(mode)])
            if not got:
                continue
            p95 = _med([g["p95_s"] for g in got])
            lines.append(f"| {mode} | {cls} | {solo:.3f} s | {_med([g['p50_s'] for g in got]):.3f} s | {p95:.3f} s | "
                         f"{_med([g['p99_s'] for g in got]):.3f} s | **{p95 / solo:.1f}x** | "
                         f"{_med([g['first_step_p50_s'] for g in got]):.3f} s | "
                         f"{_med([r['mixed']['images_per_s'] for r in pick(mode)]):.2f} |")
    ratio = _med([r["mixed"]["images_per_s"] for r in pick("step")]) / _med(
        [r["mixed"]["images_per_s"] for r in pick("micro")])
    per_round = [r["mixed"]["classes"][short]["p95_s"] / r["solo"][short] for r in pick("step")
                 if short in r["mixed"]["classes"]]
    lines += ["", f"Short requests' p95 over their solo latency under step-level batching, per round (the same "
              f"server, solo measured just before the load): {', '.join(f'{x:.2f}x' for x in per_round)}; "
              f"median **{_med(per_round):.2f}x**. The table's ratio divides the medians over rounds.", "",
              f"Mixed-load throughput, step over micro: **{ratio:.2f}x**.", "",
              "**Seed-like load** (closed loop; steps drawn from {4, 20, 30, 50}, size from {64, 128}, 1 image):", "",
              "| concurrency | mode | 4 steps p95 | 20 steps p95 | 30 steps p95 | 50 steps p95 "
              "| 4 steps first step p50 | images/s | step / micro |", "|---|---|---|---|---|---|---|---|---|"]
    for level in results["levels"]:
        rate = {m: _med([r["seedlike"][str(level)]["images_per_s"] for r in pick(m)]) for m in MODES}
        for mode in MODES:
            cells = []
            for steps in (4, 20, 30, 50):
                got = [r["seedlike"][str(level)]["classes"].get(f"{steps} steps") for r in pick(mode)]
                got = [g for g in got if g]
                cells.append(f"{_med([g['p95_s'] for g in got]):.2f} s" if got else "-")
            first = [r["seedlike"][str(level)]["classes"].get("4 steps") for r in pick(mode)]
            first_p50 = _med([g["first_step_p50_s"] for g in first if g])
            lines.append(f"| {level} | {mode} | {' | '.join(cells)} | {first_p50:.3f} s | {rate[mode]:.2f} | "
                         f"{rate['step'] / rate['micro']:.2f}x |" if mode == "step" else
                         f"| {level} | {mode} | {' | '.join(cells)} | {first_p50:.3f} s | {rate[mode]:.2f} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--levels", default="8,16,32")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "step_cpu.json")
    parser.add_argument("--write-readme", type=Path)
    parser.add_argument("--from-results", type=Path)
    args = parser.parse_args()
    if args.from_results:
        results = json.loads(args.from_results.read_text())
    else:
        results = asyncio.run(run(args.model, args.seconds, [int(x) for x in args.levels.split(",")], args.rounds))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    text = render(results)
    print(text)
    if args.write_readme and not write_section(args.write_readme, "step", text):
        raise SystemExit(f"{args.write_readme} has no bench:step markers")


if __name__ == "__main__":
    main()
