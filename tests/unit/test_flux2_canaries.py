"""FLUX.2 [klein]'s canary tables (configs/canaries.toml, read by engines/config.py ``load_canaries``): the
step-distilled checkpoint's canaries run its 4 steps at guidance 1.0 (no CFG), the base checkpoint's the global 8
steps at its guidance 4.0; both keep the shared prompts and seeds."""

from __future__ import annotations

from engines.config import Shape, load_canaries
from server.settings import CONFIG_DIR


def test_flux2_klein_canary_tables() -> None:
    suite = load_canaries(CONFIG_DIR / "canaries.toml")
    distilled, base = suite.for_family("flux2-klein"), suite.for_family("flux2-klein-base")
    assert (distilled.steps, distilled.guidance_scale, distilled.canary) == (4, 1.0, suite.canary)
    assert (base.steps, base.guidance_scale, base.canary) == (suite.steps, 4.0, suite.canary) and suite.steps == 8
    batch = distilled.batch(Shape(64, 64, 2))
    assert batch.steps == 4 and {i.guidance_scale for i in batch.images} == {1.0}
