"""`sdserve doctor`: preflight, session build and placement audit without serving; same exit codes as serve."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from engines.errors import SdserveError
from engines.protocol import Engine
from engines.signature import classify
from server.exitcodes import ExitCode, exit_code_for
from server.settings import Settings


def doctor(args: argparse.Namespace, settings: Settings, engine: Engine) -> int:
    code = ExitCode.OK
    for step in (engine.preflight, engine.load):
        try:
            step()
        except SdserveError as exc:  # keep going: the snapshot should show everything that is wrong
            code = code or exit_code_for(exc)
    snapshot = engine.capabilities()
    snapshot["profile"] = settings.profile
    snapshot["exit_code"] = {"code": int(code), "name": code.name}
    if args.watch > 0:
        snapshot["signature"] = watch(args.watch, settings)
        if snapshot["signature"].get("error"):
            code = code or ExitCode.GPU_UNAVAILABLE
    engine.close()
    if args.json:
        print(json.dumps(snapshot, indent=2, default=str))
    else:
        print(render(snapshot))
    return int(code)


def watch(seconds: float, settings: Settings) -> dict[str, Any]:
    """Sample NVML every 0.2 s for ``seconds`` and classify the signature (no requests run during doctor)."""
    try:
        from engines.telemetry import NvmlTelemetry

        source = NvmlTelemetry()
    except Exception as exc:  # pynvml raises its own NVMLError family; any failure means no signature
        return {"error": f"NVML unavailable: {exc}"}
    samples = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        samples.append(source.sample(settings.runtime.device_id))
        time.sleep(0.2)
    source.close()
    result = classify(samples, requests_running=False, thresholds=settings.signature)
    return {"verdict": result.verdict, "reason": result.reason, "samples": len(samples),
            "sm_percent": result.sm_percent, "memory_percent": result.memory_percent, "power_w": result.power_w}


def render(snapshot: dict[str, Any]) -> str:
    lines = [f"sdserve doctor — profile {snapshot['profile']}, device {snapshot['device']}:{snapshot['device_id']}",
             f"accelerated: {str(snapshot['accelerated']).lower()}   verdict: {snapshot['verdict']['status']}   "
             f"exit code: {snapshot['exit_code']['code']} ({snapshot['exit_code']['name']})", ""]
    for check in snapshot["checks"]:
        mark = {"pass": "PASS", "fail": "FAIL", "skip": "skip"}[check["status"]]
        lines.append(f"  [{mark}] {check['name']}: {check['observed']}")
        if check["status"] == "fail":
            lines.append(f"         expected {check['expected']}; fix: {check['remediation']}")
    for name, session in snapshot["sessions"].items():
        used = ", ".join(session["providers_used"]) or "not created"
        lines.append(f"  session {name}: {used}")
        for event in session["ort_events"]:
            lines.append(f"         ORT {event['kind']}: {event['detail'] or event['line'][:120]}")
    if snapshot["verdict"]["reasons"]:
        lines += ["", "reasons:"] + [f"  - {r}" for r in snapshot["verdict"]["reasons"]]
    if "signature" in snapshot:
        lines += ["", f"signature: {snapshot['signature']}"]
    print_warning = not snapshot["accelerated"]
    if print_warning:
        lines += ["", "WARNING: NOT ACCELERATED — this configuration does not run on the GPU fast path."]
    sys.stdout.flush()
    return "\n".join(lines)
