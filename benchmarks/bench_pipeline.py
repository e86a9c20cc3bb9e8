"""Per-image latency: our ORT pipeline vs diffusers' torch StableDiffusionPipeline on the same weights.

Same run, same machine, same scheduler (Euler), same steps, CFG on both sides; reported as ratios because this
machine is noisy. The two sides are interleaved (A B A B ...: one call of each per round, after a warm-up of both),
so machine noise hits both alike; each round gives one ratio, and the README shows their median and range. Every
README line that quotes a ratio is rendered here from the results, never written by hand.

    python benchmarks/bench_pipeline.py [--repeats 9] [--cases 64x1,256x1] [--write-readme README.md]
    python benchmarks/bench_pipeline.py --from-results benchmarks/results/pipeline_cpu.json --write-readme README.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from readme import write_section

from engines.build.tiny import build_tiny
from engines.config import RuntimeSettings
from engines.diffusion.pipeline import StableDiffusionOnnx
from engines.protocol import Batch, ImageSpec
from engines.runtime.sessions import Runtime

CASES = [(64, 1), (64, 4), (256, 1), (256, 4)]
STEPS = 20


TARGET = {"size": 256, "batch": 1, "speedup": 1.3}
"""The goal quoted in the README: ours at least 1.3x diffusers' torch pipeline at 256x256 batch 1."""


def interleaved(a, b, repeats: int) -> tuple[list[float], list[float]]:  # type: ignore[no-untyped-def]
    """Seconds per call of ``a`` and ``b``, run A B A B ... after one warm-up call of each."""
    a()
    b()  # warm-up: allocations, kernel selection
    times_a, times_b = [], []
    for _ in range(repeats):
        for fn, out in ((a, times_a), (b, times_b)):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
    return times_a, times_b


def summarize(ours: list[float], theirs: list[float], batch: int) -> dict[str, object]:
    ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
    return {"ours_s_per_image": round(statistics.median(ours) / batch, 4),
            "torch_s_per_image": round(statistics.median(theirs) / batch, 4),
            "speedup": round(statistics.median(ratios), 2), "speedup_min": round(min(ratios), 2),
            "speedup_max": round(max(ratios), 2), "rounds": len(ratios)}


def run(repeats: int, cases: list[tuple[int, int]]) -> dict[str, object]:
    import diffusers

    with tempfile.TemporaryDirectory() as tmp:
        onnx_dir, torch_dir = Path(tmp) / "onnx", Path(tmp) / "diffusers"
        build_tiny(onnx_dir, diffusers_out=torch_dir)
        ours = StableDiffusionOnnx(onnx_dir, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                     allow_cpu=True)))
        theirs = diffusers.StableDiffusionPipeline.from_pretrained(torch_dir, safety_checker=None)
        theirs.scheduler = diffusers.EulerDiscreteScheduler.from_config(
            json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text()))
        theirs.set_progress_bar_config(disable=True)
        rows = []
        for size, batch in cases:
            prompts = [f"a lighthouse at dusk, variant {i}" for i in range(batch)]
            spec = Batch(tuple(ImageSpec(p, seed=i) for i, p in enumerate(prompts)), size, size, STEPS, "euler")
            latents = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 4, size // 8, size // 8),
                                                                                dtype=np.float32))

            def torch_run(prompts: list[str] = prompts, size: int = size, latents: torch.Tensor = latents) -> None:
                with torch.inference_mode():
                    theirs(prompts, height=size, width=size, num_inference_steps=STEPS, guidance_scale=7.5,
                           latents=latents, output_type="np")

            row = {"size": size, "batch": batch,
                   **summarize(*interleaved(lambda spec=spec: ours(spec), torch_run, repeats), batch)}
            rows.append(row)
            print(f"{size}x{size} batch {batch}: {row}", flush=True)
    return {"steps": STEPS, "scheduler": "euler", "repeats": repeats, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "torch": torch.__version__, "diffusers": diffusers.__version__, "rows": rows}


def _spread(r: dict[str, object]) -> str:
    if "speedup_min" not in r:
        return "not recorded"
    return f"{r['speedup_min']}–{r['speedup_max']}x over {r['rounds']} rounds"


def table(result: dict[str, object]) -> str:
    """The README section: the table and the target line, both from ``result``."""
    rows: list[dict[str, object]] = result["rows"]  # type: ignore[assignment]
    how = (f"Interleaved A/B rounds ({result['repeats']} per row, after a warm-up of each side); speedup = median "
           "of the per-round ratios, with their range." if all("speedup_min" in r for r in rows) else
           f"Older run: each side timed separately (median of {result['repeats']}), no spread recorded; "
           "`make bench` reruns it interleaved.")
    lines = [how, "", "| size | batch | ours (s/image) | diffusers torch (s/image) | speedup | range |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']}x{r['size']} | {r['batch']} | {r['ours_s_per_image']} | "
                     f"{r['torch_s_per_image']} | **{r['speedup']}x** | {_spread(r)} |")
    goal = next((r for r in rows if r["size"] == TARGET["size"] and r["batch"] == TARGET["batch"]), None)
    if goal is not None:
        met = "met" if float(goal["speedup"]) >= TARGET["speedup"] else "NOT met"  # type: ignore[arg-type]
        lines += ["", f"Target {met}: **{goal['speedup']}x at {goal['size']}x{goal['size']} batch {goal['batch']}** "
                  f"(target ≥ {TARGET['speedup']}x; range {_spread(goal)}; torch {result['torch']}, diffusers "
                  f"{result['diffusers']}, {result['cpu_count']} cores)."]
    return "\n".join(lines)


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``64x1,256x4`` -> [(64, 1), (256, 4)] (size x batch)."""
    return [(int(size), int(batch)) for size, batch in (c.split("x") for c in text.split(",") if c)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=9, help="interleaved rounds per case")
    parser.add_argument("--cases", type=parse_cases, default=CASES, help="SIZExBATCH list, e.g. 64x1,256x1")
    parser.add_argument("--model", type=Path, default=None, help="unused: the benchmark builds its own pair")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_cpu.json"))
    parser.add_argument("--from-results", type=Path, default=None, help="render a saved result; run nothing")
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    if args.from_results is not None:
        result = json.loads(args.from_results.read_text())
    else:
        result = run(args.repeats, args.cases)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    write_section(args.write_readme, "pipeline", table(result))


if __name__ == "__main__":
    main()
