"""The pure logic of `sdserve accept`: protocol stats, parity band, copy counting from real and CUDA-shaped ONNX
Runtime profiles, the signature section, the report's schema and its Markdown summary. Timings appear only as inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.accept.copies import CopyCount, count_copies, load_profile
from engines.accept.proofs import (
    EXIT_NO_GPU,
    JobStats,
    ProtocolSection,
    SignatureSection,
    gpu_absent_reason,
    one_variable_changed,
    parity_check,
    parity_percent,
    protocol_verdict,
    signature_section,
)
from engines.accept.report import (
    AcceptReport,
    DoctorSection,
    LatencyRun,
    LatencySection,
    RelocationSection,
    SessionPlacement,
    ShapeBoot,
    StagingBuffer,
    validate,
)
from engines.health.telemetry import DeviceInfo, NvmlReport
from engines.types.health import GpuSample

DURATIONS = [4.0, 4.5, 5.0, 4.0, 4.5, 5.0, 4.0, 4.5, 5.0, 4.5]  # mean 4.5, min 4.0, max 5.0


# --- protocol ---------------------------------------------------------------------------------------------------------


def test_job_stats_compute_mean_range_and_jobs_per_hour() -> None:
    stats = JobStats.from_jobs(DURATIONS, [True] * 10)
    assert (stats.count, stats.succeeded, stats.all_ok) == (10, 10, True)
    assert stats.mean_s == pytest.approx(4.5)
    assert (stats.min_s, stats.max_s, stats.range_s) == (4.0, 5.0, 1.0)
    assert stats.jobs_per_hour == pytest.approx(800.0)


def test_job_stats_reject_mismatched_empty_and_nonpositive_input() -> None:
    with pytest.raises(ValueError, match="2 durations but 1 success flags"):
        JobStats.from_jobs([1.0, 2.0], [True])
    with pytest.raises(ValueError, match="no jobs ran"):
        JobStats.from_jobs([], [])
    with pytest.raises(ValueError, match="finite and positive"):
        JobStats.from_jobs([1.0, 0.0], [True, True])


def test_protocol_needs_exactly_ten_jobs_all_succeeded() -> None:
    assert protocol_verdict(JobStats.from_jobs(DURATIONS, [True] * 10)).ok
    short = protocol_verdict(JobStats.from_jobs(DURATIONS[:9], [True] * 9))
    assert not short.ok and short.reasons == ("ran 9 jobs; the protocol needs exactly 10 back to back",)
    one_failed = protocol_verdict(JobStats.from_jobs(DURATIONS, [True] * 9 + [False]))
    assert not one_failed.ok and one_failed.reasons == ("1 of 10 jobs failed; all must succeed",)
    assert protocol_verdict(JobStats.from_jobs(DURATIONS[:3], [True] * 3), required_jobs=3).ok


def test_one_variable_changed() -> None:
    before = {"driver": "570.1", "ort": "1.31.1", "cudnn": "9.8"}
    assert one_variable_changed(before, {**before, "driver": "575.2"}) == (True, ("driver",))
    assert one_variable_changed(before, {**before, "driver": "575.2", "ort": "1.31.2"}) == (False, ("driver", "ort"))
    assert one_variable_changed(before, dict(before)) == (False, ())
    assert one_variable_changed(before, {**before, "tensorrt": "10.9"}) == (True, ("tensorrt",))
    removed = {k: v for k, v in before.items() if k != "cudnn"}
    assert one_variable_changed(before, removed) == (True, ("cudnn",))


def test_protocol_section_refuses_a_fix_that_changed_two_variables() -> None:
    stats = JobStats.from_jobs(DURATIONS, [True] * 10)
    assert ProtocolSection(stats, changed=("driver",)).ok
    assert ProtocolSection(stats).ok  # plain acceptance: no fix, no one-variable rule
    two = ProtocolSection(stats, changed=("driver", "ort"))
    assert not two.ok
    assert two.reasons == ("a fix is accepted only when one variable changed; changed: driver, ort",)


# --- parity -----------------------------------------------------------------------------------------------------------


def test_parity_percent_is_candidate_over_reference() -> None:
    assert parity_percent(90.0, 100.0) == pytest.approx(90.0)
    assert parity_percent(1200.0, 800.0) == pytest.approx(150.0)
    with pytest.raises(ValueError, match="reference throughput must be positive"):
        parity_percent(100.0, 0.0)
    with pytest.raises(ValueError, match="candidate throughput must be non-negative"):
        parity_percent(-1.0, 100.0)


@pytest.mark.parametrize(("candidate", "reference", "status"), [
    (810.0, 900.0, "within_band"),   # exactly 90 %: the lower edge is inside
    (809.9, 900.0, "below_band"),
    (990.0, 900.0, "within_band"),   # exactly 110 %: the upper edge is inside
    (990.1, 900.0, "above_band"),
    (140.8, 128.0, "within_band"),   # 110.00000000000001 % in floating point: still the edge
    (140.9, 128.0, "above_band"),
    (900.0, 900.0, "within_band"),
])
def test_parity_band_edges(candidate: float, reference: float, status: str) -> None:
    parity = parity_check(candidate, reference, band_percent=10.0, reference_source="replica", reference="http://b")
    assert parity.status == status
    assert parity.ok is (status == "within_band")


def test_parity_far_above_reference_is_flagged_not_comparable() -> None:
    parity = parity_check(2000.0, 800.0, band_percent=10.0, reference="H200")
    assert (parity.parity_percent, parity.status, parity.ok) == (250.0, "above_band", False)
    assert parity.summary() == "250.0% of baseline H200 (band ±10%): faster than the reference, not comparable"


def test_parity_zero_band_accepts_only_exact_parity() -> None:
    assert parity_check(800.0, 800.0, band_percent=0.0).ok
    assert not parity_check(799.0, 800.0, band_percent=0.0).ok
    with pytest.raises(ValueError, match="band must be non-negative"):
        parity_check(800.0, 800.0, band_percent=-1.0)


# --- copies from profiles -----------------------------------------------------------------------------------------


def _real_cpu_profile(tmp_path: Path, runs: int) -> Path:
    """A profile ONNX Runtime itself wrote: a two-node graph run ``runs`` times on the CPU provider."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"]), helper.make_node("Relu", ["y"], ["z"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for _ in range(runs):
        session.run(None, {"x": np.array([-1.0, 2.0], dtype=np.float32)})
    return Path(session.end_profiling())


def test_real_cpu_profile_has_kernels_and_no_copies(tmp_path: Path) -> None:
    events = load_profile(_real_cpu_profile(tmp_path, runs=3))
    count = count_copies(events, unet_runs=3)
    assert (count.memcpy_from_host, count.memcpy_to_host, count.node_copies) == (0, 0, 0)
    assert count.node_events == 6  # Add and Relu, three runs
    assert count.model_runs == 3
    assert (count.cupti_present, count.per_step, count.ok) == (False, 0.0, True)


# Mirrors a CUDA session's profile as ONNX Runtime writes it:
# - profiler.cc EndProfiling: {"cat", "pid", "tid", "dur", "ts", "ph": "X", "name", "args"};
# - sequential_executor.cc KernelScope: Node events "<node>_kernel_time" with args op_name/provider/node_index, and in
#   some versions "<node>_fence_before"/"_fence_after" Node events with op_name only (same kernel run: not counted);
# - transformer_memcpy.cc AddCopyNode: copy nodes named GenerateNodeName("Memcpy") ("Memcpy", "Memcpy_token_3"),
#   op MemcpyFromHost (host->device) / MemcpyToHost (device->host), run by the CUDA provider;
# - cupti_manager.cc ProcessActivityBuffers: "Kernel" events named by GetMemcpyKindString ("MemcpyHostToDevice", ...)
#   with args stream and grid/block -1 (builds with CUDA profiling only).
def _event(cat: str, name: str, **args: str) -> dict[str, Any]:
    return {"cat": cat, "pid": 7, "tid": 7, "dur": 3, "ts": 100, "ph": "X", "name": name, "args": args}


def _node(name: str, op: str, suffix: str = "_kernel_time") -> dict[str, Any]:
    return _event("Node", name + suffix, op_name=op, provider="CUDAExecutionProvider", node_index="4")


def _cupti(name: str) -> dict[str, Any]:
    return _event("Kernel", name, stream="13", grid_x="-1", grid_y="-1", grid_z="-1", block_x="-1", block_y="-1",
                  block_z="-1")


def _cuda_profile_events(unet_runs: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for _ in range(unet_runs):
        events += [
            _node("Memcpy", "MemcpyFromHost", "_fence_before"),
            _node("Memcpy", "MemcpyFromHost"),
            _node("Memcpy", "MemcpyFromHost", "_fence_after"),
            _node("/conv_in/Conv", "Conv"),
            _node("Memcpy_token_3", "MemcpyToHost"),
            _cupti("MemcpyHostToDevice"), _cupti("MemcpyDeviceToHost"), _cupti("MemcpyDeviceToDevice"),
            _event("Kernel", "void cudnn::conv_kernel<float>", op_name="MemcpyFromHost"),  # a Kernel, not a Node
            _event("Session", "SequentialExecutor::Execute"), _event("Session", "model_run"),
        ]
    return events


def test_cuda_shaped_profile_counts_exact_copies_per_step(tmp_path: Path) -> None:
    path = tmp_path / "cuda_profile.json"
    path.write_text(json.dumps(_cuda_profile_events(unet_runs=4)))
    count = count_copies(load_profile(path), unet_runs=4)
    assert (count.memcpy_from_host, count.memcpy_to_host, count.node_copies) == (4, 4, 8)
    assert (count.cupti_host_to_device, count.cupti_device_to_host, count.cupti_present) == (4, 4, True)
    assert (count.node_events, count.model_runs) == (12, 4)
    assert (count.per_step, count.cupti_per_step) == (2.0, 2.0)
    assert not count.ok
    assert count_copies(load_profile(path), unet_runs=4, max_per_step=2.0).ok
    assert not count_copies(load_profile(path), unet_runs=4, max_per_step=1.9).ok


def test_chrome_trace_object_form_and_bad_files(tmp_path: Path) -> None:
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"traceEvents": _cuda_profile_events(unet_runs=1)}))
    assert count_copies(load_profile(wrapped), unet_runs=1).node_copies == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"events": []}))
    with pytest.raises(ValueError, match="not an ONNX Runtime profile"):
        load_profile(bad)
    with pytest.raises(ValueError, match="unet_runs must be positive"):
        count_copies([], unet_runs=0)


