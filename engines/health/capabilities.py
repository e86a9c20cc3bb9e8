"""The capability snapshot (GET /capabilities, `sdserve doctor --json`; schema:
engines/schemas/capabilities.schema.json): whether the fast path is really running, from what the engine proved
at preflight, load and self-test."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path

from engines.config import RuntimeSettings
from engines.health.preflight import Check, Observations
from engines.runtime.buffers import gpu_mem_limit
from engines.runtime.sessions import Runtime, SessionReport, provider_options
from engines.types.snapshot import (
    Artifacts,
    Attention,
    Capabilities,
    IoInfo,
    PlacementSummary,
    Policy,
    SelfTestReport,
    Verdict,
)

GPU_MEM_LIMIT_SCOPE = (
    "with the shared arena registered (shared_device_arena.registered), every session's device allocations, the "
    "IO-binding buffers and merged LoRA weights come from one CUDA arena capped at gpu_mem_limit_bytes; without it "
    "the cap covers only sessions whose first provider is CUDA, and the binding's own CUDA arena has none. "
    "TensorRT engine memory sits outside every ORT arena in both cases.")
"""What gpu_mem_limit does and does not cover, stated in the capability snapshot instead of a budget claim."""


@dataclass(frozen=True)
class Proven:
    """What an engine knows of itself when the snapshot is taken (each part empty before its stage ran)."""

    settings: RuntimeSettings
    model_dir: Path
    runtime: Runtime | None
    loaded: bool
    """Pipelines were built."""
    checks: list[Check]
    observations: Observations | None
    errors: list[str]
    """Why a stage failed (load, self-test, an on-node engine build), in order."""
    device_total: int | None
    artifacts: Artifacts = field(default_factory=Artifacts)
    self_test: SelfTestReport | None = None
    family: dict[str, str | int | float | bool] = field(default_factory=dict)
    lora: dict[str, object] = field(default_factory=dict)


def accelerated(p: Proven) -> bool:
    """Every check passed, and every session runs on its requested accelerator providers with a clean placement."""
    if not p.settings.accelerators or not p.loaded or p.runtime is None:
        return False
    reports = p.runtime.reports.values()
    return (all(c.status != "fail" for c in p.checks) and bool(p.checks)
            and all(r.providers_used[:1] and r.providers_used[0] != "CPUExecutionProvider"
                    and set(r.providers_requested) <= set(r.providers_used) for r in reports)
            and all(r.placement is None or r.placement.ok for r in reports))


def snapshot(p: Proven) -> Capabilities:
    """The capability snapshot of ``p``, taken now."""
    fast = accelerated(p)
    reports = p.runtime.reports if p.runtime else {}
    failed = [c for c in p.checks if c.status == "fail"]
    reasons = [f"{c.name}: found {c.observed}, expected {c.expected}" for c in failed] + p.errors
    if p.settings.allow_cpu:
        reasons.insert(0, "CPU allowed by the profile (dev): not accelerated")
    status = "pass" if fast else ("cpu-dev" if p.settings.allow_cpu and not failed and not p.errors else "fail")
    s = p.settings
    return Capabilities(
        generated_at=datetime.datetime.now(datetime.UTC).isoformat(), accelerated=fast,
        verdict=Verdict(status=status, reasons=tuple(reasons)), device=s.device, device_id=s.device_id,
        model=str(p.model_dir),
        policy=Policy(providers=s.providers, plugin=s.plugin.model_dump() if s.plugin else None,
                      allow_cpu=s.allow_cpu, enable_fallback=s.allow_cpu,
                      disable_cpu_ep_fallback=s.disable_cpu_ep_fallback, placement_audit=s.placement_audit,
                      cpu_allowlist=s.cpu_allowlist),
        provider_options=({s.plugin.name: dict(s.plugin.options)} if s.plugin else
                          dict(provider_options(s, p.model_dir, p.device_total))),
        checks=tuple(c.to_model() for c in p.checks),
        observations=p.observations.to_model() if p.observations else None,
        sessions={name: r.to_model() for name, r in reports.items()},
        placement_summary={name: PlacementSummary(nodes_by_provider=r.placement.nodes_by_provider,
                                                  compute_on_cpu=r.placement.compute_on_cpu, ok=r.placement.ok)
                           for name, r in reports.items() if r.placement is not None},
        io=IoInfo(binding="iobinding", device=s.device, host_staging=p.runtime.host.kind if p.runtime else "none",
                  buffers_reused_per_shape=True),
        arena=arena_summary(s, p.runtime, p.device_total),
        artifacts=p.artifacts, attention=attention(reports),
        self_test=p.self_test, family=p.family, lora=p.lora, image=image_labels())


def arena_summary(s: RuntimeSettings, runtime: Runtime | None,
                  device_total: int | None) -> dict[str, str | bool | float | int]:
    """The CUDA arena settings, the memory cap and whether the shared arena enforces it."""
    shared = runtime.arena if runtime else {}
    limit = gpu_mem_limit(s, device_total) or 0
    return {**s.cuda.model_dump(), "gpu_mem_limit_bytes": limit,
            "shared_device_arena": bool(shared.get("registered")),
            "shared_device_arena_error": str(shared.get("error", "")),
            "device_memory_budget_enforced": bool(shared.get("registered")) and limit > 0,
            "gpu_mem_limit_scope": GPU_MEM_LIMIT_SCOPE}


def image_labels() -> dict[str, str]:
    """``SDSERVE_IMAGE_VARIANT=notrt`` -> ``{"variant": "notrt"}``: what the image says about itself (Dockerfile)."""
    prefix = "SDSERVE_IMAGE_"
    return {k.removeprefix(prefix).lower(): v for k, v in sorted(os.environ.items()) if k.startswith(prefix)}


def attention(reports: dict[str, SessionReport]) -> Attention:
    """Whether attention is fused (fused attention ops present) and where those ops run."""
    fused = {name: r.placement.attention for name, r in reports.items()
             if r.placement is not None and r.placement.attention}
    on_gpu = bool(fused) and all(p != "CPUExecutionProvider" for f in fused.values() for p in f)
    return Attention(fused=bool(fused), on_gpu=on_gpu, by_session=fused)
