"""Per-image latency: our ORT pipeline vs diffusers' torch StableDiffusionPipeline on the same weights.

Same run, same machine, same scheduler (Euler), same steps, CFG on both sides; reported as ratios because this
machine is noisy. Absolute numbers are only meaningful next to each other.

    python benchmarks/bench_pipeline.py [--repeats 3] [--write-readme README.md]
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


def _time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up: allocations, kernel selection
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def run(repeats: int) -> dict[str, object]:
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
        for size, batch in CASES:
            prompts = [f"a lighthouse at dusk, variant {i}" for i in range(batch)]
            spec = Batch(tuple(ImageSpec(p, seed=i) for i, p in enumerate(prompts)), size, size, STEPS, "euler")
            latents = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 4, size // 8, size // 8),
                                                                                dtype=np.float32))

            def torch_run(prompts: list[str] = prompts, size: int = size, latents: torch.Tensor = latents) -> None:
                with torch.inference_mode():
                    theirs(prompts, height=size, width=size, num_inference_steps=STEPS, guidance_scale=7.5,
                           latents=latents, output_type="np")

            t_ours = _time(lambda spec=spec: ours(spec), repeats) / batch
            t_torch = _time(torch_run, repeats) / batch
            rows.append({"size": size, "batch": batch, "ours_s_per_image": round(t_ours, 4),
                         "torch_s_per_image": round(t_torch, 4), "speedup": round(t_torch / t_ours, 2)})
            print(f"{size}x{size} batch {batch}: ours {t_ours:.3f}s/img, torch {t_torch:.3f}s/img, "
                  f"speedup {t_torch / t_ours:.2f}x", flush=True)
    return {"steps": STEPS, "scheduler": "euler", "repeats": repeats, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
            "torch": torch.__version__, "diffusers": diffusers.__version__, "rows": rows}


def table(result: dict[str, object]) -> str:
    lines = ["| size | batch | ours (s/image) | diffusers torch (s/image) | speedup |", "|---|---|---|---|---|"]
    for r in result["rows"]:  # type: ignore[attr-defined]
        lines.append(f"| {r['size']}x{r['size']} | {r['batch']} | {r['ours_s_per_image']} | "
                     f"{r['torch_s_per_image']} | **{r['speedup']}x** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="unused: the benchmark builds its own pair")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_cpu.json"))
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    write_section(args.write_readme, "pipeline", table(result))


if __name__ == "__main__":
    main()