def test_a_profile_without_kernel_runs_proves_nothing() -> None:
    count = count_copies([_event("Session", "model_run")], unet_runs=1)
    assert (count.node_copies, count.node_events, count.ok) == (0, 0, False)
    assert "no kernel runs" in count.summary()


# --- signature ----------------------------------------------------------------------------------------------------


def test_signature_section_healthy() -> None:
    samples = [GpuSample(96.0, 30.0, 120.0, 700.0), GpuSample(98.0, 40.0, 140.0, 700.0)]
    section = signature_section(samples)
    assert (section.samples, section.sm_percent_mean, section.memory_percent_mean, section.watts_mean) == \
        (2, 97.0, 35.0, 130.0)
    assert (section.verdict, section.ok) == ("healthy_compute", True)


def test_signature_section_livelock_fails() -> None:
    section = signature_section([GpuSample(98.0, 1.0, 38.0, 300.0)] * 5)
    assert (section.verdict, section.ok) == ("livelock", False)
    assert section.reason.startswith("livelock signature")


def test_signature_section_without_samples_is_inconclusive() -> None:
    section = signature_section([])
    assert (section.samples, section.watts_mean, section.verdict, section.ok) == (0, 0.0, "inconclusive", False)


def test_gpu_absent_reason() -> None:
    assert EXIT_NO_GPU == 20
    assert gpu_absent_reason(NvmlReport(False, "NVML did not start: driver not loaded")) == \
        "no NVIDIA GPU: NVML did not start: driver not loaded"
    assert gpu_absent_reason(NvmlReport(True)) == "no NVIDIA GPU: NVML started but reports 0 devices"
    h200 = DeviceInfo(0, "NVIDIA H200", "9.0", 141 * 2**30, 0)
    assert gpu_absent_reason(NvmlReport(True, devices=[h200])) is None


