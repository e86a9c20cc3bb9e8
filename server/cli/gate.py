"""`sdserve gate`: the blue-green rollout gate. Compares a candidate bench result with a baseline: p95 and
throughput per concurrency level (beyond tolerance = regression), error rate, canary fingerprints, and the
capability snapshot (providers per session are a regression when they change; library versions are reported)."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from engines.config import parse_size
from engines.errors import ConfigError
from engines.types.request import CACHE_MIN_STEPS
from server.caching import Caching
from server.cli import imagerecord
from server.cli.common import add_boot_args, boot_config
from server.exitcodes import ExitCode
from server.settings import CacheSettings

log = logging.getLogger("sdserve")


@dataclass(frozen=True)
class Row:
    check: str
    baseline: str
    candidate: str
    verdict: str
    """ok, changed or not comparable (reported, not failing), or REGRESSION."""


@dataclass(frozen=True)
class Tolerances:
    p95: float = 0.10
    throughput: float = 0.10
    error_rate: float = 0.01
    fingerprint: float = 4.0


def load(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read bench result {path}: {exc}") from None
    if data.get("format") != 1 or "levels" not in data:
        raise ConfigError(f"{path} is not an sdserve bench result")
    return data


def _levels(base: dict[str, Any], cand: dict[str, Any], tol: Tolerances) -> list[Row]:
    rows = []
    by_c = {lv["concurrency"]: lv for lv in cand["levels"]}
    for b in base["levels"]:
        c = by_c.get(b["concurrency"])
        if c is None:
            rows.append(Row(f"c={b['concurrency']} present", "yes", "missing", "REGRESSION"))
            continue
        name = f"c={b['concurrency']}"
        if b["p95_s"] and c["p95_s"]:
            worse = c["p95_s"] > b["p95_s"] * (1 + tol.p95)
            rows.append(Row(f"{name} p95 latency", f"{b['p95_s']:.3f}s", f"{c['p95_s']:.3f}s",
                            "REGRESSION" if worse else "ok"))
        elif b["p95_s"]:
            rows.append(Row(f"{name} p95 latency", f"{b['p95_s']:.3f}s", "no successful request", "REGRESSION"))
        worse = c["images_per_minute"] < b["images_per_minute"] * (1 - tol.throughput)
        rows.append(Row(f"{name} throughput", f"{b['images_per_minute']:.1f}/min", f"{c['images_per_minute']:.1f}/min",
                        "REGRESSION" if worse else "ok"))
        rate_b = b["errors"] / max(1, b["requests"])
        rate_c = c["errors"] / max(1, c["requests"])
        rows.append(Row(f"{name} error rate", f"{rate_b:.1%}", f"{rate_c:.1%}",
                        "REGRESSION" if rate_c > rate_b + tol.error_rate else "ok"))
    return rows


def _fingerprints(base: dict[str, Any], cand: dict[str, Any], tol: Tolerances) -> list[Row]:
    rows = []
    for seed, ref in base.get("fingerprints", {}).items():
        got = cand.get("fingerprints", {}).get(seed)
        if got is None:
            rows.append(Row(f"canary seed {seed}", "recorded", "missing", "REGRESSION"))
            continue
        distance = float(np.abs(np.array(got) - np.array(ref)).max())
        rows.append(Row(f"canary seed {seed} fingerprint", "-", f"distance {distance:.2f}",
                        "REGRESSION" if distance > tol.fingerprint else "ok"))
    return rows


def _snapshot(base: dict[str, Any], cand: dict[str, Any]) -> list[Row]:
    b, c = base.get("capabilities", {}), cand.get("capabilities", {})
    rows = []
    for component in sorted(set(b.get("providers", {})) | set(c.get("providers", {}))):
        if component not in b.get("providers", {}):  # a session the old baseline did not have: nothing to hold
            pc = (c["providers"][component] or ["none"])[0]
            rows.append(Row(f"provider {component}", "absent", pc, "not comparable"))
            continue
        pb = (b["providers"][component] or ["none"])[0]
        pc = (c.get("providers", {}).get(component) or ["none"])[0]
        rows.append(Row(f"provider {component}", pb, pc, "ok" if pb == pc else "REGRESSION"))
    if b.get("accelerated") and not c.get("accelerated"):
        rows.append(Row("accelerated", "true", "false", "REGRESSION"))
    for key in ("onnxruntime", "cuda_build", "cudnn", "tensorrt", "driver", "gpu"):
        if b.get(key) != c.get(key):
            rows.append(Row(key, str(b.get(key)), str(c.get(key)), "changed"))
    return rows


def compare(base: dict[str, Any], cand: dict[str, Any], tol: Tolerances = Tolerances()) -> list[Row]:
    return [*_levels(base, cand, tol), *_fingerprints(base, cand, tol), *_snapshot(base, cand)]


def render(rows: list[Row]) -> str:
    widths = [max(len(getattr(r, f)) for r in [Row("check", "baseline", "candidate", "verdict"), *rows])
              for f in ("check", "baseline", "candidate", "verdict")]
    lines = []
    for row in [Row("check", "baseline", "candidate", "verdict"), *rows]:
        cells = (row.check, row.baseline, row.candidate, row.verdict)
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)))
    failed = sum(r.verdict == "REGRESSION" for r in rows)
    lines.append(f"\n{failed} regression(s)" if failed else "\nno regression: the candidate may take traffic")
    new = sum(r.verdict == "not comparable" for r in rows)
    if new:
        lines.append(f"{new} check(s) not comparable: the baseline predates them (record a new baseline)")
    return "\n".join(lines)


def register(sub: Any) -> None:
    p = sub.add_parser("gate", help="compare two bench results (or two image records); exit non-zero on regression. "
                       "--cache: the step cache's quality gate on a model instead")
    p.add_argument("--baseline", type=Path, default=None)
    p.add_argument("--candidate", type=Path, default=None)
    p.add_argument("--p95-tolerance", type=float, default=0.10, help="allowed p95 increase (fraction)")
    p.add_argument("--throughput-tolerance", type=float, default=0.10, help="allowed throughput drop")
    p.add_argument("--fingerprint-tolerance", type=float, default=4.0, help="pixel units, 8x8 thumbnails")
    cache = p.add_argument_group("step cache gate (--cache)")
    cache.add_argument("--cache", action="store_true", help="run the canaries cached and uncached on --model at "
                       "every served size (or --size) and judge the [cache] configuration by PSNR; exit non-zero "
                       "when a size fails")
    add_boot_args(cache)
    cache.add_argument("--method", choices=("output", "first-block"), default=None, help="instead of [cache] method")
    cache.add_argument("--threshold", type=float, default=None, help="instead of [cache] threshold")
    cache.add_argument("--steps", type=int, default=None,
                       help=f"instead of [cache] gate_steps (at least {CACHE_MIN_STEPS})")
    cache.add_argument("--min-mean-psnr", type=float, default=None, help="dB, instead of gate_min_mean_psnr_db")
    cache.add_argument("--min-worst-psnr", type=float, default=None, help="dB, instead of gate_min_worst_psnr_db")
    cache.add_argument("--size", action="append", default=None, help="WIDTHxHEIGHT (repeatable); default: the "
                       "profile's served sizes, else the model's native size")
    cache.add_argument("--json", action="store_true", help="print the gate's verdicts as JSON")
    p.set_defaults(run=run)


def _cache_settings(args: argparse.Namespace, base: CacheSettings) -> CacheSettings:
    update = {k: v for k, v in (("method", args.method), ("threshold", args.threshold),
                                ("gate_steps", args.steps), ("gate_min_mean_psnr_db", args.min_mean_psnr),
                                ("gate_min_worst_psnr_db", args.min_worst_psnr)) if v is not None}
    try:
        return CacheSettings.model_validate({**base.model_dump(), **update})
    except ValidationError as exc:
        raise ConfigError(f"gate --cache: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def run_cache_gate(args: argparse.Namespace) -> int:
    """`sdserve gate --cache`: the boot gate of server/caching.py, on demand."""
    config = boot_config(args)
    settings = config.settings
    cache = _cache_settings(args, settings.cache)
    engine = config.engine()
    engine.preflight()
    engine.load()
    try:
        suite = config.plan.suite.for_family(engine.info.family)
        sizes = [parse_size(s) for s in (args.size or settings.serving.sizes)] or \
            [(engine.info.default_size, engine.info.default_size)]
        caching = Caching(cache)
        gates = caching.run_gate(engine.generate, list(dict.fromkeys(sizes)), suite.canary, suite.scheduler,
                                 suite.guidance_scale, engine.info.default_steps)
    finally:
        engine.close()
    if args.json:
        print(json.dumps([g.as_dict() for g in gates], indent=2))
    else:
        rows = [Row(f"{g.size} {g.spec.label()} {g.steps} steps", f"{g.reused}/{g.evaluations} reused",
                    f"{g.mean_psnr_db:.1f} dB mean, {g.worst_psnr_db:.1f} worst, time x{g.time_ratio:.2f}",
                    "ok" if g.passed else "REGRESSION") for g in gates]
        print(render(rows))
    if len(gates) < len(set(sizes)):
        log.error("the gate could not run at every size: %s", caching.error)
        return int(ExitCode.GATE_REGRESSION)
    return int(ExitCode.GATE_REGRESSION) if any(not g.passed for g in gates) else 0


def run(args: argparse.Namespace) -> int:
    if args.cache:
        return run_cache_gate(args)
    if args.baseline is None or args.candidate is None:
        raise ConfigError("gate needs --baseline and --candidate (or --cache)")
    tol = Tolerances(args.p95_tolerance, args.throughput_tolerance, fingerprint=args.fingerprint_tolerance)
    records = (imagerecord.read(args.baseline), imagerecord.read(args.candidate))
    if any(records):  # two images' content records (`sdserve deploy record`), not bench results
        if not all(records):
            raise ConfigError("gate compares two bench results or two image records, not one of each")
        rows = [Row(*row) for row in imagerecord.compare(*records)]  # type: ignore[arg-type]
    else:
        rows = compare(load(args.baseline), load(args.candidate), tol)
    print(render(rows))
    return int(ExitCode.GATE_REGRESSION) if any(r.verdict == "REGRESSION" for r in rows) else 0
