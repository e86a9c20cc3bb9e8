"""The memory a large request takes goes back after it, and the estimate admission refuses by bounds it (issue 43,
item 2), on the real tiny model with ONNX Runtime on the CPU.

Every CPU session shares one arena (engines/runtime/buffers.py ``host_arena``); after the large stages of a large
batch, ``memory.enable_memory_arena_shrinkage`` (the run option of
include/onnxruntime/core/session/onnxruntime_run_options_config_keys.h, applied by InferenceSession's
ShrinkMemoryArenas in onnxruntime/core/session/inference_session.cc) frees the regions they grew. Before this, a
tiny-model server held 7.2 GB after 1024x1024 Hires fix requests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.factory import create_engine
from engines.protocol import Engine
from engines.runtime import buffers
from engines.types.request import Batch, ImageSpec
from server.admission import resident_bytes
from server.settings import load_settings

LARGE = (768, 768)
"""A size whose estimate (about 1 GiB on the tiny model) is far above the trim threshold and the RSS noise, yet
runs in seconds on two cores."""


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Engine]:
    built = create_engine(tiny_model, load_settings("dev").runtime)
    built.preflight()
    built.load()
    built.generate(Batch((ImageSpec("warm", seed=1),), 64, 64, 2))  # the small shapes' arena, as after boot
    yield built
    built.close()


class Peak:
    """The largest resident size seen while the block runs (sampled every millisecond)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.bytes = max(self.bytes, resident_bytes())
            self._done.wait(0.001)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(10)


def _large(engine: Engine) -> tuple[int, int, int]:
    """(resident before, peak, resident after) of one large request, in bytes."""
    before = resident_bytes()
    with Peak() as peak:
        engine.generate(Batch((ImageSpec("large", seed=2),), *LARGE, 2))
    return before, peak.bytes, resident_bytes()


def test_a_large_request_gives_its_memory_back_and_stays_under_its_estimate(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = engine.info.memory
    assert memory is not None
    estimate = memory.need(*LARGE, 1, 1).peak_bytes
    assert estimate >= buffers.TRIM_ABOVE_BYTES  # a large batch by the runtime's own rule

    with monkeypatch.context() as untrimmed:  # the control: the same request with the threshold out of reach
        untrimmed.setattr(buffers, "TRIM_ABOVE_BYTES", 1 << 62)
        before, peak, after = _large(engine)
    assert after - before > 0.5 * (peak - before), "without the shrink the arena keeps what the request took"

    before, peak, after = _large(engine)  # the arena still holds the control's regions: the shrink frees them
    grew = peak - before
    assert after - before < 0.2 * max(grew, 1) + (64 << 20), (
        f"after a large request the process still holds {(after - before) >> 20} MiB of its {grew >> 20} MiB")
    assert after < before, "the shrink did not return the regions the untrimmed request left"

    fresh_before, fresh_peak, fresh_after = _large(engine)  # from a trimmed arena: the request's own peak
    assert fresh_peak - fresh_before <= estimate, (
        f"measured {(fresh_peak - fresh_before) >> 20} MiB over the estimate {estimate >> 20} MiB")
    assert fresh_peak - fresh_before > estimate // 3, "the estimate is no bound worth the name"
    assert fresh_after - fresh_before < 128 << 20


def test_the_decoder_keeps_its_arena_for_a_small_request(engine: Engine) -> None:
    """Below the threshold nothing is shrunk: small requests keep reusing their arena (no page faults per
    request); the 64x64 canary size leaves no growth to return."""
    memory = engine.info.memory
    assert memory is not None and memory.need(256, 256, 1, 1).peak_bytes < buffers.TRIM_ABOVE_BYTES
    engine.generate(Batch((ImageSpec("small", seed=3),), 256, 256, 2))
    held = resident_bytes()
    engine.generate(Batch((ImageSpec("small", seed=4),), 256, 256, 2))
    assert abs(resident_bytes() - held) < 32 << 20, "a small request's arena changed size between two runs"
