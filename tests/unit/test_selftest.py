"""Self-test judgement on synthetic generators: sanity, fingerprints, SLO windows (no ORT)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engines.config import Canary, CanarySuite, SelfTestPlan, Shape, SloWindow
from engines.errors import SelfTestError
from engines.health import selftest
from engines.types.request import Batch, BatchResult, GeneratedImage

SUITE = CanarySuite(steps=4, canary=(Canary(name="a", prompt="a", seed=1), Canary(name="b", prompt="b", seed=2)))


def generator(offset: float = 0.0, constant: bool = False):  # type: ignore[no-untyped-def]
    def generate(batch: Batch) -> BatchResult:
        images = []
        for spec in batch.images:
            rng = np.random.default_rng(spec.seed)
            pixels = np.full((batch.height, batch.width, 3), 128, np.uint8) if constant else \
                np.clip(rng.integers(0, 256, (batch.height, batch.width, 3)) + offset, 0, 255).astype(np.uint8)
            images.append(GeneratedImage(Image.fromarray(pixels), spec.seed))
        return BatchResult(tuple(images), "CPUExecutionProvider", {"total": 0.0})
    return generate


def plan(**kw: object) -> SelfTestPlan:
    return SelfTestPlan(SUITE, (Shape(32, 32, 1), Shape(32, 32, 3)), (), **kw)  # type: ignore[arg-type]


def test_batches_cycle_canaries_with_distinct_seeds() -> None:
    batch = SUITE.batch(Shape(32, 32, 3))
    assert [s.prompt for s in batch.images] == ["a", "b", "a"]
    assert [s.seed for s in batch.images] == [1, 2, 2]


def test_recorded_fingerprints_pass_unchanged_and_name_the_canary_when_changed(tmp_path: Path) -> None:
    selftest.record(plan(), generator(), tmp_path)
    report = selftest.run(plan(), generator(), tmp_path)
    assert report.passed and all(d <= 1e-3 for s in report.shapes for d in s.distances.values())  # stored to 3 dp
    with pytest.raises(SelfTestError, match=r"32x32x1: canary 'a' fingerprint distance 40\.0 over tolerance 4\.0"):
        selftest.run(plan(), generator(offset=40), tmp_path)


def test_missing_fingerprints_are_refused_only_when_required(tmp_path: Path) -> None:
    assert selftest.run(plan(), generator(), tmp_path).fingerprints == "not recorded"
    with pytest.raises(SelfTestError, match="no canary fingerprints"):
        selftest.run(plan(require_fingerprints=True), generator(), tmp_path)


@pytest.mark.parametrize(("pixels", "problem"), [
    (np.zeros((32, 32, 3), np.uint8), "all-black image"),
    (np.random.default_rng(0).integers(0, 3, (32, 32, 3)).astype(np.uint8), "all-black image"),  # noise <= 2
    (np.full((32, 32, 3), 200, np.uint8), "constant image"),
    (np.random.default_rng(0).integers(0, 8, (32, 32, 3)).astype(np.uint8), None),  # dark, but an image
])
def test_sanity_refuses_black_and_constant_images(pixels: np.ndarray, problem: str | None) -> None:
    assert selftest.sanity(pixels) == problem


def test_black_canary_fails_the_self_test_naming_it(tmp_path: Path) -> None:
    def black(batch: Batch) -> BatchResult:
        images = tuple(GeneratedImage(Image.fromarray(np.zeros((batch.height, batch.width, 3), np.uint8)), s.seed)
                       for s in batch.images)
        return BatchResult(images, "CPUExecutionProvider")

    with pytest.raises(SelfTestError, match="32x32x1: canary 'a': all-black image"):
        selftest.run(plan(), black, tmp_path)


def test_constant_output_fails_sanity(tmp_path: Path) -> None:
    with pytest.raises(SelfTestError, match="canary 'a': constant image"):
        selftest.run(plan(), generator(constant=True), tmp_path)


def test_budget_and_gpu_floor_are_enforced(tmp_path: Path) -> None:
    windows = (SloWindow(size="32x32", batch=1, steps=4, budget_s=1e-9),
               SloWindow(size="32x32", batch=3, steps=4, budget_s=60, min_gpu_util_percent=50))
    strict = SelfTestPlan(SUITE, (Shape(32, 32, 1), Shape(32, 32, 3)), windows)
    with pytest.raises(SelfTestError) as info:
        selftest.run(strict, generator(), tmp_path)
    message = str(info.value)
    assert "32x32x1: p95" in message and "over budget 0.000s" in message
    assert "32x32x3: GPU utilization unknown% under floor 50.0%" in message


def test_window_requires_matching_steps() -> None:
    windows = (SloWindow(size="32x32", batch=1, steps=99, budget_s=1.0),)
    assert SelfTestPlan(SUITE, (), windows).window(Shape(32, 32, 1)) is None


def test_fingerprint_is_8x8_block_means() -> None:
    image = np.zeros((16, 16, 3), np.uint8)
    image[:8, :8] = 255
    thumb = selftest.fingerprint(image)
    assert thumb.shape == (8, 8, 3)
    assert thumb[0, 0, 0] == 255 and thumb[7, 7, 0] == 0


@pytest.mark.parametrize(("offset", "passes"), [(3, True), (6, False)])
def test_fingerprint_tolerance_is_the_boundary(tmp_path: Path, offset: float, passes: bool) -> None:
    """Just under the tolerance (4.0) passes, just over fails: a looser comparison would let small drifts through."""
    selftest.record(plan(), generator(), tmp_path)
    if passes:
        assert selftest.run(plan(), generator(offset=offset), tmp_path).passed
    else:
        with pytest.raises(SelfTestError, match="fingerprint distance 6.0 over tolerance 4.0"):
            selftest.run(plan(), generator(offset=offset), tmp_path)
