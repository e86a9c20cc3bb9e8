"""The watchdog's state machine on the fake engine and a scripted telemetry source (no sleeps to wait out)."""

from __future__ import annotations

import asyncio

import pytest

from engines.protocol import GpuSample
from server.metrics import Metrics
from server.service import ImageService
from server.settings import load_settings
from server.state import ServerState
from server.watchdog import TraceTelemetry, Watchdog
from tests.unit.fakes import FakeEngine

LIVELOCK = [GpuSample(98, 0, 38, 300)]
HEALTHY = [GpuSample(97, 30, 130, 300)]


def make() -> tuple[Watchdog, FakeEngine, ServerState]:
    settings = load_settings("dev")
    settings = settings.model_copy(update={"watchdog": settings.watchdog.model_copy(
        update={"idle_before_canary_s": 0.0, "telemetry_window_s": 0.1})})
    engine = FakeEngine()
    engine.load()
    state = ServerState()
    state.set("ready")
    metrics = Metrics()
    dog = Watchdog(engine, ImageService(engine, settings, metrics, state), state, settings, metrics)
    return dog, engine, state


def test_latency_drift_needs_consecutive_strikes_and_recovers_after_clean_checks() -> None:
    dog, engine, state = make()
    engine.latency_s = 1.0  # canary reports 1.01 s vs a 0.01 s baseline
    asyncio.run(dog.check())
    assert state.state == "ready" and dog.strikes == 1
    asyncio.run(dog.check())
    assert state.state == "degraded" and "latency drift" in state.reasons[0]
    engine.latency_s = 0.0
    asyncio.run(dog.check())
    assert state.state == "degraded"  # one clean check is not enough (recover_after = 2)
    asyncio.run(dog.check())
    assert state.state == "ready"
    assert [t.state for t in state.history][-3:] == ["ready", "degraded", "ready"]


@pytest.mark.parametrize(("trace", "verdict"), [(LIVELOCK, "livelock")])
def test_signature_from_injected_trace(trace: list[GpuSample], verdict: str) -> None:
    dog, _, state = make()
    dog.injected = TraceTelemetry(trace)
    asyncio.run(dog.check())
    assert state.state == "degraded" and verdict in dog.active
    dog.injected = TraceTelemetry(HEALTHY)
    asyncio.run(dog.check())
    asyncio.run(dog.check())
    assert state.state == "ready"


def test_canary_yields_to_traffic() -> None:
    dog, engine, _ = make()
    dog.service.batcher.running = 1  # a batch is executing
    asyncio.run(dog.check())
    assert engine.batches == [] and dog.checks == 1
