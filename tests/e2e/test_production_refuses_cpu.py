"""On a machine without a usable GPU, the production profile (the default) refuses to serve and exits non-zero."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ServerProcess


@pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="needs a machine without an NVIDIA device")
def test_default_profile_exits_with_gpu_unavailable(tiny_model: Path) -> None:
    start = time.monotonic()
    server = ServerProcess("--model", str(tiny_model))
    code = server.proc.wait(timeout=30)
    server.stop()
    assert time.monotonic() - start < 30
    assert code == 20, server.log  # ExitCode.GPU_UNAVAILABLE
    assert "GPU_UNAVAILABLE" in server.log
