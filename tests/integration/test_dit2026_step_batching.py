"""Step-level batching on the 2026 families (issue 54): a FLUX.2 [klein] or Z-Image-Turbo request's image is the same
(within 1/255) whether it ran alone or joined a running set mid-way on the tiny faithful builds
(engines/build/flux2.py, engines/build/zimage.py), on real ONNX Runtime CPU sessions
(onnxruntime/core/providers/cpu; engines/engine.py begin/tick/finish, engines/numerics/rows.py). The rows differ in
prompt, seed, step count (FLUX.2's schedule shifts by an ``mu`` of the step count, so each row keeps its own sigmas)
and, on Z-Image, in CFG: a row with a guidance scale and a negative prompt joins rows without CFG."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engines.engine import OrtEngine
from engines.types.request import Batch, EditImage, ImageSpec
from tests.integration.test_step_batching import _close, _engine, _pixels, _run_joined

pytestmark = pytest.mark.slow

Builder = Callable[[str], tuple[Path, Path]]


def _batch(prompt: str, seed: int, steps: int, size: int, guidance: float, n: int = 1,
           negative: str = "") -> Batch:
    return Batch(tuple(ImageSpec(f"{prompt} {k}", negative, seed + k, guidance) for k in range(n)), size, size,
                 steps, "euler")


def _joins(engine: OrtEngine, long: Batch, later: Batch) -> None:
    """``later`` joins ``long`` after two ticks; both get their solo images and step counts (an img2img row runs
    ``int(steps * strength)``)."""
    stages = engine.pipeline.stepwise()
    assert stages is not None and stages.joinable(), "the step graph takes a row per image"
    alone_long, alone_later = engine.generate(long), engine.generate(later)
    joined_long, joined_later = _run_joined(engine, long, later, join_after=2)
    assert joined_long.steps_done == long.steps and joined_later.steps_done == alone_later.steps_done
    assert [g.seed for g in joined_later.images] == [g.seed for g in alone_later.images]
    assert _close(joined_later, alone_later) <= 1
    assert _close(joined_long, alone_long) <= 1
    assert np.abs(_pixels(joined_later)[0] - _pixels(joined_long)[0]).max() > 8, "two requests, two images"


def test_a_flux2_klein_row_joining_mid_way_gets_its_solo_image(dit_build: Builder) -> None:
    """The distilled klein build (no CFG at any scale): a 2-image 6-step request runs; a 3-step request with other
    prompts and seeds joins at tick 2, its sigmas shifted by its own step count's ``mu``."""
    engine = _engine(dit_build("flux2-klein")[0])
    assert engine.info.family == "flux2-klein"
    size = engine.pipeline.default_size
    long = _batch("a lighthouse at dusk", 10, 6, size, 1.0, n=2)
    _joins(engine, long, _batch("a red cube on a table", 40, 3, size, 1.0))


def test_z_image_turbo_rows_joining_mid_way_get_their_solo_images(dit_build: Builder) -> None:
    """Z-Image-Turbo: a 2-image request without CFG (guidance 0, the Turbo default) runs; a request with guidance
    2.5 and a negative prompt (its CFG rows: ``pos + g (pos - neg)``) joins at tick 2, then an img2img row does
    (ZImageImg2ImgPipeline's start step) — each gets its solo image."""
    engine = _engine(dit_build("z-image-turbo")[0])
    assert engine.info.family == "z-image-turbo"
    size = engine.pipeline.default_size
    long = _batch("a lighthouse at dusk", 10, 6, size, 0.0, n=2)
    _joins(engine, long, _batch("a red cube on a table", 40, 3, size, 2.5, negative="blurry"))
    y, x = np.mgrid[0:size, 0:size]
    picture = np.stack([x * 255 // size, y * 255 // size, np.full_like(x, 90)], -1).astype(np.uint8)
    edit = dataclasses.replace(_batch("a watercolour", 5, 5, size, 0.0), strength=0.6,
                               images=(ImageSpec("a watercolour", seed=5, guidance_scale=0.0,
                                                 edit=EditImage(picture)),))
    _joins(engine, long, edit)


def test_a_flux2_dev_row_with_its_own_embedded_guidance_joins_and_gets_its_solo_image(dit_build: Builder) -> None:
    """FLUX.2 [dev]: the guidance is a transformer input per row (embedded, no CFG): a 2-image request at 4.0 runs,
    a request at 2.0 with other prompts, seeds and step count joins at tick 2; each keeps its own guidance."""
    engine = _engine(dit_build("flux2-dev")[0])
    assert engine.info.family == "flux2-dev"
    size = engine.pipeline.default_size
    long = _batch("a lighthouse at dusk", 10, 6, size, 4.0, n=2)
    later = _batch("a red cube on a table", 40, 4, size, 2.0)
    _joins(engine, long, later)
    other = engine.generate(dataclasses.replace(later, images=tuple(
        dataclasses.replace(s, guidance_scale=4.0) for s in later.images)))
    assert np.abs(_pixels(other)[0] - _pixels(engine.generate(later))[0]).max() > 0, "the guidance is an input"