# --- the report ---------------------------------------------------------------------------------------------------


def _report(**overrides: Any) -> AcceptReport:
    fields: dict[str, Any] = {
        "generated_at": "2026-01-02T03:04:05Z",
        "node": {"gpu": "NVIDIA H200", "driver": "575.2", "onnxruntime": "1.31.1"},
        "doctor": DoctorSection("pass"),
        "boots": (ShapeBoot(512, 512, 1, True, 41.0), ShapeBoot(768, 768, 1, True, 52.0)),
        "placement": (SessionPlacement("unet", ("TensorrtExecutionProvider", "CUDAExecutionProvider"), 1200,
                                       ("/Shape", "/Div")),
                      SessionPlacement("vae_decoder", ("CUDAExecutionProvider",), 300)),
        "staging": (StagingBuffer("latents_in", 32768, 1), StagingBuffer("image_out", 786432, 1)),
        "copies": count_copies([_node("/conv_in/Conv", "Conv"), _event("Session", "model_run")], unet_runs=50),
        "relocation": RelocationSection("/tmp/a/engines", "/tmp/b/engines", loaded=True, engine_built_on_load=False),
        "protocol": ProtocolSection(JobStats.from_jobs(DURATIONS, [True] * 10), changed=("driver",)),
        "parity": parity_check(800.0, 820.0, band_percent=10.0, reference="H200"),
        "signature": SignatureSection(40, 97.0, 35.0, 130.0, "healthy_compute", "healthy compute"),
        "latency": LatencySection(LatencyRun("sdserve", 2.0, 0.105), LatencyRun("diffusers torch fp16", 15.0, 0.84)),
    }
    return AcceptReport(**{**fields, **overrides})


