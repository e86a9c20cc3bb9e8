"""One generation in this fresh process, then its peak resident set size: a child of bench_pipeline.py, so each
side's peak is its own (imports, sessions or modules, activations) and not the parent's.

    python benchmarks/peak_rss.py ours|torch MODEL_DIR SIZE BATCH STEPS   -> prints {"peak_rss_mib": ...}

``ours`` never imports torch; ``torch`` runs diffusers' pipeline on a diffusers folder (SDXL's when it has
text_encoder_2), Euler, CFG 7.5, like the timed rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ours(model: Path, size: int, batch: int, steps: int) -> None:
    from engines.config import RuntimeSettings
    from engines.pipelines.unet import StableDiffusionOnnx
    from engines.runtime.sessions import Runtime
    from engines.types.request import Batch, ImageSpec

    pipe = StableDiffusionOnnx(model, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    pipe(Batch(tuple(ImageSpec(f"a lighthouse, variant {i}", seed=i) for i in range(batch)), size, size, steps,
               "euler"))


def theirs(model: Path, size: int, batch: int, steps: int) -> None:
    import diffusers
    import torch

    xl = (model / "text_encoder_2").is_dir()
    cls = diffusers.StableDiffusionXLPipeline if xl else diffusers.StableDiffusionPipeline
    pipe = cls.from_pretrained(model, **({} if xl else {"safety_checker": None}))
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        pipe([f"a lighthouse, variant {i}" for i in range(batch)], height=size, width=size,
             num_inference_steps=steps, guidance_scale=7.5, output_type="np")


def main() -> None:
    side, model, size, batch, steps = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6])
    (ours if side == "ours" else theirs)(model, size, batch, steps)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork and exec, so a child of a big parent would report
    # the parent's peak; VmHWM belongs to this process's own address space.
    status = Path("/proc/self/status").read_text().splitlines()
    kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_mib": round(kib / 1024, 1)}))


if __name__ == "__main__":
    main()
