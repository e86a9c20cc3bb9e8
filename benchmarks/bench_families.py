"""Per family, on the tiny builds: our ORT pipeline vs diffusers' torch pipeline on the same weights (the SDXL one
for sdxl), and the Turbo path's speed-up from skipping the unconditional half at equal steps.

Same run, same machine, same scheduler (Euler), same steps; the sides are interleaved (bench_pipeline.py's
``interleaved``) and reported as median ratios because this machine is noisy.

    python benchmarks/bench_families.py [--repeats 7] [--steps 8] [--out benchmarks/results/families_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from bench_pipeline import interleaved, summarize

from engines.build.tiny import build_tiny
from engines.config import RuntimeSettings
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

FAMILIES = ("sd1", "sd2", "sdxl", "turbo")
PROMPT = "a photo of an astronaut riding a horse"


def _torch(family: str, diffusers_dir: Path, onnx_dir: Path) -> Any:
    import diffusers

    cls = diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline
    pipe = cls.from_pretrained(diffusers_dir, **({} if family == "sdxl" else {"safety_checker": None}))
    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def family_case(family: str, root: Path, steps: int, repeats: int) -> dict[str, object]:
    onnx_dir = build_tiny(root / family / "onnx", diffusers_out=root / family / "torch", family=family)
    ours = StableDiffusionOnnx(onnx_dir, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                 allow_cpu=True)))
    theirs = _torch(family, root / family / "torch", onnx_dir)
    size, guidance = ours.default_size, ours.family.default_guidance
    batch = Batch((ImageSpec(PROMPT, seed=1, guidance_scale=guidance),), size, size, steps, "euler")

    def torch_call() -> None:
        with torch.no_grad():
            theirs(PROMPT, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                   output_type="np")

    mine, other = interleaved(lambda: ours(batch), torch_call, repeats)
    result: dict[str, object] = {"size": size, "steps": steps, "guidance": guidance, **summarize(mine, other, 1)}
    if family == "turbo":  # the same steps with CFG forced on (guidance 2): the UNet batch is 2, not 1
        cfg = Batch((ImageSpec(PROMPT, seed=1, guidance_scale=2.0),), size, size, steps, "euler")
        cond_only, with_cfg = interleaved(lambda: ours(batch), lambda: ours(cfg), repeats)
        skip = summarize(cond_only, with_cfg, 1)
        result["cond_only_speedup_vs_cfg"] = {"cond_only_s": skip["ours_s_per_image"],
                                              "cfg_s": skip["torch_s_per_image"], "speedup": skip["speedup"],
                                              "speedup_min": skip["speedup_min"], "speedup_max": skip["speedup_max"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        results = {f: family_case(f, Path(tmp), args.steps, args.repeats) for f in args.families.split(",")}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
