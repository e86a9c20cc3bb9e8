"""`sdserve engines build`: TensorRT engines for the served shape profiles, on a GPU node with the deployed
versions, dumped as EP-context models next to the model, with a manifest bound to the node (engines/artifacts.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort

from engines.artifacts import TRT_DIR, node_identity, read_manifest, sha256_file, write_engine_manifest
from engines.errors import ArtifactError, GpuUnavailableError
from engines.runtime.ortlog import capture_ort_output

log = logging.getLogger(__name__)


def require_int8_gate(model_dir: Path) -> dict[str, Any]:
    """INT8 only for a model whose quantized weights passed the accuracy gate (`sdserve engines quantize`)."""
    gate = read_manifest(model_dir / "manifest.json").get("int8_gate")
    if not gate or not gate.get("passed"):
        raise ArtifactError(f"INT8 refused: {model_dir} has no passed accuracy gate; run `sdserve engines quantize` "
                            "and build from its output")
    return dict(gate)


def build(model_dir: Path, plan: dict[str, Any], observations: dict[str, Any], device_id: int) -> Path:
    """Create one TensorRT session per component (the provider builds and dumps the engines), then write the
    manifest. Raises GpuUnavailableError when the TensorRT provider cannot run here."""
    if "TensorrtExecutionProvider" not in ort.get_available_providers():
        raise GpuUnavailableError("this onnxruntime has no TensorRT provider compiled in")
    trt = model_dir / TRT_DIR
    (trt / "engines").mkdir(parents=True, exist_ok=True)
    (trt / "timing").mkdir(parents=True, exist_ok=True)
    for component, spec in plan["components"].items():
        start = time.monotonic()
        log.info("building TensorRT engines for %s (%d profile(s)); this takes minutes", component,
                 len(plan["profiles"]))
        with capture_ort_output(component) as captured:
            try:
                ort.InferenceSession(spec["source"], providers=["TensorrtExecutionProvider"],
                                     provider_options=[spec["provider_options"]], enable_fallback=0)
            except Exception as exc:  # ORT raises plain exceptions; the captured lines say why
                raise GpuUnavailableError(f"{component}: TensorRT build failed: {str(exc).strip()}") from exc
        for event in captured.events:
            log.info("%s: %s", component, event.line[:200])
        log.info("%s done in %.0fs", component, time.monotonic() - start)
    model = {c: sha256_file(Path(spec["source"])) for c, spec in plan["components"].items()}
    return write_engine_manifest(trt, node_identity(observations, device_id), plan["profiles"], plan["build_flags"],
                                 model)
