"""Where the CPU time goes: ONNX Runtime's profiler over one component at one shape, summed per op type.

    python benchmarks/profile_cpu.py --model DIR --component unet --size 256 --batch 4 [--runs 3] [--out F.json]

The UNet is profiled at 2x the batch (classifier-free guidance runs both halves in one call, as the pipeline
does). Prints the op types by share of the kernel time and writes them (and the top single nodes) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort


def feeds(session: ort.InferenceSession, component: str, size: int, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    n = 2 * batch if component == "unet" else batch
    for arg in session.get_inputs():
        shape = [n if not isinstance(d, int) or i == 0 else d for i, d in enumerate(arg.shape)]
        if len(shape) == 4:
            shape[2:] = [size // 8, size // 8]
        if arg.name == "timestep":
            shape = [1]
        if "int" in arg.type:
            out[arg.name] = rng.integers(0, 49406, shape).astype(np.int64)
        else:
            out[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def profile(model: Path, component: str, size: int, batch: int, runs: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort")
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(model / component / "model.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        inputs = feeds(session, component, size, batch)
        session.run(None, inputs)  # warm-up, excluded below by taking the last ``runs`` runs' nodes
        for _ in range(runs):
            session.run(None, inputs)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    by_op: Counter[str] = Counter()
    by_node: Counter[str] = Counter()
    for e in nodes[len(nodes) * 1 // (runs + 1):]:
        by_op[e["args"]["op_name"]] += e["dur"]
        by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    total = sum(by_op.values()) or 1
    return {"component": component, "size": size, "batch": batch, "runs": runs, "threads": threads,
            "ms_per_run": round(total / runs / 1000, 2),
            "ops": {op: round(100 * us / total, 1) for op, us in by_op.most_common(12)},
            "top_nodes": {n: round(100 * us / total, 1) for n, us in by_node.most_common(8)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--component", default="unet")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = profile(args.model, args.component, args.size, args.batch, args.runs, args.threads)
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
