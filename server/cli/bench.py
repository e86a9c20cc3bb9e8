"""`sdserve bench`: an async HTTP load generator for one sdserve (loopback targets only, bounded in requests and
time). Per concurrency level: p50/p95/p99 latency, images/min, 429 and error rates, GPU SM utilization read from
/metrics. Also records canary fingerprints and the capability snapshot, so `sdserve gate` can compare two runs."""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import io
import ipaddress
import json
import logging
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
from PIL import Image

from engines.errors import InvalidRequestError
from engines.types.health import fingerprint

log = logging.getLogger("sdserve")

PROMPTS = ("a lighthouse on a cliff at dusk", "a red fox in fresh snow", "an astronaut riding a horse on mars",
           "a bowl of ramen, studio lighting", "a watercolor city skyline", "a steam train crossing a bridge",
           "a cat wearing a tiny hat", "a mountain lake at sunrise")
CANARY_SEEDS = (1, 2, 3, 4)
GEN = "/v1/images/generations"


@dataclass
class Level:
    concurrency: int
    requests: int
    ok: int
    rejected_429: int
    errors: int
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    images_per_minute: float
    wall_s: float
    gpu_sm_percent: float | None


def require_loopback(url: str) -> None:
    """Refuse anything but this machine: a load generator pointed elsewhere is an accident or an attack."""
    host = urlparse(url).hostname or ""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise InvalidRequestError(f"cannot resolve {host!r}", param="url") from None
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise InvalidRequestError(f"sdserve bench only targets loopback addresses; {host} is {sorted(addresses)}",
                                  param="url")


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


async def _gpu_util(client: httpx.AsyncClient, url: str) -> float | None:
    text = (await client.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("sdserve_gpu_sm_utilization_percent{"):
            value = float(line.rsplit(" ", 1)[1])
            return None if math.isnan(value) else value
    return None


async def run_level(client: httpx.AsyncClient, url: str, concurrency: int, total: int, max_seconds: float,
                    body: dict[str, Any]) -> Level:
    latencies: list[float] = []
    counts = {"ok": 0, "429": 0, "errors": 0}
    next_index = iter(range(total))
    deadline = time.monotonic() + max_seconds
    gpu: list[float] = []

    async def worker() -> None:
        for i in next_index:
            if time.monotonic() > deadline:
                return
            payload = {**body, "prompt": PROMPTS[i % len(PROMPTS)], "seed": i}
            t = time.perf_counter()
            try:
                response = await client.post(f"{url}{GEN}", json=payload)
            except httpx.HTTPError:
                counts["errors"] += 1
                continue
            if response.status_code == 200:
                counts["ok"] += 1
                latencies.append(time.perf_counter() - t)
            elif response.status_code == 429:
                counts["429"] += 1
            else:
                counts["errors"] += 1

    async def sampler() -> None:
        while True:
            value = await _gpu_util(client, url)
            if value is not None:
                gpu.append(value)
            await asyncio.sleep(0.5)

    start = time.perf_counter()
    watcher = asyncio.create_task(sampler())
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    watcher.cancel()
    wall = time.perf_counter() - start
    done = counts["ok"] + counts["429"] + counts["errors"]
    images = counts["ok"] * int(body.get("n", 1))
    return Level(concurrency, done, counts["ok"], counts["429"], counts["errors"], percentile(latencies, 50),
                 percentile(latencies, 95), percentile(latencies, 99), round(images * 60.0 / wall, 2),
                 round(wall, 3), round(float(np.median(gpu)), 1) if gpu else None)


async def canary_fingerprints(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, list[Any]]:
    out = {}
    for seed in CANARY_SEEDS:
        response = await client.post(f"{url}{GEN}", json={**body, "prompt": PROMPTS[0], "seed": seed})
        response.raise_for_status()
        with Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))) as image:
            out[str(seed)] = fingerprint(np.asarray(image.convert("RGB"))).round(3).tolist()
    return out


