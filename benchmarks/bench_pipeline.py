"""Per-image latency and peak memory: our ORT pipeline vs diffusers' torch StableDiffusionPipeline, same weights.

Ours runs the model as `sdserve engines optimize --target cpu` leaves it (fused attention, ORT's CPU fusions) with
the runtime's default session options. Same run, same machine, same scheduler (Euler), same steps, CFG on both
sides; reported as ratios because this machine is noisy. The two sides are interleaved (A B A B ...: one call of
each per round, after a warm-up of both), so machine noise hits both alike; each round gives one ratio, and the
docs page shows their median and range, with the load average seen before and after. Peak RSS is measured per side in
a fresh child process (benchmarks/peak_rss.py). Every docs line that quotes a number is rendered here from the
results, never written by hand.

    python benchmarks/bench_pipeline.py [--repeats 5] [--cases 256x1:20,256x4:20,512x1:4] \
        [--write-readme docs/benchmarks.md]
    python benchmarks/bench_pipeline.py --from-results benchmarks/results/pipeline_cpu.json \
        --write-readme docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CASES = [(256, 1, 8), (256, 4, 8), (512, 1, 2)]
"""(size, batch, steps): few steps (the ratio is per image at equal steps; 20 steps of 512x512 take minutes on
2 shared cores)."""
MEMORY = [("sd1", 512, 2, 2, True), ("sdxl", 1024, 1, 1, False)]
"""(family, size, batch, steps, with diffusers) of the peak-RSS rows: ours fused and unfused (the raw export), and
diffusers where asked (at 1024x1024 its VAE alone takes minutes on 2 shared cores)."""
TARGETS = [{"size": 256, "batch": 1, "speedup": 1.5}, {"size": 512, "batch": 1, "speedup": 1.5},
           {"size": 256, "batch": 4, "speedup": 1.2}]
"""The goals quoted on the benchmarks page (docs/benchmarks.md; issue 23), each a same-run median ratio."""
HERE = Path(__file__).resolve().parent


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
            "ours_range_s": [round(min(ours) / batch, 4), round(max(ours) / batch, 4)],
            "speedup": round(statistics.median(ratios), 2), "speedup_min": round(min(ratios), 2),
            "speedup_max": round(max(ratios), 2), "rounds": len(ratios)}


def _build(root: Path, family: str) -> tuple[Path, Path, Path]:
    """(raw export, optimized for the CPU, diffusers folder) of the tiny ``family`` model."""
    from engines.build.optimize import optimize_folder
    from engines.build.tiny import build_tiny

    raw = build_tiny(root / family / "onnx", diffusers_out=root / family / "torch", family=family)
    optimize_folder(raw, root / family / "cpu", target="cpu")
    return raw, root / family / "cpu", root / family / "torch"


def speed_rows(onnx_dir: Path, torch_dir: Path, cases: list[tuple[int, int, int]], repeats: int) -> list[Any]:
    import diffusers
    import numpy as np
    import torch

    from engines.config import RuntimeSettings
    from engines.pipelines.unet import StableDiffusionOnnx
    from engines.runtime.sessions import Runtime
    from engines.types.request import Batch, ImageSpec

    ours = StableDiffusionOnnx(onnx_dir, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                 allow_cpu=True)))
    theirs = diffusers.StableDiffusionPipeline.from_pretrained(torch_dir, safety_checker=None)
    theirs.scheduler = diffusers.EulerDiscreteScheduler.from_config(
        json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text()))
    theirs.set_progress_bar_config(disable=True)
    rows = []
    for size, batch, steps in cases:
        prompts = [f"a lighthouse at dusk, variant {i}" for i in range(batch)]
        spec = Batch(tuple(ImageSpec(p, seed=i) for i, p in enumerate(prompts)), size, size, steps, "euler")
        latents = torch.from_numpy(np.random.default_rng(0).standard_normal((batch, 4, size // 8, size // 8),
                                                                            dtype=np.float32))

        def torch_run(prompts: list[str] = prompts, size: int = size, steps: int = steps,
                      latents: torch.Tensor = latents) -> None:
            with torch.inference_mode():
                theirs(prompts, height=size, width=size, num_inference_steps=steps, guidance_scale=7.5,
                       latents=latents, output_type="np")

        load = os.getloadavg()[0]
        row = {"size": size, "batch": batch, "steps": steps,
               **summarize(*interleaved(lambda spec=spec: ours(spec), torch_run, repeats), batch),
               "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
        rows.append(row)
        print(f"{size}x{size} batch {batch}: {row}", flush=True)
    return rows


def peak_rss(side: str, model: Path, size: int, batch: int, steps: int) -> float:
    done = subprocess.run([sys.executable, str(HERE / "peak_rss.py"), side, str(model), str(size), str(batch),
                           str(steps)], capture_output=True, text=True, check=True, timeout=3600)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mib"])


def memory_rows(built: dict[str, tuple[Path, Path, Path]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for family, size, batch, steps, with_torch in MEMORY:
        raw, cpu, torch_dir = built[family]
        row: dict[str, object] = {"family": family, "size": size, "batch": batch, "steps": steps,
                                  "ours_mib": peak_rss("ours", cpu, size, batch, steps),
                                  "ours_unfused_mib": peak_rss("ours", raw, size, batch, steps),
                                  "torch_mib": peak_rss("torch", torch_dir, size, batch, steps) if with_torch
                                  else "not run"}
        rows.append(row)
        print(f"peak RSS {family} {size}x{size} batch {batch}: {row}", flush=True)
    return rows


def versions() -> dict[str, object]:
    import diffusers
    import onnxruntime
    import torch

    return {"onnxruntime": onnxruntime.__version__, "torch": torch.__version__, "diffusers": diffusers.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "ort_intra_op_threads": "ORT default: one per physical core", "ort_spinning": False,
            "machine": platform.machine()}


def run(repeats: int, cases: list[tuple[int, int, int]], memory: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        built = {f: _build(Path(tmp), f) for f in (["sd1", "sdxl"] if memory else ["sd1"])}
        _, cpu, torch_dir = built["sd1"]
        rows = speed_rows(cpu, torch_dir, cases, repeats)
        mem = memory_rows(built) if memory else []
    return {"scheduler": "euler", "repeats": repeats, **versions(), "rows": rows, "memory": mem}


def _spread(r: dict[str, object]) -> str:
    if "speedup_min" not in r:
        return "not recorded"
    return f"{r['speedup_min']}–{r['speedup_max']}x over {r['rounds']} rounds"


def _goal_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for goal in TARGETS:
        row = next((r for r in result["rows"] if r["size"] == goal["size"] and r["batch"] == goal["batch"]), None)
        if row is None:
            continue
        met = "met" if float(row["speedup"]) >= goal["speedup"] else "NOT met"
        lines.append(f"- {row['size']}x{row['size']} batch {row['batch']}: **{row['speedup']}x** (goal ≥ "
                     f"{goal['speedup']}x, {met}; range {_spread(row)})")
    for m in result.get("memory", []):
        if m["size"] == 512 and isinstance(m["torch_mib"], float):
            met = "met" if m["ours_mib"] < m["torch_mib"] else "NOT met"
            lines.append(f"- peak RSS at 512x512 batch {m['batch']}: {m['ours_mib']} MiB ours vs {m['torch_mib']} "
                         f"MiB diffusers (goal: below diffusers', {met})")
    return lines


def table(result: dict[str, Any]) -> str:
    """The benchmarks page section: the speed table, the memory table and the goal lines, all from ``result``."""
    lines = [f"Interleaved A/B rounds ({result['repeats']} per row, after a warm-up of each side); speedup = median "
             "of the per-round ratios, with their range; load = 1-minute load average before/after the row "
             f"(this machine has {result['cpu_count']} cores and is shared: anything above ~2 means other work "
             "competed). ORT " + f"{result.get('onnxruntime', '?')}, torch {result['torch']} "
             f"({result['torch_threads']} threads), diffusers {result['diffusers']}.", "",
             "| size | batch | steps | ours (s/image) | diffusers torch (s/image) | speedup | range | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['size']}x{r['size']} | {r['batch']} | {r.get('steps', result.get('steps', '?'))} | "
                     f"{r['ours_s_per_image']} | {r['torch_s_per_image']} | **{r['speedup']}x** | {_spread(r)} | "
                     f"{r.get('load_before', '?')}/{r.get('load_after', '?')} |")
    if result.get("memory"):
        lines += ["", "Peak RSS, one generation per fresh process (MiB):", "",
                  "| model | size | batch | steps | ours (fused attention) | ours unfused | diffusers torch |",
                  "|---|---|---|---|---|---|---|"]
        for m in result["memory"]:
            lines.append(f"| tiny {m['family']} | {m['size']}x{m['size']} | {m['batch']} | {m['steps']} | "
                         f"{m['ours_mib']} | {m['ours_unfused_mib']} | {m['torch_mib']} |")
    note = [f"Run note: {result['note']}", ""] if result.get("note") else []
    return "\n".join([*note, *lines, "", "Goals (same-run ratios under the load shown):", *_goal_lines(result)])


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    """``256x1:20,512x1:4`` -> [(256, 1, 20), (512, 1, 4)] (size x batch : steps; steps default 20)."""
    out = []
    for case in (c for c in text.split(",") if c):
        shape, _, steps = case.partition(":")
        size, batch = shape.split("x")
        out.append((int(size), int(batch), int(steps or 20)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds per case")
    parser.add_argument("--cases", type=parse_cases, default=CASES, help="SIZExBATCH[:STEPS] list")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS rows")
    parser.add_argument("--model", type=Path, default=None, help="unused: the benchmark builds its own pair")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline_cpu.json"))
    parser.add_argument("--from-results", type=Path, default=None, help="render a saved result; run nothing")
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    if args.from_results is not None:
        result = json.loads(args.from_results.read_text())
    else:
        result = run(args.repeats, args.cases, not args.no_memory)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    from readme import write_section

    write_section(args.write_readme, "pipeline", table(result))


if __name__ == "__main__":
    main()