def test_passing_report_validates_and_summarizes() -> None:
    report = _report()
    assert report.ok and report.failing == ()
    data = report.as_dict()
    assert validate(data) == []
    assert json.loads(json.dumps(data)) == data  # plain JSON: lists, not tuples
    sections = dict.fromkeys(report.section_results(), True)
    assert data["verdict"] == {"status": "pass", "failing": [], "sections": sections}
    assert data["latency"]["speedup"] == pytest.approx(8.0)
    assert data["protocol"]["stats"]["jobs_per_hour"] == pytest.approx(800.0)
    md = report.to_markdown()
    assert "**Verdict: PASS**" in md
    assert "| protocol | pass | 10/10 jobs ok; mean 4.500 s, range 1.000 s (4.000-5.000); 800.0 jobs/h |" in md
    assert "| staging | pass | 2/2 staging buffers pinned |" in md
    assert "| boots | pass | 2/2 shapes booted strict (512x512x1, 768x768x1) |" in md


def test_schema_rejects_a_report_missing_a_section() -> None:
    data = _report().as_dict()
    del data["parity"]
    assert validate(data) == ["<root>: 'parity' is a required property"]


def test_schema_rejects_a_wrongly_typed_field() -> None:
    data = _report().as_dict()
    data["copies"]["per_step"] = "none"
    errors = validate(data)
    assert len(errors) == 1 and errors[0].startswith("copies/per_step: 'none' is not of type 'number'")


@pytest.mark.parametrize(("override", "section"), [
    ({"doctor": DoctorSection("fail", ("libcublasLt.so.13 missing",))}, "doctor"),
    ({"boots": (ShapeBoot(512, 512, 1, False, 3.0, ("self-test failed",)),)}, "boots"),
    ({"boots": ()}, "boots"),
    ({"placement": (SessionPlacement("unet", ("CUDAExecutionProvider",), 900, (), ("/down/Conv",)),)}, "placement"),
    ({"placement": (SessionPlacement("unet", ("CPUExecutionProvider",), 900),)}, "placement"),
    ({"staging": (StagingBuffer("latents_in", 32768, 1), StagingBuffer("image_out", 786432, 0))}, "staging"),
    ({"copies": count_copies(_cuda_profile_events(2), unet_runs=2)}, "copies"),
    ({"relocation": RelocationSection("/a", "/b", loaded=True, engine_built_on_load=True)}, "relocation"),
    ({"protocol": ProtocolSection(JobStats.from_jobs(DURATIONS, [True] * 9 + [False]))}, "protocol"),
    ({"parity": parity_check(600.0, 820.0, reference="H200")}, "parity"),
    ({"signature": SignatureSection(40, 98.0, 1.0, 38.0, "livelock", "livelock signature")}, "signature"),
    ({"latency": LatencySection(LatencyRun("sdserve", 20.0, 1.0), LatencyRun("diffusers", 15.0, 0.84))}, "latency"),
])
def test_each_failing_section_fails_the_report(override: dict[str, Any], section: str) -> None:
    report = _report(**override)
    assert report.failing == (section,)
    data = report.as_dict()
    assert validate(data) == []
    assert data["verdict"]["status"] == "fail" and data["verdict"]["sections"][section] is False
    md = report.to_markdown()
    assert f"**Verdict: FAIL ({section})**" in md
    assert f"| {section} | FAIL |" in md


def test_markdown_names_the_livelock_and_parity_lines() -> None:
    md = _report(signature=SignatureSection(40, 98.0, 1.0, 38.0, "livelock", "x"),
                 parity=parity_check(2000.0, 800.0, reference="H200")).to_markdown()
    assert "**Verdict: FAIL (parity, signature)**" in md
    assert "| signature | FAIL | livelock: SM 98%, memory controller 1%, 38 W (mean of 40 samples) |" in md
    assert "| parity | FAIL | 250.0% of baseline H200 (band ±10%): faster than the reference, not comparable |" in md


def test_relocation_and_latency_details() -> None:
    moved = RelocationSection("/a", "/b", loaded=False, engine_built_on_load=False, reasons=("manifest hash mismatch",))
    assert moved.summary() == "did not load after moving to /b; manifest hash mismatch"
    latency = LatencySection(LatencyRun("sdserve", 2.0, 0.105), LatencyRun("diffusers torch fp16", 15.0, 0.84))
    assert latency.summary() == ("512x512, 50 steps, batch 1: ours 0.105 s/image (2.0 ms/step) vs diffusers torch "
                                 "fp16 0.840 s/image (15.0 ms/step), x8.00")
    with pytest.raises(ValueError, match="timings must be positive"):
        LatencyRun("sdserve", 0.0, 0.1)


def test_copy_count_dict_carries_derived_numbers() -> None:
    count = CopyCount(3, 1, 0, 0, False, 40, 2, 2)
    assert (count.node_copies, count.per_step, count.ok) == (4, 2.0, False)
    data = _report(copies=count).as_dict()["copies"]
    assert (data["node_copies"], data["per_step"], data["ok"]) == (4, 2.0, False)
