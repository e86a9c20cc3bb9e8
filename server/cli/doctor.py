"""`sdserve doctor`: preflight, session build and placement audit without serving; same exit codes as serve. It
also prints the model folder's memory plan (device and host, with and without LoRA, against the device's memory
and the pod limit of the shipped Deployment), which needs only the folder's config files: a folder that cannot
boot still gets its plan."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from engines.config import Matrix, parse_size
from engines.errors import SdserveError
from engines.factory import memory_plan
from engines.protocol import Engine
from engines.types.snapshot import Capabilities
from server.cli.common import add_boot_args, boot_config
from server.exitcodes import ExitCode, exit_code_for
from server.settings import Settings

GIB = 1 << 30
QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
            "T": 10**12}
"""Kubernetes memory quantity suffixes."""


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="preflight + session build + placement audit + memory plan, without serving")
    add_boot_args(p)
    p.add_argument("--json", action="store_true",
                   help="print the capability snapshot as JSON (the memory plan under memory_plan)")
    p.add_argument("--watch", type=float, default=0.0, metavar="N",
                   help="sample NVML for N seconds and classify the GPU signature")
    p.add_argument("--plan-size", type=parse_size, default=None, metavar="WxH",
                   help="memory plan: the image size activations are sized for (default: the profile's largest "
                        "served size, else its largest allowed width x height)")
    p.add_argument("--plan-images", type=int, default=None, metavar="N",
                   help="memory plan: images per batch (default: [queue] max_batch, or the largest [serving] "
                        "batch size if larger)")
    p.add_argument("--plan-dtype", choices=("fp32", "fp16", "bf16"), default=None,
                   help="memory plan: every component's device dtype (default: the TensorRT engines' precisions "
                        "under a TensorRT policy, else the ONNX files' dtype)")
    p.add_argument("--device-memory-gib", type=float, default=None, metavar="G",
                   help="memory plan: the device's memory in GiB (default: NVML's reading, when there is one)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    boot = boot_config(args)
    return doctor(args, boot.settings, boot.engine(), pod_memory(boot.settings, boot.matrix))


def doctor(args: argparse.Namespace, settings: Settings, engine: Engine,
           pod: tuple[int, str] | None = None) -> int:
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
    plan = plan_memory(args, settings, caps, pod)
    build = build_estimate(args, settings)
    extra: dict[str, Any] = {"profile": settings.profile, "exit_code": {"code": int(code), "name": code.name},
                             "memory_plan": plan, **({"build_estimate": build.__dict__} if build else {})}
    if signature is not None:
        extra["signature"] = signature
    if args.json:
        print(json.dumps({**caps.model_dump(mode="json"), **extra}, indent=2))
    else:
        print(render(caps, settings.profile, code, signature))
        print("\n" + "\n".join(render_plan(plan)))
        if build is not None:
            print("\n" + "\n".join(build.lines()))
    return int(code)


def build_estimate(args: argparse.Namespace, settings: Settings) -> Any:
    """A DiT folder's TensorRT build estimate for the profile's served sizes (engines/health/build_memory.py), or
    None (a UNet folder, or one the plan cannot read: the memory plan says why)."""
    from engines.factory import dit_build_estimate

    try:
        return dit_build_estimate(args.model, max(1, len(settings.serving.sizes)))
    except SdserveError:
        return None


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


# ---- the memory plan --------------------------------------------------------------------------------------------

def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (``32Gi``, ``4G``, ``512Mi``, ``1000``) in bytes; ValueError otherwise."""
    for suffix in sorted(QUANTITY, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * QUANTITY[suffix])
    return int(text)


