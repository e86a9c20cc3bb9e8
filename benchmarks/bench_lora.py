"""What LoRA per request costs, on the tiny SD 1.x in one run: a batch without LoRA, the first batch of a new
adapter set (its merge on the device included), and a batch of a cached set, interleaved round by round and
reported as medians and same-run ratios to the no-LoRA batch (this machine is noisy; absolute times only from a
GPU run). Each round's "new" set is new because its multiplier is (a new key), so every round merges again.

    python benchmarks/bench_lora.py [--rounds 7] [--steps 20] [--sizes 64,256]
                                    [--out benchmarks/results/lora_cpu.json] [--write-readme docs/lora.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from readme import write_section

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/lora_files.py makes the LoRA file

PROMPT = "a photo of an astronaut riding a horse"


def _library(diffusers_dir: Path, folder: Path) -> None:
    import diffusers

    from tests import lora_files as lf

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(diffusers_dir, safety_checker=None)
    lf.peft_file(folder / "style.safetensors", {
        "unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 8, seed=1),
        "text_encoder": lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 8, seed=2)})


def _engine(model: Path, folder: Path) -> Any:
    from engines.config import LoraSettings, RuntimeSettings
    from engines.engine import OrtEngine

    engine = OrtEngine(model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                              lora=LoraSettings(dir=str(folder))))
    engine.load()
    return engine


def _timed(engine: Any, size: int, steps: int, uses: tuple[Any, ...]) -> float:
    from engines.types.request import Batch, ImageSpec

    start = time.perf_counter()
    engine.generate(Batch((ImageSpec(PROMPT, seed=1),), size, size, steps, "euler", loras=uses))
    return time.perf_counter() - start


def measure(engine: Any, size: int, steps: int, rounds: int) -> dict[str, Any]:
    from engines.types.request import LoraUse

    sha = next(f.sha256 for f in engine.loras() if f.name == "style")
    cached = (LoraUse("style", sha, 1.0, 1.0),)
    for uses in ((), cached):  # warm-up: first runs of the base and the variant sessions at this size
        _timed(engine, size, steps, uses)
    base, new, hit, merges = [], [], [], []
    for r in range(rounds):
        base.append(_timed(engine, size, steps, ()))
        fresh = (LoraUse("style", sha, 0.5 + r / 100, 0.5 + r / 100),)
        new.append(_timed(engine, size, steps, fresh))
        merges.append(engine.lora_stats().last_merge_seconds)
        hit.append(_timed(engine, size, steps, cached))
    med = statistics.median
    return {"size": size, "steps": steps, "rounds": rounds,
            "no_lora_s": round(med(base), 4), "new_set_s": round(med(new), 4), "cached_set_s": round(med(hit), 4),
            "merge_s": round(med(merges), 4),
            "new_set_ratio": round(med(n / b for n, b in zip(new, base, strict=True)), 3),
            "cached_set_ratio": round(med(c / b for c, b in zip(hit, base, strict=True)), 3),
            "merge_share_of_new": round(med(m / n for m, n in zip(merges, new, strict=True)), 3)}


def table(rows: list[dict[str, Any]], weights: dict[str, int]) -> str:
    lines = ["| size, steps | no LoRA (s) | new set, merge included (s) | merge (s) | cached set (s) | "
             "new / no LoRA | cached / no LoRA |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']}², {r['steps']} | {r['no_lora_s']} | {r['new_set_s']} | {r['merge_s']} | "
                     f"{r['cached_set_s']} | {r['new_set_ratio']}× | {r['cached_set_ratio']}× |")
    adapted = ", ".join(f"{k} {v}" for k, v in weights.items())
    lines.append(f"\nCPU, 2 threads, medians of {rows[0]['rounds']} interleaved rounds (`make bench`); the LoRA "
                 f"(rank 8) changes {adapted} weights of the tiny model. Ratios are same-run; absolute seconds are "
                 "this machine's, not a GPU's.")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_cpu.json"))
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    from engines.build.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny(root / "onnx", diffusers_out=root / "torch")
        (root / "loras").mkdir()
        _library(root / "torch", root / "loras")
        engine = _engine(model, root / "loras")
        rows = [measure(engine, int(s), args.steps, args.rounds) for s in args.sizes.split(",")]
        weights = {f"{name}": n for name, n in
                   next(f for f in engine.loras() if f.name == "style").components.items()}
        engine.close()
    result = {"rows": rows, "adapted_weights": weights}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if write_section(args.write_readme, "lora", table(rows, weights)):
        print(f"wrote the table into {args.write_readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
