"""`sdserve accept`'s checks made to check something (issue 27): each is shown failing on the input that must fail
it, with fakes behind the engine's surface (the GPU runs are `sdserve accept` on a GPU node). Also: step budgets,
parity without a reference, NVML readings that fail, and a model folder instead of torch."""

from __future__ import annotations

import itertools
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engines.accept import checks as accept_checks
from engines.accept import report as rep
from engines.accept import run as accept_run
from engines.accept import state as accept_state
from engines.accept.copies import count_copies
from engines.accept.proofs import JobStats, ProtocolSection
from engines.config import Canary, CanarySuite, Matrix, RuntimeSettings, SelfTestPlan, SignatureThresholds
from engines.errors import NotReadyError
from engines.health.preflight import Observations
from engines.health.telemetry import DeviceInfo, NvmlReport, TelemetryUnavailable
from engines.runtime import enginecheck
from engines.runtime.buffers import HostRead
from engines.runtime.sessions import Runtime
from engines.types.health import GpuSample
from engines.types.request import BatchResult, Timings
from tests.unit.test_acceptance import _report

H200 = NvmlReport(True, driver_version="580.10", cuda_driver_version="13.0",
                  devices=[DeviceInfo(0, "NVIDIA H200", "9.0", 141 << 30, 0, "00000000:3B:00.0")])
CANARIES = CanarySuite(canary=(Canary(name="c", prompt="a canary", seed=1),))


def _run(tmp_path: Path, **options: Any) -> accept_run.Run:
    opts = accept_run.AcceptOptions(tmp_path, RuntimeSettings(), Matrix(), SelfTestPlan(CANARIES, (), ()),
                                    SignatureThresholds(), **options)
    obs = Observations("1.31.1", "13.0", [], {}, H200, "9.10", cuda_bus_ids=["0000:3b:00.0"])
    return accept_run.Run(opts, obs, time.monotonic() + opts.total_budget_s)


# --- step budgets: every step timed against its own budget, reported ----------------------------------------------


def test_each_step_is_timed_against_its_own_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = itertools.count(1000.0, 5.0)  # every reading of the clock is 5 s later: no wall-clock guessing
    monkeypatch.setattr(accept_run.time, "monotonic", lambda: next(clock))
    run = _run(tmp_path, step_budgets_s=(("placement", 4.0),))
    run.deadline = 10_000.0
    assert accept_run.step(run, "staging", lambda: 1) == 1
    assert accept_run.step(run, "placement", lambda: 2) == 2  # finished, but 5 s > its 4 s
    na = accept_run.step(run, "parity", lambda: rep.NotApplicable("parity", "no reference"))
    assert isinstance(na, rep.NotApplicable)
    assert [(t.step, t.seconds, t.budget_s, t.state) for t in run.timings] == [
        ("staging", 5.0, rep.STEP_BUDGETS_S["staging"], "ok"), ("placement", 5.0, 4.0, "over budget"),
        ("parity", 5.0, rep.STEP_BUDGETS_S["parity"], "not applicable")]
    report = _report(steps=tuple(run.timings), parity=na)
    assert report.failing == ("budget",) and report.over_budget == ("placement",)
    assert rep.validate(report.as_dict()) == []
    md = report.to_markdown()
    assert "| placement | 5.0 | 4 | over budget |" in md and "| parity | n/a | not applicable: no reference |" in md


def test_the_run_budget_defaults_to_the_sum_of_the_step_budgets(tmp_path: Path) -> None:
    run = _run(tmp_path)
    assert run.options.total_budget_s == sum(rep.STEP_BUDGETS_S.values())
    assert _run(tmp_path, budget_s=60.0).options.total_budget_s == 60.0


# --- parity and the signature: not applicable, said why, instead of a failure or a verdict on nothing -----------


def _protocol() -> ProtocolSection:
    return ProtocolSection(JobStats.from_jobs([3.0] * 10, [True] * 10))


def test_parity_without_a_reference_says_what_it_would_need(tmp_path: Path) -> None:
    run = _run(tmp_path)
    parity = accept_run.parity_against_reference(run, _protocol())
    assert isinstance(parity, rep.NotApplicable)
    assert "1200.0 jobs/h" in parity.reason and "--baseline FILE" in parity.reason and "--compare URL" in parity.reason
    assert '["NVIDIA H200"] jobs_per_hour = N' in parity.reason
    report = _report(parity=parity)
    assert report.section_results()["parity"] is None and report.ok
    data = report.as_dict()
    assert rep.validate(data) == [] and data["parity"]["state"] == "not applicable" and "ok" not in data["parity"]
    baseline = tmp_path / "baseline.toml"
    baseline.write_text('["NVIDIA H200"]\njobs_per_hour = 2400.0\n')
    measured = accept_run.parity_against_reference(_run(tmp_path, baseline=baseline), _protocol())
    assert not isinstance(measured, rep.NotApplicable) and not measured.ok  # 50 %: a real comparison fails


