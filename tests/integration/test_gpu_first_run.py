"""The first device run (benchmarks/gpu/first_run.py) executed here, where there is no GPU: the script a lent
GPU will run is the one the suite runs, so a broken import, path or option is found now, not in the device's
15 minutes. Step 1 must show every option set of the build plan accepted by ORT's real parser; the GPU steps
must fail for the GPU's absence, saying so, and never pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "first_run.py"


@pytest.mark.slow
def test_the_first_device_run_executes_here_and_fails_only_for_the_gpu(tmp_path: Path) -> None:
    work = tmp_path / "gpu"
    prepared = subprocess.run([sys.executable, str(SCRIPT), "--prepare", str(work)], capture_output=True,
                              text=True, timeout=600)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    assert {"tiny", "tiny-external", "loras", "plan.json"} <= {p.name for p in work.iterdir()}
    assert (work / "tiny-external" / "unet" / "model.onnx_data").is_file()
    done = subprocess.run([sys.executable, str(SCRIPT), "--work", str(work), "--rehearse"], capture_output=True,
                          text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("STEP ")]
    assert [ln.split(":")[0] for ln in lines] == ["STEP 1 options", "STEP 2 build-and-boot",
                                                  "STEP 3 lora-external-data", "STEP 4 signature"], done.stdout
    assert "sets accepted by the parser, TensorRT loaded for 0" in lines[0] and "refused" not in lines[0]
    assert "engines build exit 20" in lines[1]
    assert "GpuUnavailableError" in lines[2]
    assert "NVML gave no sample" in lines[3]
    assert done.returncode == 1
