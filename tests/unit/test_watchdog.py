"""The watchdog's state machine on the fake engine and a scripted telemetry source (no sleeps to wait out).

Every trigger is checked where an operator sees it: the server state that /ready answers from, and the Prometheus
exposition (`sdserve_ready`, `sdserve_degraded{reason}`) read back through prometheus-client, then recovery."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engines.errors import InferenceError
from engines.runtime.ortlog import classify
from engines.types.health import GpuSample
from server.contention import Contention, ContentionProbe, Counters
from server.metrics import DEGRADED_REASONS, Metrics
from server.service import ImageService
from server.settings import load_settings
from server.state import ServerState
from server.watchdog import TraceTelemetry, Watchdog
from tests.unit.fakes import FakeEngine

LIVELOCK = [GpuSample(98, 0, 38, 300)]
HEALTHY = [GpuSample(97, 30, 130, 300)]
GPU_IDLE = [GpuSample(0, 0, 60, 300)]
"""Nothing runs on the GPU: fine when no request runs, CPU fallback suspected when one does."""


def make() -> tuple[Watchdog, FakeEngine, ServerState]:
    settings = load_settings("dev")
    settings = settings.model_copy(update={"watchdog": settings.watchdog.model_copy(
        update={"idle_before_canary_s": 0.0, "telemetry_window_s": 0.1, "recover_after": 2,
                "canary_max_skips": 1})})
    engine = FakeEngine()
    engine.load()
    state = ServerState()
    state.set("ready")
    metrics = Metrics()
    metrics.ready.set(1)  # as boot leaves it
    dog = Watchdog(engine, ImageService(engine, settings, metrics, state), state, settings, metrics)
    return dog, engine, state


def exposed(dog: Watchdog) -> dict[str, float]:
    """`sdserve_ready` and every `sdserve_degraded{reason}` as the /metrics text shows them."""
    text = generate_latest(dog.metrics.registry).decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sdserve_ready":
                values["ready"] = sample.value
            elif sample.name == "sdserve_degraded":
                values[sample.labels["reason"]] = sample.value
    return values


def check(dog: Watchdog, times: int = 1) -> None:
    for _ in range(times):
        asyncio.run(dog.check())


def assert_degraded_only_by(dog: Watchdog, state: ServerState, reason: str, fragment: str) -> None:
    assert state.state == "degraded" and not state.ready
    assert any(fragment in r for r in state.reasons), state.reasons
    assert exposed(dog) == {"ready": 0.0, **{r: float(r == reason) for r in DEGRADED_REASONS}}


def assert_recovered(dog: Watchdog, state: ServerState) -> None:
    assert state.state == "ready" and state.ready
    assert exposed(dog) == {"ready": 1.0, **dict.fromkeys(DEGRADED_REASONS, 0.0)}
    assert [t.state for t in state.history][-3:] == ["ready", "degraded", "ready"]


class ScriptedProbe(ContentionProbe):
    """Contention as scripted by the test (the real probe reads /proc; its parsing is tested on its own)."""

    def __init__(self, pressure: float | None = 0.0, gpu_others: int | None = None) -> None:
        super().__init__()
        self.pressure, self.gpu_others = pressure, gpu_others

    def since(self, start: Counters) -> Contention:
        return Contention(1.0, self.pressure, 0.0, 0.5, self.gpu_others)


def corroborating(dog: Watchdog) -> Watchdog:
    """The production policy on the dev fake: latency may flip /ready when nothing on the node explains it."""
    cfg = dog.settings.watchdog.model_copy(update={"latency_unready": "corroborated", "drift_factor": 2.0,
                                                   "unready_drift_factor": 5.0, "drift_consecutive": 2})
    dog.settings = dog.settings.model_copy(update={"watchdog": cfg})
    dog.slowness.cfg = cfg
    return dog


def test_dev_never_turns_unready_on_latency_alone_but_reports_it() -> None:
    dog, engine, state = make()
    dog.probe = ScriptedProbe(pressure=0.0)  # not even uncontended slowness flips dev
    engine.latency_s = 1.0  # canary reports 1.01 s vs a 0.01 s baseline: x101
    check(dog, 5)
    assert state.state == "ready" and exposed(dog)["ready"] == 1.0
    load = dog.load
    assert load["slow"] is True and load["slowdown_ratio"] > 100 and load["latency_unready"] == "never"
    assert load["canary_ms_per_step"] == pytest.approx(505.0)  # 1.01 s over the canary's 2 steps
    text = generate_latest(dog.metrics.registry).decode()
    assert "sdserve_slow 1.0" in text and "sdserve_canary_slowdown_ratio 101.0" in text


def test_corroborated_latency_drift_needs_consecutive_uncontended_strikes_and_recovers() -> None:
    dog, engine, state = make()
    corroborating(dog).probe = ScriptedProbe(pressure=0.0)
    engine.latency_s = 1.0
    check(dog)
    assert state.state == "ready" and dog.slowness.hard_streak == 1 and exposed(dog)["ready"] == 1.0
    check(dog)
    assert_degraded_only_by(dog, state, "latency_drift", "no contention observed")
    engine.latency_s = 0.0
    check(dog)
    assert state.state == "degraded"  # one clean check is not enough (recover_after = 2)
    check(dog)
    assert_recovered(dog, state)


@pytest.mark.parametrize(("probe", "explained"), [(ScriptedProbe(pressure=80.0), "host CPU pressure 80%"),
                                                  (ScriptedProbe(gpu_others=2), "2 other process(es) on the GPU")])
def test_slowness_explained_by_contention_never_flips_even_when_corroboration_is_asked(
        probe: ScriptedProbe, explained: str) -> None:
    dog, engine, state = make()
    corroborating(dog).probe = probe
    engine.latency_s = 1.0
    check(dog, 5)
    assert state.state == "ready" and dog.load["slow"] is True
    assert any(explained in e for e in dog.load["explained_by"]) and dog.load["contended"] is True
    assert "sdserve_contention 1.0" in generate_latest(dog.metrics.registry).decode()


def test_provider_change_since_boot_is_evidence_and_recovers() -> None:
    dog, engine, state = make()
    dog.expect_provider("FakeExecutionProvider")
    check(dog)
    assert state.state == "ready"
    engine.provider = "CPUExecutionProvider"
    check(dog)
    assert_degraded_only_by(dog, state, "provider_changed", "CPUExecutionProvider runs the UNet")
    engine.provider = "FakeExecutionProvider"
    check(dog, 2)
    assert_recovered(dog, state)


def test_a_canary_the_pipeline_refuses_is_invalid_output_not_a_crashed_check() -> None:
    dog, engine, state = make()
    engine.canary_error = InferenceError("the VAE produced NaN/inf values")
    check(dog)
    assert_degraded_only_by(dog, state, "canary_invalid", "canary failed: the VAE produced NaN/inf")
    engine.canary_error = None
    check(dog, 2)
    assert_recovered(dog, state)


def test_output_drift_after_boot_degrades_at_once_and_recovers() -> None:
    dog, engine, state = make()
    engine.drift_distance = 4.0  # at the tolerance: not drift
    check(dog)
    assert state.state == "ready"
    engine.drift_distance = 9.5
    check(dog)
    assert_degraded_only_by(dog, state, "output_drift", "fingerprint distance 9.5 over tolerance 4.0")
    engine.drift_distance = 0.0
    check(dog)
    assert state.state == "degraded"
    check(dog)
    assert_recovered(dog, state)


def test_invalid_canary_output_degrades_and_recovers() -> None:
    dog, engine, state = make()
    engine.canary_problem = "all-black image"
    check(dog)
    assert_degraded_only_by(dog, state, "canary_invalid", "canary output invalid: all-black image")
    engine.canary_problem = None
    check(dog, 2)
    assert_recovered(dog, state)


ENGINE_REBUILD = "[W:onnxruntime:, tensorrt_execution_provider.cc:2385] [TensorRT EP] Engine will be built"
ARENA = "[I:onnxruntime:, bfc_arena.cc:347 AllocateRawInternal] Extending BFCArena for Cuda. bin_num:20"


def test_classified_ort_error_line_after_boot_degrades_and_counts_then_recovers() -> None:
    dog, engine, state = make()
    engine.pending_events = classify([ARENA])  # info: counted, not a degradation
    check(dog)
    assert state.state == "ready"
    engine.pending_events = classify([ENGINE_REBUILD])
    assert [e.severity for e in engine.pending_events] == ["error"]  # the real classifier says so, not the test
    check(dog)
    assert_degraded_only_by(dog, state, "ort_event", "ONNX Runtime after boot: engine_rebuild")
    text = generate_latest(dog.metrics.registry).decode()
    assert 'sdserve_ort_events_total{kind="engine_rebuild"} 1.0' in text
    assert 'sdserve_ort_events_total{kind="arena_growth"} 1.0' in text
    check(dog, 2)  # the tee is drained: nothing new was printed
    assert_recovered(dog, state)


def test_gpu_idle_while_requests_run_is_suspected_fallback_and_recovers() -> None:
    dog, engine, state = make()
    dog.injected = TraceTelemetry(GPU_IDLE)
    check(dog)
    assert state.state == "ready" and dog.last["signature"]["verdict"] == "idle"  # idle GPU, no request: fine
    dog.service.batcher.running = 1  # a batch is executing while the GPU reads idle
    check(dog)
    assert_degraded_only_by(dog, state, "fallback_suspected", "GPU idle while requests run")
    dog.service.batcher.running = 0
    check(dog, 2)
    assert_recovered(dog, state)


@pytest.mark.parametrize(("trace", "verdict", "fragment"), [(LIVELOCK, "livelock", "livelock signature")])
def test_signature_from_injected_trace(trace: list[GpuSample], verdict: str, fragment: str) -> None:
    dog, _, state = make()
    dog.injected = TraceTelemetry(trace)
    check(dog)
    assert_degraded_only_by(dog, state, verdict, fragment)
    dog.injected = TraceTelemetry(HEALTHY)
    check(dog, 2)
    assert_recovered(dog, state)


def test_canary_yields_to_traffic_but_at_most_canary_max_skips_checks_in_a_row() -> None:
    dog, engine, _ = make()
    dog.service.batcher.running = 1  # a batch is executing (and stays so: traffic never stops)
    check(dog)
    assert engine.batches == [] and dog.checks == 1
    check(dog)  # canary_max_skips = 1: this one runs between two batches, so output faults are still caught
    assert len(engine.batches) == 1 and dog.checks == 2
