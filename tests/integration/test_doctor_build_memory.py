"""`sdserve doctor` (a real CLI process) prints the TensorRT build estimate of a DiT folder
(engines/health/build_memory.py) for the tiny exported Qwen-Image: each engine at the precision TensorRT builds (an
fp32 export is lowered to the registry's bf16, engines/health/dit_precision.py), its bytes from the ONNX headers
(engines/health/onnx_scan.py), the host peak of the largest component's build and the disk per served size."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engines.health.memory_plan import ONNX_ITEMSIZE, OVERHEAD
from engines.health.onnx_scan import scan_onnx

ROOT = Path(__file__).resolve().parents[2]
FLOATS = (1, 10, 16)
"""TensorProto float types (fp32, fp16, bf16): the weights the engine holds at its precision."""
pytestmark = pytest.mark.slow


def _doctor(model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--model", str(model), *extra],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_doctor_prints_the_build_estimate_of_a_tiny_qwen(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    folder = dit_build("qwen-image")[0]
    done = _doctor(folder, "--json")
    report = json.loads(done.stdout)
    found = report["build_estimate"]
    host = {}
    for component in found["engines"]:
        path = folder / component / "model.onnx"
        scan = scan_onnx(path)
        floats = sum(n for t, n in scan.elements.items() if t in FLOATS)
        other = sum(n * ONNX_ITEMSIZE[t] for t, n in scan.elements.items() if t not in FLOATS)
        engine = 2 * floats + other  # an fp32 export, lowered by the builder to Qwen-Image's bf16
        assert found["precision"][component] == "bf16" and found["engines"][component] == engine, component
        file_bytes = path.stat().st_size + sum((path.parent / f).stat().st_size for f in scan.external)
        host[component] = file_bytes + 2 * engine + OVERHEAD
    assert found["largest"] == max(host, key=lambda c: host[c]) and found["host_peak"] == max(host.values())
    assert found["disk_total"] == found["sizes"] * found["disk_per_size"] == \
        found["sizes"] * sum(found["engines"].values())
    text = _doctor(folder).stdout
    assert f"TensorRT build estimate — {folder.name}, {found['sizes']} served size(s)" in text
    assert "host RAM peak while building" in text and "disk:" in text