def _snapshot(caps: dict[str, Any]) -> dict[str, Any]:
    obs = caps.get("observations", {})
    devices = obs.get("nvml", {}).get("devices", [])
    return {"providers": {k: v.get("providers_used", []) for k, v in caps.get("sessions", {}).items()},
            "accelerated": caps.get("accelerated"), "onnxruntime": obs.get("onnxruntime"),
            "cuda_build": obs.get("onnxruntime_cuda_build"), "cudnn": obs.get("cudnn", {}).get("version"),
            "tensorrt": obs.get("tensorrt", {}).get("version"),
            "driver": obs.get("nvml", {}).get("driver_version"),
            "gpu": devices[0]["name"] if devices else None}


async def bench(url: str, levels: list[int], per_level: int, max_seconds: float, size: str, steps: int,
                api_key: str | None = None) -> dict[str, Any]:
    require_loopback(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"size": size, "steps": steps, "n": 1, "response_format": "b64_json"}
    limits = httpx.Limits(max_connections=max(levels) + 4)
    async with httpx.AsyncClient(timeout=max_seconds + 60, headers=headers, limits=limits) as client:
        ready = await client.get(f"{url}/ready")
        if ready.status_code != 200:
            raise InvalidRequestError(f"{url} is not ready: {ready.text}", param="url")
        caps = (await client.get(f"{url}/capabilities")).json()
        fingerprints = await canary_fingerprints(client, url, body)
        results = [await run_level(client, url, c, per_level, max_seconds, body) for c in levels]
    return {"format": 1, "url": url, "at": time.time(), "size": size, "steps": steps, "per_level": per_level,
            "levels": [asdict(r) for r in results], "fingerprints": fingerprints, "capabilities": _snapshot(caps)}


def plot(result: dict[str, Any], path: Path) -> bool:
    """Latency percentiles and throughput vs concurrency; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = result["levels"]
    x = [lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("p50_s", "p50"), ("p95_s", "p95"), ("p99_s", "p99")):
        left.plot(x, [lv[key] or 0 for lv in levels], marker="o", label=label)
    left.set(xlabel="concurrency", ylabel="latency (s)", title="latency", xscale="log", xticks=x, xticklabels=x)
    left.legend()
    right.plot(x, [lv["images_per_minute"] for lv in levels], marker="o", color="tab:green", label="images/min")
    share = [lv["rejected_429"] / lv["requests"] * 100 if lv["requests"] else 0 for lv in levels]
    twin = right.twinx()
    twin.bar(x, share, alpha=0.25, color="tab:red", width=[c * 0.3 for c in x], label="429 %")
    twin.set(ylabel="429 share (%)", ylim=(0, 100))
    right.set(xlabel="concurrency", ylabel="images/min", title="throughput and 429 share", xscale="log",
              xticks=x, xticklabels=x)
    fig.suptitle(f"sdserve bench: {result['size']}, {result['steps']} steps, {result['per_level']} requests/level")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="load-test a running sdserve on this machine")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=64, help="requests per level (bound)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="time bound per level")
    p.add_argument("--size", default="64x64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("bench.json"))
    p.add_argument("--plot", type=Path, default=None, help="PNG: latency and throughput vs concurrency")
    p.add_argument("--api-key-env", default="SDSERVE_API_KEY", help="environment variable holding the key")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:  # fail before the load test
        raise InvalidRequestError(f"--plot {args.plot} needs the matplotlib package, which is not installed: "
                                  ".venv/bin/pip install matplotlib (make test installs it), or drop --plot", "plot")
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels) or not 1 <= args.requests <= 10_000:
        raise InvalidRequestError("--concurrency levels must be 1..256 and --requests 1..10000", "concurrency")
    result = asyncio.run(bench(args.url, levels, args.requests, args.max_seconds, args.size, args.steps,
                               os.environ.get(args.api_key_env)))
    write(result, args.out)
    for level in result["levels"]:
        log.info("c=%-3d ok %d/%d  429 %d  errors %d  p50 %s p95 %s p99 %s  %.1f images/min", level["concurrency"],
                 level["ok"], level["requests"], level["rejected_429"], level["errors"], level["p50_s"],
                 level["p95_s"], level["p99_s"], level["images_per_minute"])
    if args.plot is not None and plot(result, args.plot):
        log.info("wrote %s", args.plot)
    return 0
