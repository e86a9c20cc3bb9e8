"""The device check (benchmarks/gpu/device_check.py) executed here, where there is no GPU: the script a lent GPU
node runs is the one the suite runs, so a broken import, path or call is found in CI, not in the device's minutes.

``--rehearse`` puts the CPU provider in CUDA's place (the dev policy: the same engine, placement audit, tick and LoRA
code) and builds step 5's SD 1.5-architecture model at the tiny widths; only the arena and NVML steps may SKIP, and
only for the absence of an NVIDIA device. Joined ticks must give each request its solo latents: the row Concat and
Slice graphs copy (onnxruntime/core/providers/cpu/tensor/concat.cc, slice.cc), so the bound is tight."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu" / "device_check.py"
STEPS = ["preflight", "engine", "joined-vs-solo", "arena-cap", "fullsize-unet", "lora-external-data", "nvml"]
NO_DEVICE = not any(Path("/dev").glob("nvidia[0-9]*"))


def _numbers(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"(\w+)=(-?[0-9.]+(?:e-?[0-9]+)?)\b", line)}


def _steps(stdout: str) -> dict[str, str]:
    found = re.findall(r"^STEP (\d) ([\w-]+): (.*)$", stdout, re.M)
    assert [(int(n), name) for n, name, _ in found] == list(enumerate(STEPS, 1)), stdout
    return {name: rest for _, name, rest in found}


@pytest.mark.slow
def test_the_rehearsal_runs_every_step_and_passes_on_the_cpu(tiny_model: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--model", str(tiny_model)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = _steps(done.stdout)
    for name in ("preflight", "engine", "joined-vs-solo", "fullsize-unet", "lora-external-data"):
        assert lines[name].startswith("PASS "), lines[name]
    for name in ("arena-cap", "nvml"):
        assert lines[name].startswith("SKIP no NVIDIA device" if NO_DEVICE else "PASS "), lines[name]
    assert "tensorrt=skip" in lines["preflight"]  # not in the policy: absent by design, not a failure
    sessions = dict(re.findall(r"(\w+)=CPU/cpu_nodes=(\d+)", lines["engine"]))
    assert {"unet", "text_encoder", "vae_decoder", "scheduler_step"} <= set(sessions)
    assert all(int(n) > 0 for n in sessions.values())  # every node on the stand-in provider, counted
    joined = _numbers(lines["joined-vs-solo"])
    assert joined["max_abs_delta"] <= 1e-3 and joined["ticks"] == 6
    assert joined["ms_per_tick_joined"] > 0 and joined["host_reads_per_tick"] > 0
    full = _numbers(lines["fullsize-unet"])
    assert full["size"] == 64 and full["ours_ms_per_step"] > 0 and full["torch_ms_per_step"] > 0
    assert _numbers(lines["lora-external-data"])["lora_max_abs_delta"] > 0


def test_a_failing_step_prints_its_real_cause_and_fails_the_run(tmp_path: Path) -> None:
    """Step 2 on an empty prepared folder: the line names the exception and where it was raised (never a generic
    "no driver"), the steps not selected say so, and the exit code is 1."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--work", str(tmp_path), "--only", "2,7"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = _steps(done.stdout)
    assert re.match(r"FAIL \w+(Error|Exception): .+ \(raised at \w+\.py:\d+ in \w+\)", lines["engine"]), lines
    assert str(tmp_path / "model") in lines["engine"]
    assert lines["preflight"] == "SKIP not selected (--only)"
    assert "driver" not in lines["engine"]


@pytest.mark.skipif(not NO_DEVICE, reason="asserts what a machine without an NVIDIA device prints off the rehearsal")
def test_off_the_rehearsal_a_missing_device_fails_with_nvmls_own_words(tmp_path: Path) -> None:
    """The first device run reported "no NVIDIA driver" when an import failed: the NVML step now raises what NVML
    (or the import) raised, and only a rehearsal may SKIP for the device's absence."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path), "--only", "7"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    nvml = _steps(done.stdout)["nvml"]
    assert re.match(r"FAIL \w+: .+ \(raised at \w+\.py:\d+ in \w+\)", nvml), nvml


def test_the_node_runs_the_cuda_profile_and_downloads_for_every_manylinux_tag() -> None:
    """No download: the pip command as built, the wheel list as written, the policy the node's steps get."""
    saved = list(sys.path)
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import device_check
    finally:
        sys.path[:] = saved  # the script puts the repository and its own folder first: not for the rest
    command = device_check.pip_download_command(Path("wheels"))
    platforms = [command[k + 1] for k, arg in enumerate(command) if arg == "--platform"]
    assert platforms == ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert command[command.index("--python-version") + 1] == "3.12"
    assert command[command.index("--implementation") + 1] == "cp"
    assert {"--only-binary=:all:", "--no-deps"} <= set(command)
    listed = [ln.strip() for ln in (SCRIPT.parent / "device-wheels.txt").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert command[-2:] == ["-r", str(SCRIPT.parent / "device-wheels.txt")]
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", ln) for ln in listed), listed  # pinned: CI's versions
    assert not [ln for ln in listed if "tensorrt" in ln.lower()]
    assert {"tokenizers", "pydantic-core", "diffusers"} <= {ln.split("==")[0] for ln in listed}
    node = device_check.policy(rehearse=False)
    assert node.providers == ("CUDAExecutionProvider",) and not node.allow_cpu and node.cuda.shared_arena
