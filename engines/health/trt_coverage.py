"""Profile drift: do the prebuilt TensorRT engines take every call the running configuration can form?

`sdserve engines build` sizes each engine's optimization profile from the configuration it ran with (images per
call: ``max(queue.max_batch, limits.max_n, serving.batch_sizes)``; one engine per ``serving.sizes`` entry) and
records, per size and component, the exact ``trt_profile_{min,opt,max}_shapes`` TensorRT got and the rows they
allow (``engine_profiles`` in ``trt/manifest.json``, written by engines/build/trt_build.py). An input outside the
built range fails at run time rather than rebuilding when explicit profiles are given (onnxruntime PR #18217;
tensorrt_execution_provider.cc), so a configuration raised after the build would fail the first joined tick over
the profile, for every row in it. Boot compares the record with the configuration instead, here, as a pure function
of the manifest and the demand (engines/artifact_checks.py calls it before anything loads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.config import SelfTestPlan

BOUNDS = ("min", "opt", "max")
RECORD = "engine_profiles"
"""The per-size manifest key of the recorded profiles: ``{component: {"min"|"opt"|"max": {input: [dims]},
"rows": {"min": int, "max": int, "per_image": int}}}``."""


@dataclass(frozen=True)
class Demand:
    """What the running configuration asks of the engines."""

    images: int
    """Images one denoiser call can hold: ``max(queue.max_batch, limits.max_n, serving.batch_sizes)``."""
    sizes: tuple[str, ...]
    """Served sizes (``"512x512"``); empty: the model's native size, i.e. every built size is served."""
    profile: str
    """The profile name, for the rebuild command."""

    @classmethod
    def from_plan(cls, plan: SelfTestPlan) -> Demand:
        """The demand the self-test plan carries (server/bootstrap.py builds it from the settings)."""
        batches = [*plan.batch_sizes, *(s.batch for s in plan.shapes)]
        return cls(max(plan.max_images, *batches), tuple(sorted({s.size for s in plan.shapes})),
                   plan.profile or "production")


def parse_shapes(text: str) -> dict[str, list[int]]:
    """``"sample:2x4x8x8,timestep:2"`` (the provider option's syntax) -> ``{"sample": [2, 4, 8, 8], ...}``; a
    rank-0 input (``"t:"``) has no dims. ValueError on anything else."""
    out: dict[str, list[int]] = {}
    for item in filter(None, text.split(",")):
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise ValueError(f"profile shape {item!r} is not name:dims")
        out[name] = [int(d) for d in dims.split("x")] if dims else []
    return out


def record(options: dict[str, str], rows: dict[str, int]) -> dict[str, Any]:
    """One component's profile record from its provider options (what TensorRT got) and its rows (trtplan)."""
    return {**{b: parse_shapes(options[f"trt_profile_{b}_shapes"]) for b in BOUNDS}, "rows": dict(rows)}


def _rows(rec: Any) -> tuple[int, int] | None:
    """(rows per image, max rows) of a well-formed record, else None."""
    rows = rec.get("rows") if isinstance(rec, dict) else None
    if not isinstance(rows, dict) or not all(isinstance(rec.get(b), dict) for b in BOUNDS):
        return None
    per_image, top = _count(rows.get("per_image")), _count(rows.get("max"))
    return (per_image, top) if per_image and top else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _max_shapes(rec: Any) -> str:
    return ",".join(f"{name}:" + "x".join(map(str, dims)) for name, dims in rec["max"].items())


def problems(manifest: dict[str, Any], demand: Demand) -> list[str]:
    """Every way the engines of ``manifest`` (``trt/manifest.json``) fail to cover ``demand``: a served size
    without an engine; per component, a call of ``demand.images`` images needing more rows than the profile's
    max (``rows.per_image`` rows per image: 2 where classifier-free guidance doubles the batch); a component
    without a well-formed record (artifacts built before sdserve recorded profiles). Empty: covered."""
    built: dict[str, Any] = manifest.get("sizes") or {}
    found = [f"{size}: no engine for this served size (built: {', '.join(sorted(built)) or 'none'})"
             for size in demand.sizes if size not in built]
    for size in demand.sizes or tuple(sorted(built)):
        entry = built.get(size)
        if not isinstance(entry, dict):
            continue
        records = entry.get(RECORD) or {}
        for component in sorted(entry.get("context_models") or {}):
            rec = records.get(component)
            counted = _rows(rec)
            if counted is None:
                found.append(f"{component} at {size}: no recorded optimization profile (built before sdserve "
                             "recorded them), so nothing proves it takes the configured rows")
                continue
            per_image, top = counted
            need = demand.images * per_image
            if need > top:
                found.append(f"{component} at {size}: {demand.images} images per call need {need} rows, the "
                             f"engine's profile takes at most {top} ({top // per_image} images, max shapes "
                             f"{_max_shapes(rec)})")
    return found


def refusal(manifest: dict[str, Any], demand: Demand, model: str) -> str | None:
    """The ArtifactError message when the engines do not cover ``demand``, naming each problem, the configured
    value and the rebuild command; None when they do."""
    found = problems(manifest, demand)
    if not found:
        return None
    served = ", ".join(demand.sizes) or "every built size (the model's native size)"
    return (f"the prebuilt TensorRT engines do not cover this configuration (images per call = max(queue.max_batch, "
            f"limits.max_n, serving.batch_sizes) = {demand.images}; sizes: {served}); an input outside a built "
            f"profile fails at run time: " + "; ".join(found) + f". Rebuild them with `sdserve engines build "
            f"--model {model} --profile {demand.profile}` (this configuration), or lower the configuration to "
            "what was built")
