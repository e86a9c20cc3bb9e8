"""Fair scheduling across shapes and tenants (issue 52 point 6), real server processes, the tiny model, dev profile:

1. **cross-shape** (point 0): a 64x64 1-image 20-step request sent one at a time, alone and while three clients
   send 256x256 4-image 40-step jobs back to back; its p50/p95 over its solo p95 (target: p95 within 3x);
2. **tenants** (points 1-2): two and four tenants (``[[auth.tenants]]``, one key each), one flooding within its
   limits (6 requests in flight, 4 images x 30 steps at 64x64) while each other tenant sends the same job one at a
   time; each other tenant's p50/p95 over its solo latency (the same job alone on the same server, measured just
   before the load), and throughput (images/s of every tenant), with fair share **on** (a tenant per key) and
   **off** (every key in one tenant: today's order within a tenant). Targets: p95 within 2.5x of solo with two
   tenants, within the tenant count + 0.5 in general; throughput with fair share not below without.

The fair-share servers run side by side and their phases alternate (on, off per tenant count; the order flips per
round), so machine noise hits both alike.

    python benchmarks/bench_tenants.py --model models/tiny [--seconds 20] [--rounds 1]
        [--out benchmarks/results/tenants_cpu.json] [--write-readme docs/benchmarks.md] [--cross-only]
    python benchmarks/bench_tenants.py --from-results benchmarks/results/tenants_cpu.json \
        --write-readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
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
URL = "/sdapi/v1/txt2img"
MODES = ("on", "off")
TENANT_COUNTS = (2, 4)
FLOOD_IN_FLIGHT = 6
KEYS = tuple(f"sk-bench-tenant-{i}" for i in range(max(TENANT_COUNTS)))
SMALL = {"steps": 20, "batch_size": 1, "width": 64, "height": 64}
LARGE = {"steps": 40, "batch_size": 4, "width": 256, "height": 256}
JOB = {"steps": 30, "batch_size": 4, "width": 64, "height": 64}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _auth(mode: str) -> str:
    """The [auth] table: a tenant per key (fair share on) or every key in one tenant (off). The one tenant's cap on
    requests in flight is raised so that it admits what the separate tenants would."""
    if mode == "off":
        digests = ", ".join(f'"{_sha(k)}"' for k in KEYS)
        return f'[[auth.tenants]]\nlabel = "everyone"\ndigests = [{digests}]\n[auth.tenants.limits]\nin_flight = 64\n'
    return "".join(f'[[auth.tenants]]\nlabel = "tenant-{i}"\ndigests = ["{_sha(k)}"]\n' for i, k in enumerate(KEYS))


def _config(tmp: Path, name: str, auth: str = "") -> Path:
    text = (ROOT / "configs" / "dev.toml").read_text()
    text = text.replace("[watchdog]\ninterval_s = 5.0", "[watchdog]\nenabled = false\ninterval_s = 5.0")
    if auth:
        text += "\n[auth]\n" + auth
    path = tmp / f"{name}.toml"
    path.write_text(text)
    return path


class Record:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    async def post(self, client: httpx.AsyncClient, who: str, shape: dict[str, Any], seed: int,
                   key: str | None = None) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        start = time.perf_counter()
        response = await client.post(URL, json={"prompt": f"a benchmark picture {seed}", "seed": seed,
                                                "sampler_name": "Euler", **shape}, headers=headers)
        ok = response.status_code == 200
        self.rows.append({"who": who, "status": response.status_code, "seconds": time.perf_counter() - start,
                          "images": shape["batch_size"] if ok else 0, "end": time.perf_counter()})


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def _stats(times: list[float]) -> dict[str, float]:
    return {"count": len(times), "p50_s": _pct(times, 50), "p95_s": _pct(times, 95)}


async def _solo(client: httpx.AsyncClient, shape: dict[str, Any], repeats: int, key: str | None = None) -> list[float]:
    """Latencies of ``shape`` alone on the idle server, after one warm-up."""
    record = Record()
    for i in range(repeats + 1):
        await record.post(client, "solo", shape, 900_000 + i, key)
    if any(r["status"] != 200 for r in record.rows):
        raise RuntimeError(f"solo requests failed: {[r['status'] for r in record.rows]}")
    return [r["seconds"] for r in record.rows[1:]]


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=64))


async def cross_shape(url: str, seconds: float) -> dict[str, Any]:
    """The small request alone, then one at a time while three clients keep a large job each in flight."""
    async with _client(url) as client:
        solo = await _solo(client, SMALL, 10)
        record, stop = Record(), time.perf_counter() + seconds

        async def large(k: int) -> None:
            seed = 1000 * k
            while True:
                seed += 1
                await record.post(client, "large", LARGE, seed)

        loads = [asyncio.create_task(large(k)) for k in range(3)]
        await asyncio.sleep(1.0)  # the three large jobs admitted and running first
        seed = 0
        while time.perf_counter() < stop:
            seed += 1
            await record.post(client, "small", SMALL, seed)
            await asyncio.sleep(0.2)
        for task in loads:  # the large jobs in flight are dropped: only the small ones are measured here
            task.cancel()
        for task in loads:
            with contextlib.suppress(asyncio.CancelledError):
                await task
    small = [r["seconds"] for r in record.rows if r["who"] == "small" and r["status"] == 200]
    return {"solo": _stats(solo), "loaded": _stats(small), "loaded_s": [round(x, 3) for x in small],
            "large_done": sum(1 for r in record.rows if r["who"] == "large" and r["status"] == 200),
            "errors": sum(1 for r in record.rows if r["status"] != 200)}


async def tenants_phase(url: str, tenants: int, seconds: float) -> dict[str, Any]:
    """Tenant 0 floods (FLOOD_IN_FLIGHT closed-loop clients), tenants 1.. send one job at a time each."""
    async with _client(url) as client:
        solo = await _solo(client, JOB, 5, KEYS[1])
        record, began = Record(), time.perf_counter()
        stop = began + seconds

        async def sender(who: str, key: str, k: int) -> None:
            seed = 10_000 * k
            while time.perf_counter() < stop:
                seed += 1
                await record.post(client, who, JOB, seed, key)

        await asyncio.gather(*(sender("flood", KEYS[0], k) for k in range(FLOOD_IN_FLIGHT)),
                             *(sender(f"tenant-{t}", KEYS[t], 100 + t) for t in range(1, tenants)))
    ok = [r for r in record.rows if r["status"] == 200]
    window = max((r["end"] for r in record.rows), default=began + 1) - began
    solo_p50 = statistics.median(solo)
    others = {}
    for t in range(1, tenants):
        got = _stats([r["seconds"] for r in ok if r["who"] == f"tenant-{t}"])
        others[f"tenant-{t}"] = {**got, "p50_over_solo": got["p50_s"] / solo_p50,
                                 "p95_over_solo": got["p95_s"] / solo_p50}
    return {"tenants": tenants, "solo_p50_s": solo_p50, "solo": _stats(solo), "others": others,
            "flood": _stats([r["seconds"] for r in ok if r["who"] == "flood"]),
            "images_per_s": sum(r["images"] for r in ok) / window, "requests": len(record.rows),
            "errors": sum(1 for r in record.rows if r["status"] != 200)}


async def run(model: Path, seconds: float, rounds: int, cross_only: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"seconds": seconds, "rounds": rounds, "flood_in_flight": FLOOD_IN_FLIGHT,
                               "small": SMALL, "large": LARGE, "job": JOB, "cross": [], "tenants": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            server = Server(model, _config(Path(tmp), "plain"))
            try:
                cross = await cross_shape(server.url, seconds)
            finally:
                server.close()
            results["cross"].append({"round": r, **cross})
            print(f"round {r} cross-shape: small p95 {cross['loaded']['p95_s']:.3f} s, solo p95 "
                  f"{cross['solo']['p95_s']:.3f} s", file=sys.stderr)
            if cross_only:
                continue
            servers = {mode: Server(model, _config(Path(tmp), f"fair-{mode}", _auth(mode))) for mode in MODES}
            try:
                for n in TENANT_COUNTS:
                    for mode in MODES if r % 2 == 0 else MODES[::-1]:
                        phase = await tenants_phase(servers[mode].url, n, seconds)
                        results["tenants"].append({"round": r, "mode": mode, **phase})
                        worst = max(o["p95_over_solo"] for o in phase["others"].values())
                        print(f"round {r} {n} tenants, fair share {mode}: worst other p95/solo {worst:.2f}x, "
                              f"{phase['images_per_s']:.2f} img/s, {phase['errors']} errors", file=sys.stderr)
            finally:
                for server in servers.values():
                    server.close()
    return results


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(results: dict[str, Any]) -> str:
    cross = results["cross"]
    solo_p95 = _med([c["solo"]["p95_s"] for c in cross])
    ratios = [c["loaded"]["p95_s"] / c["solo"]["p95_s"] for c in cross]
    small, large, job = results["small"], results["large"], results["job"]

    def shape(s: dict[str, Any]) -> str:
        return f"{s['width']}x{s['height']}, {s['batch_size']} image(s), {s['steps']} steps"

    lines = [f"Tiny model, dev profile (max_batch 4), this 2-core CPU, shared; {results['rounds']} round(s) of "
             f"{results['seconds']:.0f} s per phase; medians over rounds.", "",
             f"**Cross-shape** (a {shape(small)} request one at a time while three clients send {shape(large)} "
             "jobs back to back; target p95 within 3x of solo p95):", "",
             "| solo p50 | solo p95 | loaded p50 | loaded p95 | loaded p95 / solo p95 | large jobs done |",
             "|---|---|---|---|---|---|",
             f"| {_med([c['solo']['p50_s'] for c in cross]):.3f} s | {solo_p95:.3f} s | "
             f"{_med([c['loaded']['p50_s'] for c in cross]):.3f} s | {_med([c['loaded']['p95_s'] for c in cross]):.3f}"
             f" s | **{_med(ratios):.2f}x** | {_med([c['large_done'] for c in cross]):.0f} |", "",
             f"**Tenants** (tenant 0 keeps {results['flood_in_flight']} requests in flight, each other tenant one "
             f"at a time; every request {shape(job)}; ratios over the same job's solo p50 on the same server just "
             "before the load; fair share off = every key in one tenant; target: the worst other tenant's p95 "
             "within 2.5x with two tenants, within the tenant count + 0.5 in general):", "",
             "| tenants | fair share | solo p50 | other p50 / solo | other p95 / solo (worst) | flood p50 | images/s "
             "| on / off | errors |", "|---|---|---|---|---|---|---|---|---|"]
    rows = results["tenants"]
    for n in sorted({r["tenants"] for r in rows}):
        rate = {m: _med([r["images_per_s"] for r in rows if r["tenants"] == n and r["mode"] == m]) for m in MODES}
        for mode in MODES:
            got = [r for r in rows if r["tenants"] == n and r["mode"] == mode]
            if not got:
                continue
            p50 = _med([_med([o["p50_over_solo"] for o in r["others"].values()]) for r in got])
            worst = _med([max(o["p95_over_solo"] for o in r["others"].values()) for r in got])
            target = 2.5 if n == 2 else n + 0.5
            mark = "" if worst <= target else " (over)"
            lines.append(f"| {n} | {mode} | {_med([r['solo_p50_s'] for r in got]):.3f} s | {p50:.2f}x | "
                         f"**{worst:.2f}x**{mark} | {_med([r['flood']['p50_s'] for r in got]):.3f} s | "
                         f"{rate[mode]:.2f} | " + (f"{rate['on'] / rate['off']:.2f}x" if mode == "on" else "")
                         + f" | {sum(r['errors'] for r in got)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each loaded phase")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tenants_cpu.json")
    parser.add_argument("--write-readme", type=Path)
    parser.add_argument("--from-results", type=Path)
    parser.add_argument("--cross-only", action="store_true", help="the cross-shape case alone (no tenant phases)")
    args = parser.parse_args()
    if args.from_results:
        results = json.loads(args.from_results.read_text())
    else:
        results = asyncio.run(run(args.model, args.seconds, args.rounds, args.cross_only))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    text = render(results)
    print(text)
    if args.write_readme and not write_section(args.write_readme, "tenants", text):
        raise SystemExit(f"{args.write_readme} has no bench:tenants markers")


if __name__ == "__main__":
    main()
