"""The step cache, cached against uncached, same run, same machine, per family at 20, 30 and 50 steps: evaluations
reused, wall-time ratio (median of interleaved repeats) and PSNR of the cached image against the uncached one.

Families: the tiny SD 1.x model (UNet, epsilon) and the tiny Flux dev and SD 3.5 builds (flow-matching DiTs), each
with the output-level cache (`[cache] method = "output"`, EasyCache's rule, threshold 0.2) and, where the folder has
the split transformer (engines/build/dit_split.py), the first-block cache (diffusers' rule, thresholds 0.05 and 0.3).

Honest caveat: tiny random-weight models say nothing about quality on real weights. Their outputs barely change
from step to step, so the PSNR here is high and the reuse counts are near the caps; the gate (`sdserve gate
--cache`) is what decides on a real model. The wall-time ratio is what this CPU measures for skipping the
denoiser on these tiny networks, where the text encoders and the VAE weigh more than on full-size models.

    python benchmarks/bench_cache.py [--repeats 3] [--steps 20,30,50] [--out benchmarks/results/cache_cpu.json]
        [--write-readme docs/benchmarks.md]
    python benchmarks/bench_cache.py --from-results benchmarks/results/cache_cpu.json --write-readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from readme import write_section

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
PROMPT = "a photo of an astronaut riding a horse"
GUIDANCE = {"sd1": 7.5, "flux": 3.5, "sd35": 4.5}
CONFIGS = (("output", 0.2), ("first-block", 0.05), ("first-block", 0.3))
"""(method, threshold): the defaults (ComfyUI's EasyCache 0.2, diffusers' FirstBlockCacheConfig 0.05) and a
first-block threshold at which the tiny transformers reuse (their residuals change more than real ones)."""


def _engine(folder: Path) -> Any:
    from engines.config import RuntimeSettings
    from engines.engine import OrtEngine

    engine = OrtEngine(folder, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    engine.load()
    return engine


def _models(tmp: Path, tiny: Path) -> dict[str, Path]:
    from engines.build.dit import build_tiny_dit

    models = {"sd1": tiny}
    for family in ("flux", "sd35"):
        models[family] = build_tiny_dit(family, tmp / family, vae_encoder=False, first_block=True)
    return models


def _pixels(result: Any) -> np.ndarray:
    return np.stack([np.asarray(g.image) for g in result.images])


def measure(engine: Any, family: str, method: str, threshold: float, steps: int, repeats: int) -> dict[str, Any]:
    """Interleaved uncached/cached runs of one request; the median times, the reuse and the PSNR."""
    from engines.types.request import Batch, ImageSpec, StepCache
    from server.caching import psnr_db

    size = engine.info.default_size
    batch = Batch((ImageSpec(PROMPT, "blurry", 1, GUIDANCE[family]),), size, size, steps)
    cached_batch = dataclasses.replace(batch, cache=StepCache(method=method, threshold=threshold))
    engine.generate(batch)  # warm both paths
    engine.generate(cached_batch)
    plain_s, cached_s = [], []
    plain = cached = None
    for _ in range(repeats):
        start = time.perf_counter()
        plain = engine.generate(batch)
        middle = time.perf_counter()
        cached = engine.generate(cached_batch)
        plain_s.append(middle - start)
        cached_s.append(time.perf_counter() - middle)
    assert plain is not None
    assert cached is not None
    assert cached.cache is not None
    return {"family": family, "method": method, "threshold": threshold, "steps": steps, "size": size,
            "reused": cached.cache.reused, "evaluations": cached.cache.evaluations,
            "uncached_s": statistics.median(plain_s), "cached_s": statistics.median(cached_s),
            "ratio": statistics.median(c / p for c, p in zip(cached_s, plain_s, strict=True)),
            "psnr_db": round(psnr_db(_pixels(plain), _pixels(cached)), 2)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| family | method (threshold) | steps | evaluations reused | cached / uncached wall time | PSNR vs "
             "uncached |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} {r['size']}² | {r['method']} ({r['threshold']:g}) | {r['steps']} | "
                     f"{r['reused']}/{r['evaluations']} | {r['ratio']:.2f}x | {r['psnr_db']:.1f} dB |")
    lines.append("")
    lines.append("Same run, interleaved, median of the repeats; this CPU, tiny random-weight models (their outputs "
                 "barely change between steps, so the reuse is near its caps and the PSNR says nothing about real "
                 "weights: the gate decides on the served model).")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", default="20,30,50")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cache_cpu.json")
    p.add_argument("--from-results", type=Path, default=None)
    p.add_argument("--write-readme", type=Path, default=None)
    args = p.parse_args()
    if args.from_results is not None:
        rows = json.loads(args.from_results.read_text())["rows"]
    else:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for family, folder in _models(Path(tmp), args.model).items():
                engine = _engine(folder)
                parts = (folder / "transformer_first").is_dir()
                try:
                    for method, threshold in [c for c in CONFIGS if c[0] == "output" or parts]:
                        for steps in (int(s) for s in args.steps.split(",")):
                            rows.append(measure(engine, family, method, threshold, steps, args.repeats))
                            print(json.dumps(rows[-1]), flush=True)
                finally:
                    engine.close()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"format": 1, "rows": rows}, indent=2) + "\n")
    text = table(rows)
    print(text)
    if args.write_readme and not write_section(args.write_readme, "cache", text):
        raise SystemExit(f"{args.write_readme} has no bench:cache markers")


if __name__ == "__main__":
    main()
