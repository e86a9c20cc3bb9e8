"""A DiT component's TensorRT engine precision, from its export (the rule engines/build/trtplan_dit.py's docstring
states): read by the TensorRT plan (engines/build/trtplan_dit.py) and the memory plan (engines/health/memory_plan.py),
so both charge and build the same. Here, below the build room, so the memory plan needs nothing above it."""

from __future__ import annotations

from pathlib import Path

from engines import architectures
from engines.pipelines.flow_family import DitFamily

__all__ = ["HALF_KEEPS_SHARE", "ONNX_FLOAT_TYPES", "export_precision", "precision"]

HALF_KEEPS_SHARE = 0.01
"""An fp16 graph with at least this share of its float weight elements in fp32 keeps them for their range (T5's
``wo``: about a fifth of T5-XXL; a stray fp32 constant is far below): built in bf16, not fp16."""
ONNX_FLOAT_TYPES = {1: "fp32", 10: "fp16", 16: "bf16"}
"""TensorProto.DataType values of the float weights an export writes."""


def export_precision(path: Path) -> str | None:
    """The engine precision of one exported component (engines/build/trtplan_dit.py's rule), or None when its
    initializers hold no float weights."""
    from engines.health.onnx_scan import scan_onnx

    floats = {ONNX_FLOAT_TYPES[t]: n for t, n in scan_onnx(path).elements.items() if t in ONNX_FLOAT_TYPES}
    if not floats:
        return None
    dominant = max(floats, key=lambda t: floats[t])
    if dominant == "fp16" and floats.get("fp32", 0) >= HALF_KEEPS_SHARE * sum(floats.values()):
        return "bf16"
    return dominant


def precision(family: DitFamily, component: str, folder: Path | None = None) -> str:
    """The engine precision of ``component``: its export's in ``folder`` when exported in half precision, else
    the registry's."""
    path = folder / component / "model.onnx" if folder is not None else None
    found = export_precision(path) if path is not None and path.is_file() else None
    if found == "fp32":  # the builder lowers an fp32 graph to the registry's precision (trtplan_dit's docstring)
        found = None
    return found or architectures.get(family.base).engine_precision(component)
