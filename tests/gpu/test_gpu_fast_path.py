"""On a machine with an NVIDIA GPU and the CUDA provider's libraries: the strict CUDA policy passes for real.
Skipped elsewhere (CI has no GPU); the CPU-side behaviour is covered in tests/integration/test_fail_closed.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.config import RuntimeSettings
from engines.engine import OrtEngine
from engines.protocol import Batch, ImageSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not Path("/dev/nvidia0").exists(), reason="needs an NVIDIA GPU")]


def test_cuda_policy_passes_preflight_audit_and_generates(tiny_model: Path) -> None:
    settings = RuntimeSettings(providers=("CUDAExecutionProvider",))
    engine = OrtEngine(tiny_model, settings)
    engine.preflight()
    engine.load()
    result = engine.generate(Batch((ImageSpec("a lighthouse", seed=1),), 64, 64, 4))
    snapshot = engine.capabilities()
    engine.close()
    assert result.provider == "CUDAExecutionProvider"
    assert snapshot["accelerated"] is True, snapshot["verdict"]
    assert snapshot["io"]["host_staging"] == "pinned"
