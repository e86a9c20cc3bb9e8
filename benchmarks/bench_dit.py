"""The flow-matching DiT families on their tiny builds: our ORT pipeline vs diffusers' FluxPipeline /
StableDiffusion3Pipeline on the same weights, at two sizes (the token count, the dynamic shift and the attention's
seq² cost change with size), and each side's peak RSS in a fresh child process.

Same run, same machine, same steps, the families' own guidance (Flux dev: the embedded guidance 3.5, no CFG; SD 3.5:
CFG 4.5 with a negative prompt) and T5 lengths (Flux 512, SD 3.5 256); the sides are interleaved
(bench_pipeline.py's ``interleaved``) and reported as median ratios because this machine is noisy.

    python benchmarks/bench_dit.py [--repeats 5] [--steps 8] [--sizes 64,256] [--out benchmarks/results/dit_cpu.json]
    python benchmarks/bench_dit.py --rss ours|torch FAMILY MODEL_DIR SIZE STEPS   (the child: prints peak RSS)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_pipeline import interleaved, summarize

FAMILIES = ("flux", "sd35")
GUIDANCE = {"flux": 3.5, "sd35": 4.5}
PROMPT = "a photo of an astronaut riding a horse"


def _ours(folder: Path) -> Any:
    from engines.config import RuntimeSettings
    from engines.pipelines.flow import load_pipeline
    from engines.runtime.sessions import Runtime

    return load_pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


def _batch(family: str, size: int, steps: int) -> Any:
    from engines.types.request import Batch, ImageSpec

    return Batch((ImageSpec(PROMPT, "blurry", seed=1, guidance_scale=GUIDANCE[family]),), size, size, steps)


def _torch(family: str, folder: Path) -> Any:
    import diffusers

    kind = diffusers.FluxPipeline if family.startswith("flux") else diffusers.StableDiffusion3Pipeline
    pipe = kind.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _torch_call(pipe: Any, family: str, size: int, steps: int) -> None:
    import torch

    extra = {} if family.startswith("flux") else {"negative_prompt": "blurry"}
    with torch.inference_mode():
        pipe(PROMPT, height=size, width=size, num_inference_steps=steps, guidance_scale=GUIDANCE[family],
             output_type="np", **extra)


def peak_rss(side: str, family: str, folder: Path, size: int, steps: int) -> float:
    """MiB: one generation in a fresh child process, its own VmHWM."""
    done = subprocess.run([sys.executable, __file__, "--rss", side, family, str(folder), str(size), str(steps)],
                          capture_output=True, text=True, check=True, timeout=1800)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mib"])


def family_case(family: str, root: Path, sizes: list[int], steps: int, repeats: int) -> dict[str, object]:
    from engines.build.dit import build_tiny_dit

    onnx_dir = build_tiny_dit(family, root / family / "onnx", diffusers_out=root / family / "torch",
                              vae_encoder=False)
    ours, theirs = _ours(onnx_dir), _torch(family, root / family / "torch")
    rows: dict[str, object] = {}
    for size in sizes:
        batch = _batch(family, size, steps)
        mine, other = interleaved(lambda b=batch: ours(b), lambda s=size: _torch_call(theirs, family, s, steps),
                                  repeats)
        tokens = (size // 16) ** 2
        rows[f"{size}x{size}"] = {"image_tokens": tokens, "steps": steps, **summarize(mine, other, 1),
                                  "ours_peak_rss_mib": peak_rss("ours", family, onnx_dir, size, steps),
                                  "torch_peak_rss_mib": peak_rss("torch", family, root / family / "torch", size,
                                                                 steps)}
    return rows


def child(side: str, family: str, folder: Path, size: int, steps: int) -> None:
    if side == "ours":
        _ours(folder)(_batch(family, size, steps))
    else:
        _torch_call(_torch(family, folder), family, size, steps)
    status = Path("/proc/self/status").read_text().splitlines()
    kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_mib": round(kib / 1024, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rss", nargs=5, metavar=("SIDE", "FAMILY", "MODEL", "SIZE", "STEPS"), default=None)
    args = parser.parse_args()
    if args.rss is not None:
        side, family, model, size, steps = args.rss
        child(side, family, Path(model), int(size), int(steps))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = {f: family_case(f, Path(tmp), sizes, args.steps, args.repeats) for f in args.families.split(",")}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
