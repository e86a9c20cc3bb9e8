"""Admission's scaling to an unmeasured size follows the family's own work per step (server/admission.py
CostModel.scale_by; engines/protocol.py ModelInfo.work): a UNet by pixels, a DiT by its joint-attention tokens."""

from __future__ import annotations

import pytest

from engines.types.model import ModelInfo
from server.admission import Cost, CostModel

UNET = ModelInfo("sd15", 8, 512, ("euler",), 77)
FLUX = ModelInfo("flux-dev", 16, 1024, ("euler",), 77, family="flux", token_patch=16, text_tokens=512,
                 hidden_size=3072)


def test_a_unet_scales_by_pixels() -> None:
    assert UNET.work(1024, 1024) / UNET.work(512, 512) == 4.0
    assert UNET.work_basis == "pixel count"


def test_a_dit_grows_slower_than_pixels_at_small_sizes_and_faster_at_large_ones() -> None:
    # 512 text tokens dominate a small image; joint attention (2N^2) dominates a large one.
    assert 2.0 < FLUX.work(1024, 1024) / FLUX.work(512, 512) < 4.0
    assert FLUX.work(4096, 4096) / FLUX.work(2048, 2048) > 4.0
    n = (1024 // 16) ** 2 + 512
    assert FLUX.work(1024, 1024) == n * (12 * 3072 + 2 * n)


def test_the_cost_model_scales_an_unmeasured_size_by_the_models_work() -> None:
    model = CostModel()
    model.scale_by(FLUX.work, FLUX.work_basis)
    model.seed(1024, 1024, 1, 10, 2.0)  # 0.2 s per image-step measured at 1024x1024
    estimate = model.estimate(Cost(512, 512, 10, 1))
    assert estimate is not None and "joint-attention tokens" in estimate.basis
    assert estimate.seconds == pytest.approx(2.0 * FLUX.work(512, 512) / FLUX.work(1024, 1024))
    pixels = CostModel()  # the default (a UNet): a quarter of the pixels, a quarter of the cost
    pixels.seed(1024, 1024, 1, 10, 2.0)
    unet = pixels.estimate(Cost(512, 512, 10, 1))
    assert unet is not None and unet.seconds == pytest.approx(0.5) and unet.seconds < estimate.seconds


def test_each_family_is_judged_by_its_own_slo_windows() -> None:
    """configs/slo.toml: a Flux model at 512x512 is not judged by SD 1.5's 0.5 s window (before, every family got
    SD 1.5's, and a Flux self-test failed on latency); at its native size it gets its own."""
    import dataclasses

    from engines.config import SelfTestPlan, Shape, load_canaries, load_slo
    from server.settings import CONFIG_DIR

    slo = load_slo(CONFIG_DIR / "slo.toml", "production")
    suite = load_canaries(CONFIG_DIR / "canaries.toml")
    plan = SelfTestPlan(suite, (), slo)
    sd1 = dataclasses.replace(plan, suite=suite.for_family("sd1"), family="sd1")
    flux = dataclasses.replace(plan, suite=suite.for_family("flux"), family="flux")
    window = sd1.window(Shape(512, 512, 1))
    assert window is not None and window.family is None and window.budget_s == 0.5
    assert flux.window(Shape(512, 512, 1)) is None  # reported as "no budget", never SD 1.5's
    own = flux.window(Shape(1024, 1024, 1))
    assert own is not None and own.family == "flux" and own.budget_s > window.budget_s
    schnell = dataclasses.replace(plan, suite=suite.for_family("flux-schnell"), family="flux-schnell")
    assert schnell.suite.steps == 4 and schnell.window(Shape(1024, 1024, 1)) is not None
    assert suite.for_family("flux").guidance_scale == 3.5 and suite.for_family("sd35").guidance_scale == 4.5
    families = {w.family for w in slo if w.family}
    assert families <= set(suite.family)  # every family with windows has its canary table


@pytest.mark.parametrize("profile", ["production", "cuda"])
def test_the_2026_families_have_windows_at_their_native_size_for_their_canary_steps(profile: str) -> None:
    """Issue 54: FLUX.2 [klein] and Z-Image are judged by windows of their own in both GPU profiles, at 1024x1024
    and the steps their canary tables run (configs/canaries.toml: a window at other steps would never match)."""
    import dataclasses

    from engines.config import SelfTestPlan, Shape, load_canaries, load_slo
    from server.settings import CONFIG_DIR

    suite = load_canaries(CONFIG_DIR / "canaries.toml")
    plan = SelfTestPlan(suite, (), load_slo(CONFIG_DIR / "slo.toml", profile))
    for family in ("flux2-klein", "flux2-klein-base", "z-image-turbo", "z-image"):
        own = dataclasses.replace(plan, suite=suite.for_family(family), family=family)
        window = own.window(Shape(1024, 1024, 1))
        assert window is not None and window.family == family, family
        assert window.steps == own.suite.steps and window.min_gpu_util_percent is not None, family
