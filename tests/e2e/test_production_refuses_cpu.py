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
    # Each missing library, the provider library that needs it, and the package that ships it.
    assert "libcublasLt.so.13 (needed by libonnxruntime_providers_cuda.so; ships in pip nvidia-cublas" in server.log
    assert "libnvinfer.so.10 (needed by libonnxruntime_providers_tensorrt.so; ships in pip tensorrt-cu13-libs" \
        in server.log
    assert "libcudnn.so.9" in server.log and "nvidia-cudnn-cu13" in server.log
