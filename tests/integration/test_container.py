"""The image recipe, proven without a Docker engine: hadolint, versions from the matrix, what the runtime stage
contains, and the runtime dependency set installed into a fresh virtualenv against its size budget."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
RUNTIME_BUDGET_MB = 700  # sdserve + onnxruntime-gpu + numpy/pillow/tokenizers/fastapi..., no torch, no CUDA wheels


def test_hadolint_is_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_versions_come_from_the_matrix() -> None:
    matrix = tomllib.loads((ROOT / "configs" / "matrix.toml").read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.MULTILINE))
    assert args["ORT_VERSION"] == matrix["onnxruntime"]["version"]
    assert args["CUDA_MAJOR"] == matrix["onnxruntime"]["cuda"].split(".")[0]
    assert args["CUDNN_MAJOR"] == matrix["cudnn"]["major"]
    assert args["TENSORRT_VERSION"] == matrix["tensorrt"]["version"]


def test_runtime_stage_is_lean_and_hardened() -> None:
    runtime = DOCKERFILE.split("AS runtime", 1)[1]
    assert "[build]" not in runtime and "torch" not in runtime.lower()
    assert not re.search(r"apt-get|gcc|build-essential|tests/", runtime)
    assert re.search(r"^USER 10001", runtime, re.MULTILINE)
    assert "HEALTHCHECK" in runtime and "/health" in runtime
    assert 'ENTRYPOINT ["sdserve", "serve"]' in runtime
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[1] == "*" and "!tests/" not in ignore and "!models/" not in ignore


def test_runtime_install_fits_the_budget_has_no_torch_and_pip_check_is_clean(tmp_path: Path) -> None:
    venv = tmp_path / "rt"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    install = subprocess.run([*pip, "install", "-q", "--no-cache-dir", str(ROOT)], capture_output=True, text=True,
                             timeout=600)
    assert install.returncode == 0, install.stderr[-2000:]
    check = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    names = subprocess.run([*pip, "list", "--format=freeze"], capture_output=True, text=True).stdout.lower()
    assert not re.search(r"^(torch|diffusers|transformers)==", names, re.MULTILINE)
    size_mb = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file()) / 1e6
    assert size_mb <= RUNTIME_BUDGET_MB, f"runtime venv {size_mb:.0f} MB over the {RUNTIME_BUDGET_MB} MB budget"