class _Telemetry:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.sampled = threading.Event()

    def sample(self, device: int) -> GpuSample:
        self.sampled.set()
        if self.fail:
            raise TelemetryUnavailable("NVML utilization is not available on this device: Not Supported")
        return GpuSample(95.0, 40.0, 500.0, 700.0)


class _Engine:
    """The engine surface the protocol, staging and copies steps use."""

    def __init__(self, telemetry: _Telemetry | None = None, runtime: Any = None) -> None:
        self._telemetry = telemetry
        self.runtime = runtime
        self.generated: list[int] = []

    def telemetry(self) -> _Telemetry | None:
        return self._telemetry

    def generate(self, batch: Any) -> BatchResult:
        self.generated.append(batch.steps)
        if self.runtime is not None:
            for i in range(batch.steps + 3):  # 3 per request, one per step
                self.runtime.host_reads.append(HostRead(f"t{i}", 4096 * (i + 1), 64))
        if self._telemetry is not None:  # each job lasts until the sampler thread has read once more
            self._telemetry.sampled.clear()
            assert self._telemetry.sampled.wait(30), "the sampler thread stopped"
        return BatchResult((), "TensorrtExecutionProvider", Timings(total=0.25, denoise=0.2))

    def _pipeline_for(self, batch: Any) -> Any:
        return types.SimpleNamespace(runtime=self.runtime)


def test_failed_nvml_readings_never_stop_the_sampler_and_make_the_signature_not_applicable(tmp_path: Path) -> None:
    run = _run(tmp_path, jobs=2)
    run.engine = _Engine(_Telemetry(fail=True))  # type: ignore[assignment]
    protocol = accept_run.protocol_jobs(run)
    assert protocol.stats.succeeded == 2 and not run.samples
    assert sum(run.sample_errors.values()) >= 2  # the thread kept sampling after the first failure
    signature = accept_run.signature_section(run)
    assert isinstance(signature, rep.NotApplicable) and "Not Supported" in signature.reason
    run = _run(tmp_path, jobs=2)
    run.engine = _Engine(_Telemetry(fail=False))  # type: ignore[assignment]
    accept_run.protocol_jobs(run)
    assert not isinstance(accept_run.signature_section(run), rep.NotApplicable)


# --- staging and copies: the copies the request really made --------------------------------------------------------


def test_staging_checks_every_copy_the_request_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy from pageable memory (cudaMemoryTypeUnregistered, 0) fails the section: the check reads what the
    request copied from, not what sdserve allocated."""
    runtime = types.SimpleNamespace(device="cuda", host_reads=[HostRead("stale", 1, 1)])
    run = _run(tmp_path)
    run.engine = _Engine(runtime=runtime)  # type: ignore[assignment]
    pageable = {4096 * 2}
    monkeypatch.setattr(accept_checks, "load_cudart", lambda: object())
    monkeypatch.setattr(accept_checks, "memory_type", lambda cudart, address: 0 if address in pageable else 1)
    buffers = accept_run.staging_buffers(run)
    assert isinstance(buffers, tuple) and "stale" not in {b.name for b in buffers}  # only this request's copies
    assert {b.name for b in buffers if not b.pinned} == {"t1"}
    assert not _report(staging=buffers).section_results()["staging"]


def test_staging_is_not_applicable_where_the_ep_reads_host_memory(tmp_path: Path) -> None:
    run = _run(tmp_path)
    cpu = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    run.engine = _Engine(runtime=cpu)  # type: ignore[assignment]
    staging = accept_run.staging_buffers(run)
    assert isinstance(staging, rep.NotApplicable) and "device cpu" in staging.reason


def test_per_step_host_copies_fail_the_copies_check_a_memcpy_count_passes(tmp_path: Path) -> None:
    """A one-node TensorRT graph has no Memcpy nodes: the pipeline's own per-step copies are what can fail."""
    run = _run(tmp_path)
    engine = _Engine(runtime=types.SimpleNamespace(host_reads=[]))
    run.engine = engine  # type: ignore[assignment]
    per_step = accept_checks.host_copies_per_step(run)
    assert per_step == 1.0 and engine.generated == [2, 4]
    ep_context = [{"cat": "Node", "name": "ctx_kernel_time", "args": {"op_name": "EPContext"}}]
    assert count_copies(ep_context, unet_runs=50).ok  # nothing to see in the profile
    copies = count_copies(ep_context, unet_runs=50, host_copies_per_step=per_step)
    assert not copies.ok and "host->device copies 1.00 per step" in copies.summary()


# --- placement from the session that served; relocation from the files ------------------------------------------


def _ctx_model(path: Path, cache: str, embed: int = 0) -> Path:
    node = helper.make_node("EPContext", ["x"], ["y"], domain="com.microsoft", embed_mode=embed,
                            ep_cache_context=cache)
    graph = helper.make_graph([node], "ctx", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("com.microsoft", 1)]), str(path))
    return path


