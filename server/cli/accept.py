"""`sdserve accept`: one command that accepts a GPU node (or a fix on one) and writes the evidence.

Parses the options, resolves the profile like every boot (server/bootstrap.py) and calls engines.factory.accept,
which gates on the GPU first (exit 20 in well under a second on a machine without one) and then runs the steps.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from engines.factory import accept, accept_step_budgets
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
  staging     every host->device copy of one request, its host memory checked with cudaPointerGetAttributes:
              pinned or not
  copies      host->device copies per denoising step: the pipeline's own (two requests of different lengths)
              and MemcpyFromHost/MemcpyToHost in an ORT profile of one request
  relocation  `engines build` -> move the folder -> load again: every component from its EP-context model in
              the new folder, each engine path resolving beside it; nothing compiled on load
  protocol    --jobs jobs back to back (--size 512, --steps 50, batch 1): all succeed; mean, range, jobs/hour;
              with --changed, exactly one variable differs between before and after
  parity      throughput in % of the reference (--baseline or --compare) inside 100 +/- --band;
              without either: not applicable, saying what it would need (and this run's jobs/hour)
  signature   NVML during the jobs: SM %, memory-controller %, watts -> healthy compute vs livelock
              (not applicable when NVML gives no utilization, e.g. on a MIG slice)
  latency     ms/step and s/image, ours next to diffusers' torch fp16 pipeline on the same weights
A step that fails, or starts after --budget is spent, is recorded in its section's place; the others still run.
A check that says nothing on this node is "not applicable" with the reason (never "pass"). Every step is timed
against its own budget (--step-budget); the report lists step, seconds, budget and state, and a step over its
budget fails the verdict's "budget" line. Default step budgets (s):
  {budgets}.

--profile cuda (the CUDA provider alone, no TensorRT on the node) accepts a node for that profile: the same GPU
gate and sections, on the ONNX graphs of --model (`sdserve engines optimize --target cuda`); preflight reports
TensorRT absent by design.

A plugin-EP profile (--profile openvino: OpenVINO on the CPU, what CI rehearses) runs the same flow on that EP,
with its EP-context artifacts; the CUDA-only checks (staging, copies, the NVML signature) say "not applicable on
this EP". The GPU gate applies to NVIDIA devices only.

Model: --model DIR accepts an exported ONNX folder (what the serving image can do: it has no torch). Without
--model, accept builds the SD 1.5-architecture model with random weights on the node, which needs torch,
diffusers and transformers (a build environment, not the serving image) and enables the torch reference.

Files:
  --baseline FILE   TOML, one table per GPU model as NVML names it:
                      ["NVIDIA H200"]
                      jobs_per_hour = 1180.0
  --changed B A     two KEY=VALUE files describing the node before and after a fix (`env`, `pip freeze` and
                    hand-written lines all parse; # comments allowed). A fix is accepted only when exactly one
                    key differs.
  --compare URL     a sibling replica running `sdserve serve`: the same jobs are sent to it and its
                    Server-Timing compute time is compared with ours (env SDSERVE_COMPARE_API_KEY: its API key).

Exit codes: 0 accepted; 30 a section failed or a step went over its budget (see the report);
20 no usable NVIDIA GPU (checked first, nothing is written); 10 bad options or config files;
2 bad command-line options."""


STEP_BUDGETS_S = accept_step_budgets()


def register(sub: Any) -> None:
    p = sub.add_parser("accept", help="accept a GPU node: proofs of the fast path, the field's protocol, a report",
                       description="Run on a fresh GPU node (about 10 minutes): prove the GPU fast path end to end "
                                   "and write a JSON report plus a Markdown summary.",
                       epilog=REPORT_HELP.format(budgets=", ".join(f"{k} {v:g}" for k, v in STEP_BUDGETS_S.items())),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("accept"), help="report folder (default: ./accept)")
    p.add_argument("--model", type=Path, default=None,
                   help="ONNX model folder to accept (default: build the SD 1.5-architecture model with random "
                        "weights on the node; needed for the torch reference)")
    p.add_argument("--profile", choices=PROFILES, default="production")
    p.add_argument("--config", type=Path, default=None, help="a profile TOML file instead of configs/<profile>.toml")
    p.add_argument("--matrix", type=Path, default=None, help="version matrix TOML (default: configs/matrix.toml)")
    p.add_argument("--device-id", type=int, default=None, help="CUDA device to accept")
    p.add_argument("--jobs", type=int, default=10, help="protocol jobs (the protocol needs 10; fewer fail it)")
    p.add_argument("--size", type=int, default=512, help="protocol image size, square (the field's protocol: 512; "
                                                         "a served size of the profile)")
    p.add_argument("--steps", type=int, default=50, help="protocol denoising steps (the field's protocol: 50)")
    reference = p.add_mutually_exclusive_group()
    reference.add_argument("--baseline", type=Path, default=None, help="recorded jobs/hour per GPU model (TOML)")
    reference.add_argument("--compare", metavar="URL", default=None, help="sibling replica to compare with")
    p.add_argument("--band", type=float, default=10.0, metavar="PERCENT", help="parity band, +/- %% (default 10)")
    p.add_argument("--changed", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="KEY=VALUE files before/after a fix: the one-variable rule")
    p.add_argument("--skip-torch-reference", action="store_true", help="do not time diffusers' torch pipeline")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="cap for the whole run; steps not started by then are recorded as failed (default: the sum "
                        "of the step budgets)")
    p.add_argument("--step-budget", action="append", default=[], metavar="STEP=SECONDS", type=_step_budget,
                   help=f"one step's budget, repeatable; steps: {', '.join(STEP_BUDGETS_S)}")
    p.set_defaults(run=run)


def _step_budget(text: str) -> tuple[str, float]:
    name, _, value = text.partition("=")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if name not in STEP_BUDGETS_S or not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected STEP=SECONDS with STEP one of {', '.join(STEP_BUDGETS_S)} and "
                                         f"SECONDS > 0, got {text!r}")
    return name, seconds


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1 or args.band < 0 or (args.budget is not None and args.budget <= 0) or args.size < 8 \
            or args.steps < 1:
        log.error("--jobs and --steps must be >= 1, --size >= 8, --band >= 0 and --budget > 0")
        return int(ExitCode.USAGE)
    # The profile, matrix and self-test plan, resolved like every boot (BootConfig's model path is not used here).
    boot = BootConfig.create(args.model or DEFAULT_MODEL, args.profile, args.config, args.matrix,
                             device_id=args.device_id)
    failing = accept(args.model, boot.settings.runtime, boot.matrix, boot.plan, boot.settings.signature, args.out,
                     jobs=args.jobs, band_percent=args.band, baseline=args.baseline, compare=args.compare,
                     changed=(args.changed[0], args.changed[1]) if args.changed else None,
                     skip_torch_reference=args.skip_torch_reference, budget_s=args.budget,
                     step_budgets_s=tuple(args.step_budget), size=args.size, steps=args.steps)
    report = args.out / "accept_report.md"
    if failing:
        log.error("node NOT accepted: %s failed (report: %s)", ", ".join(failing), report)
        return int(ExitCode.GATE_REGRESSION)
    log.info("node accepted (report: %s)", report)
    return int(ExitCode.OK)
