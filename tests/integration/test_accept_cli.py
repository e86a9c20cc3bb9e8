"""`sdserve accept`: the no-GPU path as a real subprocess, its --help, and the pure logic the command adds (the
one-variable rule's files, the baseline, a replica's Server-Timing, failed and skipped steps in the report, the
GPU gate, the step runner). The GPU steps themselves need a GPU node: tests/gpu and `sdserve accept` there."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.responses import Response

from engines.accept import run as accept_run
from engines.accept.proofs import (
    baseline_jobs_per_hour,
    one_variable_changed,
    parse_key_values,
    server_timing_seconds,
)
from engines.accept.report import SECTIONS, LatencyRun, LatencySection, StepFailure, validate
from engines.config import Canary, CanarySuite, Matrix, RuntimeSettings, SelfTestPlan, SignatureThresholds
from engines.errors import GpuUnavailableError, NotReadyError
from engines.health.preflight import Observations
from engines.health.telemetry import DeviceInfo, NvmlReport
from engines.runtime.libdeps import Closure
from engines.types.request import BatchResult, Timings
from server.service import Generated
from tests.unit.test_acceptance import _report

ROOT = Path(__file__).resolve().parents[2]


def _accept(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "server.cli", "accept", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    return done, time.monotonic() - start


# --- the command on this machine (no GPU) -------------------------------------------------------------------------


def test_accept_without_a_gpu_exits_20_at_once_naming_why(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done, seconds = _accept("--out", str(out))
    assert done.returncode == 20, done.stderr
    assert seconds < 30
    assert "sdserve accept needs an NVIDIA GPU node: no NVIDIA GPU: NVML" in done.stderr
    assert "GPU_UNAVAILABLE" in done.stderr
    assert not out.exists()  # the gate comes before anything is built or written


def test_accept_help_documents_the_report_and_its_options() -> None:
    done, _ = _accept("--help")
    assert done.returncode == 0, done.stderr
    for section in SECTIONS:
        assert f"\n  {section} " in done.stdout, section
    for text in ("accept_report.json", "accept_report.md", "accept_report.schema.json", "--baseline", "--compare",
                 "--changed", "--band", "--skip-torch-reference", "--jobs", "jobs_per_hour", "pip freeze",
                 "20 no usable NVIDIA GPU", "--step-budget", "not applicable", "--model DIR accepts an exported",
                 "relocation 1800"):
        assert text in done.stdout, text


def test_a_step_budget_must_name_a_step_and_positive_seconds(tmp_path: Path) -> None:
    done, _ = _accept("--out", str(tmp_path), "--step-budget", "relocaton=60")
    assert done.returncode == 2 and "STEP one of model, relocation" in done.stderr
    done, _ = _accept("--out", str(tmp_path), "--step-budget", "relocation=0")
    assert done.returncode == 2 and "SECONDS > 0" in done.stderr


def test_bad_options_are_a_usage_error_before_the_gate(tmp_path: Path) -> None:
    done, _ = _accept("--out", str(tmp_path), "--baseline", "b.toml", "--compare", "http://127.0.0.1:1")
    assert done.returncode == 2
    assert "not allowed with argument" in done.stderr


# --- the one-variable rule's files ---------------------------------------------------------------------------------


def test_key_value_files_read_env_and_pip_freeze(tmp_path: Path) -> None:
    before = "# node before the fix\nNVIDIA_DRIVER=575.51\n\ntorch==2.13.0\nORT_TENSORRT_FP16_ENABLE = 1\n"
    after = "NVIDIA_DRIVER=580.10\ntorch==2.13.0\nORT_TENSORRT_FP16_ENABLE = 1\n"
    old, new = parse_key_values(before, "before.env"), parse_key_values(after, "after.env")
    assert old == {"NVIDIA_DRIVER": "575.51", "torch": "=2.13.0", "ORT_TENSORRT_FP16_ENABLE": "1"}
    assert one_variable_changed(old, new) == (True, ("NVIDIA_DRIVER",))
    assert one_variable_changed(old, {**new, "torch": "=2.14.0"}) == (False, ("NVIDIA_DRIVER", "torch"))


@pytest.mark.parametrize(("text", "message"), [
    ("no equals sign here", "after.env:1: expected KEY=VALUE"),
    ("A=1\n=2", "after.env:2: expected KEY=VALUE"),
    ("A=1\nA=2", "after.env:2: A given twice"),
])
def test_key_value_files_refuse_what_they_cannot_read(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_key_values(text, "after.env")


# --- the reference -------------------------------------------------------------------------------------------------


def test_baseline_by_gpu_model() -> None:
    import tomllib

    table = tomllib.loads('["NVIDIA H200"]\njobs_per_hour = 1180.0\n["NVIDIA A100-SXM4-80GB"]\njobs_per_hour = 600\n')
    assert baseline_jobs_per_hour(table, "NVIDIA H200") == 1180.0
    assert baseline_jobs_per_hour(table, "NVIDIA A100-SXM4-80GB") == 600.0
    with pytest.raises(ValueError, match=r"no jobs_per_hour for 'NVIDIA L4' \(recorded: NVIDIA A100-SXM4-80GB, "):
        baseline_jobs_per_hour(table, "NVIDIA L4")
    with pytest.raises(ValueError, match="must be a positive number, got 0"):
        baseline_jobs_per_hour({"X": {"jobs_per_hour": 0}}, "X")
    with pytest.raises(ValueError, match="must be a positive number, got True"):
        baseline_jobs_per_hour({"X": {"jobs_per_hour": True}}, "X")


def test_server_timing_as_the_server_writes_it() -> None:
    response = Response()
    result = BatchResult((), "TensorrtExecutionProvider", Timings(total=0.8125))
    Generated([], result, queue_seconds=0.004, encode_seconds=0.02, warnings=[]).trace_headers(response)
    header = response.headers["server-timing"]
    assert server_timing_seconds(header) == pytest.approx(0.8125, abs=1e-4)
    assert server_timing_seconds(header, "queue") == pytest.approx(0.004)
    with pytest.raises(ValueError, match="no compute;dur"):
        server_timing_seconds("queue;dur=3.0")
    with pytest.raises(ValueError, match="must be positive"):
        server_timing_seconds("compute;dur=0")


# --- failed and skipped steps in the report -----------------------------------------------------------------------


def test_a_failed_step_stands_in_its_section_and_fails_only_that_section() -> None:
    failure = StepFailure("relocation", "GpuUnavailableError: TensorRT build failed", 12.5)
    report = _report(relocation=failure, boots=StepFailure("boots", "time budget of 600 s spent before this step"))
    assert report.failing == ("boots", "relocation")
    data = report.as_dict()
    assert validate(data) == []
    assert data["relocation"] == {"step": "relocation", "error": "GpuUnavailableError: TensorRT build failed",
                                  "seconds": 12.5, "ok": False}
    md = report.to_markdown()
    assert "| relocation | FAIL | step failed after 12.5 s: GpuUnavailableError: TensorRT build failed |" in md
    assert "| boots | FAIL | step failed after 0.0 s: time budget of 600 s spent before this step |" in md
    assert "| staging | pass | 2/2 staging buffers pinned |" in md


def test_schema_refuses_a_step_failure_that_claims_ok() -> None:
    data = _report(copies=StepFailure("copies", "x")).as_dict()
    data["copies"]["ok"] = True
    assert validate(data) != []


def test_a_skipped_torch_reference_is_reported_not_compared() -> None:
    latency = LatencySection(LatencyRun("sdserve", 2.0, 0.105), None)
    assert (latency.speedup, latency.ok) == (None, True)
    data = _report(latency=latency).as_dict()
    assert validate(data) == []
    assert (data["latency"]["diffusers"], data["latency"]["speedup"]) == (None, None)
    assert "diffusers torch reference skipped: no comparison" in _report(latency=latency).to_markdown()


# --- the GPU gate and the step runner ------------------------------------------------------------------------------


def _observations(nvml: NvmlReport, missing: dict[str, str]) -> Observations:
    cuda = Closure("CUDAExecutionProvider", "libonnxruntime_providers_cuda.so", missing=missing)
    return Observations("1.31.1", "13.0", ["CUDAExecutionProvider", "CPUExecutionProvider"],
                        {"CUDAExecutionProvider": cuda}, nvml, "9.10")


H200 = NvmlReport(True, driver_version="580.10", cuda_driver_version="13.0",
                  devices=[DeviceInfo(0, "NVIDIA H200", "9.0", 141 * 2**30, 0)])


def test_gpu_gate_names_every_reason_and_passes_a_gpu_node() -> None:
    accept_run.gpu_gate(_observations(H200, {}))
    with pytest.raises(GpuUnavailableError, match=r"needs an NVIDIA GPU node: the CUDA provider cannot load: "
                                                  r"libcudnn\.so\.9 not found$"):
        accept_run.gpu_gate(_observations(H200, {"libcudnn.so.9": "pip nvidia-cudnn-cu13"}))
    with pytest.raises(GpuUnavailableError, match=r"no NVIDIA GPU: NVML did not start: driver not loaded$"):
        accept_run.gpu_gate(_observations(NvmlReport(False, "NVML did not start: driver not loaded"), {}))


CANARIES = CanarySuite(canary=(Canary(name="c", prompt="a canary", seed=1),))


def _run(tmp_path: Path, budget_s: float = 60.0) -> accept_run.Run:
    options = accept_run.AcceptOptions(tmp_path, RuntimeSettings(), Matrix(), SelfTestPlan(CANARIES, (), ()),
                                       SignatureThresholds(), budget_s=budget_s)
    return accept_run.Run(options, _observations(H200, {}), time.monotonic() + budget_s)


def test_step_records_an_exception_and_a_spent_budget(tmp_path: Path) -> None:
    run = _run(tmp_path)

    def broken() -> Any:
        raise NotReadyError("no booted engine: preflight failed")

    assert accept_run.step(run, "ok", lambda: 42) == 42
    failed = accept_run.step(run, "placement", broken)
    assert isinstance(failed, StepFailure)
    assert (failed.step, failed.error) == ("placement", "NotReadyError: no booted engine: preflight failed")
    run.deadline = time.monotonic() - 1
    spent = accept_run.step(run, "latency", lambda: 42)
    assert spent == StepFailure("latency", "time budget of 60 s spent before this step")


def test_steps_that_need_an_engine_fail_with_the_boot_reason(tmp_path: Path) -> None:
    run = _run(tmp_path)
    run.engine_error = "GPU path unavailable: libcudnn.so.9 missing"
    failed = accept_run.step(run, "staging", lambda: accept_run.staging_buffers(run))
    assert isinstance(failed, StepFailure)
    assert failed.error == "NotReadyError: no booted engine: GPU path unavailable: libcudnn.so.9 missing"
    parity = accept_run.step(run, "parity", lambda: accept_run.parity_against_reference(run, failed))
    assert isinstance(parity, StepFailure)
    assert parity.error == "NotReadyError: the protocol did not run: no throughput to compare"


# --- the SD 1.5-architecture builder, run with the tiny configs (the full one needs minutes and a GPU node) ---------


def test_sd15_builder_exports_a_loadable_model_and_its_diffusers_twin(tmp_path: Path) -> None:
    from engines.build import sd15, tiny

    assert sd15.UNET["block_out_channels"] == (320, 640, 1280, 1280)
    assert (sd15.TEXT_ENCODER["hidden_size"], sd15.UNET["cross_attention_dim"]) == (768, 768)
    onnx_dir, torch_dir = tmp_path / "onnx", tmp_path / "diffusers"
    sd15.build_sd15(onnx_dir, torch_dir, configs=(tiny.TEXT_ENCODER, tiny.UNET, tiny.VAE))
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    assert manifest["source"] == {"kind": "sd15-architecture-random", "seed": 0}
    assert {"unet/model.onnx", "text_encoder/model.onnx", "vae_decoder/model.onnx"} <= set(manifest["files"])
    assert json.loads((torch_dir / "unet" / "config.json").read_text())["block_out_channels"] == [32, 64]