class _Session:
    def __init__(self, on: dict[str, list[str]]) -> None:
        self.on = on

    def get_provider_graph_assignment_info(self) -> list[Any]:
        return [types.SimpleNamespace(ep_name=ep, get_nodes=lambda names=names: [
            types.SimpleNamespace(name=n) for n in names]) for ep, names in self.on.items()]

    def get_providers(self) -> list[str]:
        return [*self.on, "CPUExecutionProvider"]


def test_placement_judges_the_model_the_session_loaded(tmp_path: Path) -> None:
    ctx = _ctx_model(tmp_path / "trt" / "512x512" / "unet_ctx.onnx", "engines/unet.engine")
    trt = {"TensorrtExecutionProvider": ["TRTKernel_graph_0"]}
    components = {name: types.SimpleNamespace(source=ctx, session=_Session(trt)) for name in accept_state.COMPONENTS}
    components["unet"] = types.SimpleNamespace(source=ctx, session=_Session(
        {**trt, "CPUExecutionProvider": ["TRTKernel_graph_0"]}))
    run = _run(tmp_path)
    run.engine = types.SimpleNamespace(_pipeline_for=lambda batch: types.SimpleNamespace(**components))  # type: ignore[assignment]
    sections = {p.session: p for p in accept_run.placement_report(run)}
    assert sections["text_encoder"].ok and sections["text_encoder"].gpu_nodes == 1
    assert not sections["unet"].ok
    assert sections["unet"].activation_path_cpu_nodes == ("TRTKernel_graph_0 (of the EP-context model)",)


def test_a_relocated_context_model_must_find_its_engine_beside_it(tmp_path: Path) -> None:
    folder = tmp_path / "trt" / "512x512"
    (folder / "engines").mkdir(parents=True)
    (folder / "engines" / "unet.engine").write_bytes(b"plan")
    assert enginecheck.context_engine_problems(_ctx_model(folder / "ok_ctx.onnx", "engines/unet.engine")) == []
    absolute = _ctx_model(folder / "abs_ctx.onnx", str(tmp_path / "built" / "engines" / "unet.engine"))
    assert "not a path relative" in enginecheck.context_engine_problems(absolute)[0]
    escaping = _ctx_model(folder / "up_ctx.onnx", "../engines/unet.engine")
    assert "not a path relative" in enginecheck.context_engine_problems(escaping)[0]
    missing = _ctx_model(folder / "gone_ctx.onnx", "engines/vae.engine")
    assert "is not beside it" in enginecheck.context_engine_problems(missing)[0]
    assert enginecheck.context_engine_problems(_ctx_model(folder / "embedded_ctx.onnx", "x", embed=1)) == []


def test_a_component_compiled_on_load_fails_relocation(tmp_path: Path) -> None:
    ctx = _ctx_model(tmp_path / "trt" / "512x512" / "unet_ctx.onnx", "engines/unet.engine")
    plain = tmp_path / "vae_decoder" / "model.onnx"
    plain.parent.mkdir()
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(plain))
    pipeline = types.SimpleNamespace(text_encoder=types.SimpleNamespace(source=ctx),
                                     unet=types.SimpleNamespace(source=ctx),
                                     vae_decoder=types.SimpleNamespace(source=plain), vae_encoder=None)
    found = accept_run.compiled_on_load(pipeline, tmp_path)  # type: ignore[arg-type]
    assert found == ["vae_decoder: model.onnx is not an EP-context model: its engine was compiled on load"]
    elsewhere = accept_run.compiled_on_load(pipeline, tmp_path / "trt" / "768x768")  # type: ignore[arg-type]
    assert len(elsewhere) == 3 and all("not " in f for f in elsewhere)
    section = rep.RelocationSection("a", "b", loaded=True, engine_built_on_load=bool(found))
    assert not section.ok


# --- reach: the serving image has no torch --------------------------------------------------------------------------


def test_without_torch_accept_asks_for_a_model_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    with pytest.raises(NotReadyError, match=r"needs torch, .*Pass --model DIR: an exported ONNX folder"):
        accept_run._prepare_model(_run(tmp_path))
    given = _run(tmp_path, model=tmp_path / "sd15")
    assert accept_run._prepare_model(given) == tmp_path / "sd15"


def test_host_reads_record_what_each_copy_read() -> None:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    table = np.arange(6, dtype=np.float32).reshape(3, 2)
    values = runtime.upload_steps("coeffs", table)
    assert [v.numpy().tolist() for v in values] == table.tolist()
    assert runtime.upload_steps("coeffs", table)[0] is values[0]  # reused per shape
    assert [r.tag for r in runtime.host_reads] == ["coeffs", "coeffs"] and runtime.host_reads[0].nbytes == 24
