"""The image recipe without building it (the built image: tests/container, `make test-container`): hadolint,
versions from the matrix through the lock, layer order, hardening, the healthcheck's readiness semantics, the dev
overlay, and `sdserve gate` over two image records. Plus the runtime dependency set against its size budget."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement

from engines.config import load_matrix
from server.cli import imagelock

ROOT = Path(__file__).parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
LOCKS = ROOT / "deploy" / "image"
RUNTIME_BUDGET_MB = 700  # sdserve + onnxruntime-gpu + numpy/pillow/tokenizers/fastapi..., no torch, no CUDA wheels


def test_hadolint_is_clean() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run([str(hadolint), str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_base_image_script_is_shellcheck_clean_and_the_image_helpers_ruff_clean() -> None:
    bin_dir = Path(sys.executable).parent
    done = subprocess.run([str(bin_dir / "shellcheck"), str(LOCKS / "base-image.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(bin_dir / "ruff"), "check", str(LOCKS)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_versions_come_from_the_matrix() -> None:
    matrix = tomllib.loads((ROOT / "configs" / "matrix.toml").read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.MULTILINE))
    assert args["ORT_VERSION"] == matrix["onnxruntime"]["version"]
    assert args["CUDA_MAJOR"] == matrix["onnxruntime"]["cuda"].split(".")[0]
    assert args["CUDNN_MAJOR"] == matrix["cudnn"]["major"]
    assert args["TENSORRT_VERSION"] == matrix["tensorrt"]["version"]


def test_the_lock_is_current_with_the_matrix_and_pyproject() -> None:
    """The lock's recorded inputs are what `sdserve deploy lock` would resolve now; every input is satisfied by
    exactly one hashed pin; the GPU stack sits on the matrix's versions."""
    matrix = load_matrix(ROOT / "configs" / "matrix.toml")
    text = (LOCKS / imagelock.RUNTIME_LOCK).read_text()
    inputs = imagelock.serving_requirements(ROOT / "pyproject.toml", matrix)
    assert imagelock.recorded_inputs(text) == inputs, "inputs changed: run `make lock` and commit the lock"
    pins = imagelock.pins_of(text)
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", text)) == len(pins) > 20
    for line in inputs:
        req = Requirement(line)
        assert pins[imagelock.canonical(req.name)] in req.specifier, line
    assert pins["onnxruntime-gpu"] == matrix.onnxruntime.version
    assert pins["nvidia-cuda-runtime"].startswith(matrix.onnxruntime.cuda + ".")
    assert pins["nvidia-cudnn-cu13"].startswith(matrix.cudnn.major + ".")
    assert not {"torch", "diffusers", "transformers"} & set(pins)
    tools = (LOCKS / imagelock.TOOLS_LOCK).read_text()
    assert imagelock.recorded_inputs(tools) == list(imagelock.TOOLS)
    assert {"pip", "setuptools", "wheel"} <= set(imagelock.pins_of(tools))


