"""The signature classifier on the field's numbers (livelock vs healthy compute on the same card)."""

from __future__ import annotations

import pytest

from engines.config import SignatureThresholds
from engines.health.signature import classify
from engines.types.health import GpuSample

LIMIT_W = 300.0  # an A10-class card; healthy work on it drew 115-143 W


def samples(sm: tuple[float, ...], mem: tuple[float, ...], power: tuple[float, ...]) -> list[GpuSample]:
    return [GpuSample(s, m, p, LIMIT_W) for s, m, p in zip(sm, mem, power, strict=True)]


def test_livelock_signature() -> None:
    result = classify(samples((96, 99, 98, 97), (0, 1, 0, 1), (38, 38, 37, 39)), requests_running=True)
    assert result.verdict == "livelock"
    assert "SM 98%" in result.reason and "38 W" in result.reason


def test_healthy_compute_on_the_same_card() -> None:
    result = classify(samples((96, 99, 97, 98), (18, 41, 30, 25), (115, 143, 130, 128)), requests_running=True)
    assert result.verdict == "healthy_compute"


def test_gpu_idle_while_requests_run_is_fallback_suspected() -> None:
    result = classify(samples((5, 4, 6, 5), (1, 0, 1, 1), (60, 61, 60, 59)), requests_running=True)
    assert result.verdict == "fallback_suspected"
    assert classify(samples((5, 4, 6, 5), (1, 0, 1, 1), (60, 61, 60, 59)), requests_running=False).verdict == "idle"


def test_memory_bound() -> None:
    assert classify(samples((70, 72), (80, 85), (200, 210)), requests_running=True).verdict == "memory_bound"


def test_thresholds_come_from_config() -> None:
    # A card whose measured working draw is 60 W: 38 W is no longer "far below" it at fraction 0.5.
    strict = SignatureThresholds(working_power_w=60.0)
    busy_low_mem = samples((97, 98), (1, 1), (38, 38))
    assert classify(busy_low_mem, True, strict).verdict == "healthy_compute"
    assert classify(busy_low_mem, True, SignatureThresholds(working_power_w=130.0)).verdict == "livelock"


def test_no_samples_is_inconclusive() -> None:
    assert classify([], True).verdict == "inconclusive"


@pytest.mark.parametrize("sm", [95.0, 100.0])
def test_busy_boundary_is_inclusive(sm: float) -> None:
    assert classify(samples((sm,), (0,), (30,)), True).verdict == "livelock"
