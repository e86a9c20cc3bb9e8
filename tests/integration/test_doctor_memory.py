"""`sdserve doctor` prints the memory plan of a FLUX.1-dev folder that holds only the released config files: the
folder cannot boot (no ONNX files), doctor still exits with its boot exit code, and the plan says what the
device and the pod need, with and without LoRA (engines/health/memory_plan.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = json.loads((ROOT / "tests" / "data" / "model_configs.json").read_text())
SCHEMA = json.loads((ROOT / "engines" / "schemas" / "capabilities.schema.json").read_text())
TRANSFORMER_PARAMS = 11_901_408_320
"""FLUX.1-dev's transformer (FluxTransformer2DModel from its released config.json)."""


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("configs") / "flux-dev"
    for rel, body in CONFIGS["flux-dev"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    return folder


def _doctor(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--model", str(model),
                           "--plan-size", "1024x1024", "--plan-images", "1", "--device-memory-gib", "141", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _gib(text: str, label: str) -> float:
    found = re.search(rf"^  {re.escape(label)}: ([0-9.]+) GiB", text, re.MULTILINE)
    assert found, f"no line {label!r} in:\n{text}"
    return float(found.group(1))


def test_doctor_prints_the_plan_of_a_config_only_flux_folder(flux_dev: Path) -> None:
    done = _doctor(flux_dev)
    assert done.returncode != 0, done.stdout  # nothing to load: the boot checks fail as before
    assert f"exit code: {done.returncode} (" in done.stdout
    out = done.stdout
    assert "memory plan — flux-dev (flux), 1024x1024, 1 image(s) per batch (1 rows), TensorRT" in out
    row = next(line for line in out.splitlines() if line.startswith("  transformer "))
    assert row.split()[:6] == ["transformer", "config", "11.901", "B", "bf16", "22.17"]  # 2 bytes x 11.9 B
    assert row.rstrip().endswith("44.34 GiB (fp32)")  # the LoRA variant: the fp32 export's second copy
    base = _gib(out, "device without LoRA")
    lora = _gib(out, "device with LoRA on the transformer")
    every = _gib(out, "device with LoRA on every adaptable component")
    assert base < lora < every
    assert lora - base > 44.34  # at least the variant's copy of the transformer
    assert re.search(r"device without LoRA: .* fits in 141\.00 GiB \(--device-memory-gib\), margin", out)
    assert "(pod limit 32Gi (deploy/k8s/rollout.yaml))" in out  # the production Deployment's limit
    assert _gib(out, "host peak at load") > 22.17  # the transformer's bf16 engine is read whole


def test_doctor_json_carries_the_plan(flux_dev: Path) -> None:
    done = _doctor(flux_dev, "--json")
    snapshot = json.loads(done.stdout)
    jsonschema.validate(snapshot, SCHEMA)
    assert snapshot["exit_code"]["code"] == done.returncode != 0
    plan = snapshot["memory_plan"]
    transformer = next(c for c in plan["components"] if c["name"] == "transformer")
    assert (transformer["params"], transformer["dtype"], transformer["weights"]) == (
        TRANSFORMER_PARAMS, "bf16", 2 * TRANSFORMER_PARAMS)
    device = plan["device"]
    assert device["budget"] == {"bytes": 141 << 30, "source": "--device-memory-gib"}
    assert device["lora_denoiser"] > device["base"] and device["verdicts"]["base"]["fits"]
    assert plan["host"]["limit"]["bytes"] == 32 << 30


def test_a_folder_of_no_served_family_gets_its_reason(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinKVPipeline"}))
    done = _doctor(tmp_path, "--profile", "dev")
    assert re.search(r"^memory plan: unavailable: .*FLUX\.2 \[klein\] with a reference-image KV cache", done.stdout,
                     re.MULTILINE), done.stdout
    assert done.returncode != 0