def test_runtime_stage_installs_from_the_lock_deps_before_sources() -> None:
    stages = dict(re.findall(r"^FROM \S+ AS (\w+)\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.MULTILINE | re.DOTALL))
    assert list(stages) == ["tools", "deps", "app", "runtime"]
    assert "--require-hashes --no-deps --only-binary=:all: -r /tmp/lock/runtime.lock" in stages["deps"]
    assert "server/" not in stages["deps"] and "COPY server/" in stages["app"]
    runtime = stages["runtime"]
    copies = re.findall(r"^COPY (.*)$", runtime, re.MULTILINE)
    assert copies[0] == "--from=deps /opt/sdserve /opt/sdserve" and copies[-1].startswith("--from=app")
    assert not re.search(r"apt-get|gcc|build-essential|torch|pip install|LD_LIBRARY_PATH", runtime)
    assert re.search(r"^ARG BASE_IMAGE$", DOCKERFILE, re.MULTILINE), "the base has no floating default"
    assert re.search(r"^USER 10001:10001$", runtime, re.MULTILINE) and "--gid 10001" in runtime
    assert 'CMD ["python", "/opt/sdserve/healthcheck.py"]' in runtime and "ORT_DISABLE_TELEMETRY=1" in runtime
    assert 'SDSERVE_IMAGE_VARIANT="${VARIANT}"' in runtime and 'io.sdserve.variant="${VARIANT}"' in runtime
    assert 'ENTRYPOINT ["sdserve", "serve"]' in runtime
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[1] == "*" and "!tests/" not in ignore and "!models/" not in ignore


class _Ready(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, dict[str, Any]] = (200, {})

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, body = self.answer
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ready_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("status", "state", "code"), [(200, "ready", 0), (503, "loading", 1), (503, "failed", 1)])
def test_healthcheck_is_healthy_only_when_ready_on_the_configured_port(
        ready_server: http.server.HTTPServer, status: int, state: str, code: int) -> None:
    _Ready.answer = (status, {"state": state, "reasons": ["exit code 17"] if state == "failed" else []})
    port = str(ready_server.server_address[1])
    done = subprocess.run([sys.executable, str(LOCKS / "healthcheck.py")], capture_output=True, text=True,
                          env={"SDSERVE_PORT": port}, timeout=30)
    assert (done.returncode, f"state {state}") == (code, done.stdout.split(": ", 1)[1].split(";")[0])
    ready_server.shutdown()
    ready_server.server_close()  # nothing listens now
    closed = subprocess.run([sys.executable, str(LOCKS / "healthcheck.py")], capture_output=True, text=True,
                            env={"SDSERVE_PORT": port}, timeout=30)
    assert closed.returncode == 1 and "no answer" in closed.stdout


def test_dev_overlay_is_rendered_valid_and_differs_from_production_only_where_it_must(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "server.cli", "deploy", "render", "--out", str(tmp_path / "k8s"),
                           "--dashboard", str(tmp_path / "d.json")], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    committed = ROOT / "deploy" / "k8s" / "dev" / "deployment.yaml"
    assert (tmp_path / "k8s" / "dev" / "deployment.yaml").read_text() == committed.read_text(), "run make deploy"
    dev = yaml.safe_load(committed.read_text())
    kubernetes_validate.validate(dev, "1.33", strict=True)
    prod = yaml.safe_load((ROOT / "deploy" / "k8s" / "rollout.yaml").read_text())
    dpod, ppod = dev["spec"]["template"]["spec"], prod["spec"]["template"]["spec"]
    dc, pc = dpod["containers"][0], ppod["containers"][0]
    assert dc["securityContext"] == pc["securityContext"] and dpod["securityContext"] == ppod["securityContext"]
    assert dpod["volumes"] == ppod["volumes"] and dc["volumeMounts"] == pc["volumeMounts"]
    assert dc["args"][:2] == ["--profile", "dev"] and dc["image"].endswith("-notrt")
    assert "nvidia.com/gpu" not in json.dumps(dc["resources"]) and "runtimeClassName" not in dpod
    assert dc["readinessProbe"]["exec"]["command"] == ["python", "/opt/sdserve/healthcheck.py"]
    assert "/opt/sdserve/healthcheck.py" in DOCKERFILE


def _record(accelerated: bool, providers: list[str], version: str, variant: str) -> dict[str, Any]:
    return {"kind": "sdserve-image-record", "format": 1, "image": "sdserve:x", "id": "1" * 64,
            "digest": "sha256:" + "2" * 64, "labels": {"io.sdserve.variant": variant},
            "freeze": [f"onnxruntime-gpu=={version}", "numpy==2.4.6"], "files": {"sha256": version, "count": 1},
            "doctor": {"accelerated": accelerated, "exit_code": {"code": 0},
                       "sessions": {"unet": {"providers_used": providers}}}}


def test_gate_compares_two_image_records(tmp_path: Path) -> None:
    base = _record(True, ["TensorrtExecutionProvider"], "1.31.1", "trt")
    same, worse = tmp_path / "same.json", tmp_path / "worse.json"
    (tmp_path / "base.json").write_text(json.dumps(base))
    same.write_text(json.dumps(base))
    worse.write_text(json.dumps(_record(False, ["CPUExecutionProvider"], "1.31.2", "notrt")))

    def gate(candidate: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "server.cli", "gate", "--baseline", str(tmp_path / "base.json"),
                               "--candidate", str(candidate)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    ok, bad = gate(same), gate(worse)
    assert ok.returncode == 0 and "no regression" in ok.stdout, ok.stdout + ok.stderr
    assert bad.returncode != 0 and bad.stdout.count("REGRESSION") == 3, bad.stdout
    assert re.search(r"package onnxruntime-gpu\s+1\.31\.1\s+1\.31\.2\s+changed", bad.stdout)


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