def pod_memory(settings: Settings, matrix: Matrix) -> tuple[int, str] | None:
    """The memory limit of the pod `sdserve deploy render` ships for this profile (production: the GPU Rollout's
    pod template, deploy/k8s/rollout.yaml; other profiles: the dev overlay, deploy/k8s/dev/deployment.yaml)."""
    from server.cli.deploy import deployment, dev_overlay

    rendered = deployment(settings, matrix, "sdserve", "blue", 600, 1)
    production = settings.profile == "production"
    if not production:
        rendered = dev_overlay(rendered, settings)
    limit = rendered["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {}).get("memory")
    if limit is None:
        return None
    where = "deploy/k8s/rollout.yaml" if production else "deploy/k8s/dev/deployment.yaml"
    return quantity_bytes(str(limit)), f"pod limit {limit} ({where})"


def _device_memory(args: argparse.Namespace, caps: Capabilities) -> tuple[int | None, str]:
    if args.device_memory_gib is not None:
        return int(args.device_memory_gib * GIB), "--device-memory-gib"
    devices = caps.observations.nvml.devices if caps.observations is not None else ()
    found = next((d for d in devices if d.index == caps.device_id), devices[0] if devices else None)
    if found is None:
        return None, ""
    return found.memory_total_bytes, f"NVML device {found.index} ({found.name})"


def plan_memory(args: argparse.Namespace, settings: Settings, caps: Capabilities,
                pod: tuple[int, str] | None) -> dict[str, Any]:
    """The memory plan for this profile's largest batch, or ``{"error": why}`` when the folder is no family this
    server serves (the plan reads its files only; it never needs the model to load)."""
    sizes = [parse_size(s) for s in settings.serving.sizes]
    width, height = args.plan_size or max(sizes, key=lambda s: s[0] * s[1], default=(
        settings.limits.max_width, settings.limits.max_height))
    images = args.plan_images or max(settings.queue.max_batch, *settings.serving.batch_sizes)
    device, device_source = _device_memory(args, caps)
    try:
        return memory_plan(args.model, settings.runtime, width, height, images, max(1, len(sizes)),
                           args.plan_dtype, device, device_source, *(pod or (None, "")))
    except SdserveError as exc:
        return {"error": str(exc)}


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _against(verdict: dict[str, Any] | None, source: str) -> str:
    if verdict is None:
        return "(no budget known)"
    fits = "fits" if verdict["fits"] else "DOES NOT FIT"
    return f"{fits} in {_gib(verdict['have'])} ({source}), margin {_gib(verdict['margin'])}"


def _component_line(c: dict[str, Any]) -> str:
    variant = f"{_gib(c['variant_bytes'])} ({c['stored_dtype']})" if c["adaptable"] else "-"
    return (f"  {c['name']:<15} {c['source']:<7} {c['params'] / 1e9:>7.3f} B {c['dtype']:<5} "
            f"{_gib(c['weights']):>11} {_gib(c['activations']):>11}   {variant}")


def render_plan(plan: dict[str, Any]) -> list[str]:
    """The plan as doctor prints it: one line per component, the device and host totals against their budgets."""
    if "error" in plan:
        return [f"memory plan: unavailable: {plan['error']}"]
    s, d, h = plan["served"], plan["device"], plan["host"]
    policy = f"TensorRT, {s['engines_per_component']} engine(s) per component" if s["policy"] == "tensorrt" \
        else "ONNX files' dtype"
    denoiser = next((c["name"] for c in plan["components"] if c["name"] in ("unet", "transformer")), "denoiser")
    device_src, pod_src = d["budget"]["source"], h["limit"]["source"]
    lines = [f"memory plan — {plan['model']} ({plan['family']}), {s['width']}x{s['height']}, {s['images']} "
             f"image(s) per batch ({s['rows']} rows), {policy}",
             f"  {'component':<15} {'source':<7} {'params':>9} {'dtype':<5} {'weights':>11} {'activations':>11}"
             "   LoRA variant",
             *(_component_line(c) for c in plan["components"]),
             f"  device without LoRA: {_gib(d['base'])} (weights {_gib(d['weights'])}, activations "
             f"{_gib(d['activations'])}, overhead {_gib(d['overhead'])})  "
             f"{_against(d['verdicts']['base'], device_src)}",
             f"  device with LoRA on the {denoiser}: {_gib(d['lora_denoiser'])}  "
             f"{_against(d['verdicts']['lora_denoiser'], device_src)}",
             f"  device with LoRA on every adaptable component: {_gib(d['lora_all'])}  "
             f"{_against(d['verdicts']['lora_all'], device_src)}",
             f"  host peak at load: {_gib(h['peak_load'])}  {_against(h['verdicts']['peak_load'], pod_src)}",
             f"  host peak at load with LoRA: {_gib(h['peak_load_lora'])}  "
             f"{_against(h['verdicts']['peak_load_lora'], pod_src)}",
             f"  host steady: {_gib(h['steady'])}, with LoRA {_gib(h['steady_lora'])}; external weights memory-mapped "
             f"(page cache, reclaimable): {_gib(h['page_cache'])}, with LoRA {_gib(h['page_cache_lora'])}",
             f"  LoRA cache: a set touching every adaptable weight of the {denoiser} needs {_gib(d['largest_set'])}; "
             f"[runtime.lora] cache_mb gives {_gib(d['lora_cache'])}"
             + ("" if d["largest_set_fits_cache"] else
                f": such a set is refused; with cache_mb >= {-(-d['largest_set'] // (1 << 20))} the device needs "
                f"{_gib(d['lora_denoiser_set_cached'])}  "
                f"{_against(d['verdicts']['lora_denoiser_set_cached'], device_src)}")]
    lines += [f"  {line}" for line in plan.get("advice", [])]  # what would fit, when the device is too small
    cn = plan.get("controlnet") or {}
    if cn.get("dir"):  # [runtime.controlnet] dir: the nets' weights are component lines above, their residuals here
        lines.append(f"  ControlNet ({cn['dir']}): " + (
            f"{', '.join(cn['nets'])}; residuals {_gib(cn['residual_bytes'])} in the device total "
            f"({cn['residual_sets']} sets alive at once)" if cn.get("served") else "not served")
            + (f"; {cn['note']}" if cn.get("note") else ""))
    if plan["missing"]:
        lines.append(f"  missing (no model.onnx, no config.json; counted as 0): {', '.join(plan['missing'])}")
    fbc = plan.get("first_block", {})
    if fbc.get("loaded"):
        lines.append(f"  first-block cache parts loaded beside the transformer: {_gib(fbc['weights'])} of weights "
                     "on the device, counted above (the transformer's weights a second time)")
    elif fbc.get("present"):
        lines.append(f"  first-block cache parts present, NOT loaded (not counted): {fbc['note']}")
    return lines
