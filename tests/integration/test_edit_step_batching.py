"""Step-level batching with instruction-edit rows (issue 55, item 4) on the tiny FLUX.1 Kontext [dev] build
(engines/build/kontext.py), on real ONNX Runtime CPU sessions (onnxruntime/core/providers/cpu; engines/engine.py
begin/tick/finish): an edit row joining a running set of the same shape gets its solo image (within 1/255), in the
same run as the alone figures. The rows' reference tokens go after their noisy ones (engines/pipelines/flow_extra.py):
edits whose references have one shape share each transformer call, a set of generations and an edit joining it run
one call per group (``by_extra``) in the same tick. Kontext's preferred-resolution table is narrowed to small
entries for this test (the reference tokens' count does not change the joining; the full table's 1024² references
are the parity tests' and the e2e's), so the runs stay seconds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engines.engine import OrtEngine
from engines.pipelines import kontext
from engines.types.request import Batch, EditImage, ImageSpec
from tests.integration.test_step_batching import _close, _engine, _pixels, _run_joined

pytestmark = pytest.mark.slow
SMALL = ((96, 64), (64, 64), (64, 96))
"""(width, height) the references resize to here: 24 or 16 reference tokens beside a 64x64 image's 16."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> OrtEngine:
    from engines.build.kontext import build_tiny_kontext

    return _engine(build_tiny_kontext(tmp_path_factory.mktemp("kontext") / "onnx"))


@pytest.fixture(autouse=True)
def small_references(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kontext, "PREFERRED_KONTEXT_RESOLUTIONS", SMALL)


def _picture(width: int, height: int, phase: float) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([127 + 120 * np.sin(x / 5.0 + phase), 127 + 120 * np.cos(y / 4.0 - phase),
                       (x * 3 + y + 40 * phase) % 256], axis=-1)
    return pixels.clip(0, 255).astype(np.uint8)


def _edit(prompt: str, seed: int, steps: int, reference: np.ndarray, n: int = 1) -> Batch:
    edit = EditImage(_picture(64, 64, 0.0), references=(reference,))
    return Batch(tuple(ImageSpec(f"{prompt} {k}", seed=seed + k, guidance_scale=3.5, edit=edit) for k in range(n)),
                 64, 64, steps, "euler")


def _joins(engine: OrtEngine, long: Batch, later: Batch) -> dict[str, int]:
    alone_long, alone_later = engine.generate(long), engine.generate(later)
    joined_long, joined_later = _run_joined(engine, long, later, join_after=2)
    assert joined_long.steps_done == long.steps and joined_later.steps_done == later.steps
    figures = {"joined row vs alone": _close(joined_later, alone_later),
               "running set vs alone": _close(joined_long, alone_long)}
    assert figures["joined row vs alone"] <= 1 and figures["running set vs alone"] <= 1, figures
    assert np.abs(_pixels(joined_later)[0] - _pixels(joined_long)[0]).max() > 8, "two requests, two images"
    return figures


def test_an_edit_row_joining_a_running_set_of_edits_gets_its_solo_image(engine: OrtEngine) -> None:
    """A 2-image 5-step edit of one input runs; a 3-step edit of another input of the same aspect (its reference
    tokens of the same shape: one transformer call for all rows) joins at tick 2."""
    assert engine.info.family == "flux-kontext" and engine.info.instruct_images == 1
    stages = engine.pipeline.stepwise()
    assert stages is not None and stages.joinable(), "the step graph takes a row per image"
    long = _edit("put a hat on it", 10, 5, _picture(90, 60, 0.0), n=2)
    later = _edit("make it night", 40, 3, _picture(120, 80, 2.0))
    assert long.mode == later.mode == "instruct" and engine.step_key(long) == engine.step_key(later)
    figures = _joins(engine, long, later)
    print(f"\nkontext step batching, edit joins edits (max |diff| /255): {figures}")


def test_an_edit_row_joining_a_running_set_of_generations_gets_its_solo_image(engine: OrtEngine) -> None:
    """A 2-image 5-step generation runs; an edit (a square input: 16 reference tokens) joins at tick 2; then the
    other way round, a generation joins a running edit. Each gets its solo image."""
    generation = Batch(tuple(ImageSpec(f"a lighthouse {k}", seed=20 + k, guidance_scale=3.5) for k in range(2)),
                       64, 64, 5, "euler")
    edit = _edit("make it blue", 50, 3, _picture(48, 48, 1.0))
    first = _joins(engine, generation, edit)
    second = _joins(engine, dataclasses.replace(edit, steps=5), dataclasses.replace(generation, steps=3))
    print(f"\nkontext step batching, edit joins generations {first}; generation joins an edit {second}")


def test_an_edit_takes_the_output_step_cache(engine: OrtEngine) -> None:
    """The output-level step cache (engines/numerics/step_cache.py) on an instruction edit: evaluations are reused
    and the image stays within the gate's bound of the uncached edit (PSNR >= 30 dB), the reference tokens in every
    computed call."""
    from server.caching import psnr_db
    from tests.integration.test_step_cache import CACHE

    plain = _edit("put a hat on it", 10, 20, _picture(90, 60, 0.0))
    cached = dataclasses.replace(plain, cache=CACHE)
    alone, reused = engine.generate(plain), engine.generate(cached)
    assert reused.cache is not None and reused.cache.reused > 0, reused.cache
    assert psnr_db(_pixels(alone)[0], _pixels(reused)[0]) >= 30.0
