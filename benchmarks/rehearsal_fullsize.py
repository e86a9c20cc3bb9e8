"""The full-size rehearsal's heavy steps, each in a fresh process so its figures are its own (issue 37, point 2;
tests/integration/test_fullsize_rehearsal.py runs them and asserts on what they print):

    python benchmarks/rehearsal_fullsize.py build OUT DIFFUSERS_OUT [BPE]
        engines/build/sd15.py build_sd15: the random-weight SD 1.5-architecture model, fp32, the UNet's weights
        as external data (and its diffusers twin, which build_sd15 always writes)
    python benchmarks/rehearsal_fullsize.py relocate MODEL PROFILE WORK
        `sdserve accept`'s relocation step (engines/accept/run.py relocation_check) on MODEL under the
        plugin-EP profile PROFILE: the folder reproduced by hard links, `engines build` (engines/build/epctx.py,
        what `sdserve engines build --profile openvino` runs) in it, the folder moved, a strict boot from the
        moved EP-context models

Each prints one JSON line last: the step's result and its ``figures`` (wall seconds, peak RSS from VmHWM, bytes
this process caused to be written to storage, from /proc/self/io ``write_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any


def figures(start: float) -> dict[str, float]:
    """This process's wall time since ``start``, peak RSS and bytes written to storage. VmHWM, not ru_maxrss
    (Linux carries ru_maxrss over fork and exec); ``write_bytes`` counts the bytes this process dirtied, so a file
    written and deleted still counts (``wchar`` would count writes to the null device too)."""
    status = Path("/proc/self/status").read_text().splitlines()
    kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    io = dict(line.split(": ", 1) for line in Path("/proc/self/io").read_text().splitlines() if ": " in line)
    return {"seconds": round(time.monotonic() - start, 1), "peak_rss_gb": round(kib / 2**20, 2),
            "written_gb": round(int(io["write_bytes"]) / 1e9, 2)}


def build(out: Path, diffusers_out: Path, bpe: Path | None) -> dict[str, Any]:
    from engines.build.sd15 import build_sd15

    build_sd15(out, diffusers_out, bpe=bpe)
    return {"model": str(out)}


def relocate(model: Path, profile: Path, work: Path) -> dict[str, Any]:
    from engines.accept import run as accept_run
    from engines.health.preflight import gather
    from server.bootstrap import BootConfig

    boot = BootConfig.create(model, "openvino", profile)
    runtime = boot.settings.runtime
    options = accept_run.AcceptOptions(work, runtime, boot.matrix, boot.plan, boot.settings.signature, model=model,
                                       size=512, steps=1)
    run = accept_run.Run(options, gather(runtime.plugin), time.monotonic() + 3600)
    run.model = model
    section = accept_run.relocation_check(run)
    return {"section": dataclasses.asdict(section), "notes": list(run.notes)}


def main() -> None:
    start = time.monotonic()
    step, args = sys.argv[1], sys.argv[2:]
    if step == "build":
        result = build(Path(args[0]), Path(args[1]), Path(args[2]) if len(args) > 2 and args[2] else None)
    elif step == "relocate":
        result = relocate(Path(args[0]), Path(args[1]), Path(args[2]))
    else:
        raise SystemExit(f"unknown step {step!r}: build or relocate")
    print(json.dumps({**result, "figures": figures(start)}, default=str))


if __name__ == "__main__":
    main()
