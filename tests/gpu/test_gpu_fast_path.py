"""On a machine with an NVIDIA GPU and the CUDA provider's libraries: the strict CUDA policy passes for real.
Skipped elsewhere (CI has no GPU); the CPU-side behaviour is covered in tests/integration/test_fail_closed.py and
tests/integration/test_gpu_policy.py.

The CUDA provider keeps shape arithmetic on the CPU on purpose (GetCpuPreferredNodes,
onnxruntime/core/framework/fallback_cpu_capability.cc): the audit must allow and count it, and find no node on an
activation's path there."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.config import RuntimeSettings
from engines.engine import OrtEngine
from engines.types.request import Batch, ImageSpec

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
    assert snapshot.accelerated is True, snapshot.verdict
    assert snapshot.io.host_staging == "pinned"
    for name, session in snapshot.sessions.items():
        assert session.providers_used[0] == "CUDAExecutionProvider", name
        assert session.placement is not None and session.placement.ok, (name, session.placement)
        assert session.placement.activation_on_cpu == () and session.placement.unmatched == ()
    shape_path = sum(sum(s.placement.shape_path.values()) for s in snapshot.sessions.values() if s.placement)
    assert shape_path > 0  # the shape ops CUDA leaves on the CPU were found and allowed
    limit = int(snapshot.provider_options["CUDAExecutionProvider"]["gpu_mem_limit"])
    assert snapshot.arena["gpu_mem_limit_bytes"] == limit > 0
