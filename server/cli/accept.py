"""`sdserve accept`: one command that accepts a GPU node (or a fix on one) and writes the evidence.

Parses the options, resolves the profile like every boot (server/bootstrap.py) and calls engines.factory.accept,
which gates on the GPU first (exit 20 in well under a second on a machine without one) and then runs the steps.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from engines.factory import accept
from server.bootstrap import BootConfig
from server.cli.common import DEFAULT_MODEL
from server.exitcodes import ExitCode
from server.settings import PROFILES

log = logging.getLogger("sdserve")

REPORT_HELP = """\
The report (--out DIR): accept_report.json (schema: engines/schemas/accept_report.schema.json) and
accept_report.md (one line per section). Sections, each with ok; the node is accepted only when all pass:
  doctor      the capability snapshot's verdict after a strict production boot
  boots       a strict production boot (preflight, load, self-test) at every served shape
  placement   per session: CPU nodes on the shape path (allowed) vs the activation path (refused)
  staging     host staging buffers checked with cudaPointerGetAttributes: pinned or not
  copies      ORT profile of one request: MemcpyFromHost/MemcpyToHost per denoising step
  relocation  `engines build` -> move the folder -> load again: loads, and nothing is built on load
  protocol    --jobs jobs back to back (512x512, 50 steps, batch 1): all succeed; mean, range, jobs/hour;
              with --changed, exactly one variable differs between before and after
  parity      throughput in % of the reference (--baseline or --compare) inside 100 +/- --band
  signature   NVML during the jobs: SM %, memory-controller %, watts -> healthy compute vs livelock
  latency     ms/step and s/image, ours next to diffusers' torch fp16 pipeline on the same weights
A step that fails or runs out of --budget is recorded in its section's place; the others still run.

Files:
  --baseline FILE   TOML, one table per GPU model as NVML names it:
                      ["NVIDIA H200"]
                      jobs_per_hour = 1180.0
  --changed B A     two KEY=VALUE files describing the node before and after a fix (`env`, `pip freeze` and
                    hand-written lines all parse; # comments allowed). A fix is accepted only when exactly one
                    key differs.
  --compare URL     a sibling replica running `sdserve serve`: the same jobs are sent to it and its
                    Server-Timing compute time is compared with ours (env SDSERVE_COMPARE_API_KEY: its API key).

Exit codes: 0 accepted; 30 a section failed (see the report); 20 no usable NVIDIA GPU (checked first, nothing is
written); 10 bad options or config files."""


def register(sub: Any) -> None:
    p = sub.add_parser("accept", help="accept a GPU node: proofs of the fast path, the field's protocol, a report",
                       description="Run on a fresh GPU node (about 10 minutes): prove the GPU fast path end to end "
                                   "and write a JSON report plus a Markdown summary.",
                       epilog=REPORT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("accept"), help="report folder (default: ./accept)")
    p.add_argument("--model", type=Path, default=None,
                   help="ONNX model folder to accept (default: build the SD 1.5-architecture model with random "
                        "weights on the node; needed for the torch reference)")
    p.add_argument("--profile", choices=PROFILES, default="production")
    p.add_argument("--config", type=Path, default=None, help="a profile TOML file instead of configs/<profile>.toml")
    p.add_argument("--matrix", type=Path, default=None, help="version matrix TOML (default: configs/matrix.toml)")
    p.add_argument("--device-id", type=int, default=None, help="CUDA device to accept")
    p.add_argument("--jobs", type=int, default=10, help="protocol jobs (the protocol needs 10; fewer fail it)")
    reference = p.add_mutually_exclusive_group()
    reference.add_argument("--baseline", type=Path, default=None, help="recorded jobs/hour per GPU model (TOML)")
    reference.add_argument("--compare", metavar="URL", default=None, help="sibling replica to compare with")
    p.add_argument("--band", type=float, default=10.0, metavar="PERCENT", help="parity band, +/- %% (default 10)")
    p.add_argument("--changed", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="KEY=VALUE files before/after a fix: the one-variable rule")
    p.add_argument("--skip-torch-reference", action="store_true", help="do not time diffusers' torch pipeline")
    p.add_argument("--budget", type=float, default=600.0, metavar="SECONDS",
                   help="time budget; steps not started by then are recorded as failed (default 600)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1 or args.band < 0 or args.budget <= 0:
        log.error("--jobs must be >= 1, --band >= 0 and --budget > 0")
        return int(ExitCode.USAGE)
    # The profile, matrix and self-test plan, resolved like every boot (BootConfig's model path is not used here).
    boot = BootConfig.create(args.model or DEFAULT_MODEL, args.profile, args.config, args.matrix,
                             device_id=args.device_id)
    failing = accept(args.model, boot.settings.runtime, boot.matrix, boot.plan, boot.settings.signature, args.out,
                     jobs=args.jobs, band_percent=args.band, baseline=args.baseline, compare=args.compare,
                     changed=(args.changed[0], args.changed[1]) if args.changed else None,
                     skip_torch_reference=args.skip_torch_reference, budget_s=args.budget)
    report = args.out / "accept_report.md"
    if failing:
        log.error("node NOT accepted: %s failed (report: %s)", ", ".join(failing), report)
        return int(ExitCode.GATE_REGRESSION)
    log.info("node accepted (report: %s)", report)
    return int(ExitCode.OK)
