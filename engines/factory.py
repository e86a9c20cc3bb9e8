"""The one constructor server/ may call: an engine for a model folder under a runtime policy."""

from __future__ import annotations

from pathlib import Path

from engines.config import Matrix, RuntimeSettings, SelfTestPlan, SignatureThresholds
from engines.protocol import Engine, Faults


def create_engine(model: Path, runtime: RuntimeSettings, matrix: Matrix | None = None,
                  plan: SelfTestPlan | None = None, faults: Faults | None = None,
                  signature: SignatureThresholds | None = None, watch_ort_log: bool = False) -> Engine:
    """The ONNX Runtime engine (nothing loads until ``preflight`` and ``load`` are called)."""
    from engines.engine import OrtEngine

    return OrtEngine(model, runtime, matrix, plan, faults, signature, watch_ort_log)
