"""`sdserve doctor`: preflight, session build and placement audit without serving; same exit codes as serve."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engines.errors import SdserveError
from engines.protocol import Capabilities, Engine
from server.cli.common import add_boot_args, boot_config
from server.exitcodes import ExitCode, exit_code_for
from server.settings import Settings


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="preflight + session build + placement audit, without serving")
    add_boot_args(p)
    p.add_argument("--json", action="store_true", help="print the capability snapshot as JSON")
    p.add_argument("--watch", type=float, default=0.0, metavar="N",
                   help="sample NVML for N seconds and classify the GPU signature")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    boot = boot_config(args)
    return doctor(args, boot.settings, boot.engine())


def doctor(args: argparse.Namespace, settings: Settings, engine: Engine) -> int:
    code = ExitCode.OK
    for step in (engine.preflight, engine.load):
        try:
            step()
        except SdserveError as exc:  # keep going: the snapshot should show everything that is wrong
            code = code or exit_code_for(exc)
    caps = engine.capabilities()
    signature = watch(args.watch, settings, engine) if args.watch > 0 else None
    if signature is not None and "error" in signature:
        code = code or ExitCode.GPU_UNAVAILABLE
    engine.close()
    extra: dict[str, Any] = {"profile": settings.profile, "exit_code": {"code": int(code), "name": code.name}}
    if signature is not None:
        extra["signature"] = signature
    if args.json:
        print(json.dumps({**caps.model_dump(mode="json"), **extra}, indent=2))
    else:
        print(render(caps, settings.profile, code, signature))
    return int(code)


def watch(seconds: float, settings: Settings, engine: Engine) -> dict[str, Any]:
    """Sample telemetry every 0.2 s for ``seconds`` and classify the signature (no requests run during doctor)."""
    source = engine.telemetry()
    if source is None:
        return {"error": "NVML unavailable (no GPU telemetry on this node or policy)"}
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(source.sample(settings.runtime.device_id))
        time.sleep(0.2)
    result = engine.signature(samples, requests_running=False)
    return {"verdict": result.verdict, "reason": result.reason, "samples": len(samples),
            "sm_percent": result.sm_percent, "memory_percent": result.memory_percent, "power_w": result.power_w}


def render(caps: Capabilities, profile: str, code: ExitCode, signature: dict[str, Any] | None) -> str:
    lines = [f"sdserve doctor — profile {profile}, device {caps.device}:{caps.device_id}",
             f"accelerated: {str(caps.accelerated).lower()}   verdict: {caps.verdict.status}   "
             f"exit code: {int(code)} ({code.name})", ""]
    for check in caps.checks:
        mark = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[check.status]
        lines.append(f"  [{mark}] {check.name}: {check.observed}")
        if check.status == "fail":
            lines.append(f"         expected {check.expected}; fix: {check.remediation}")
    for name, session in caps.sessions.items():
        lines.append(f"  session {name}: {', '.join(session.providers_used) or 'not created'}")
        for event in session.ort_events:
            lines.append(f"         ORT {event.kind}: {event.detail or event.line[:120]}")
    if caps.verdict.reasons:
        lines += ["", "reasons:"] + [f"  - {r}" for r in caps.verdict.reasons]
    if signature is not None:
        lines += ["", f"signature: {signature}"]
    if not caps.accelerated:
        lines += ["", "WARNING: NOT ACCELERATED — this configuration does not run on the GPU fast path."]
    return "\n".join(lines)
