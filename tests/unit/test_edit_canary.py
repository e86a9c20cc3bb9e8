"""The instruction edit canary's definition (issue 55, item 4): configs/canaries.toml gives the instruction-edit
families ([family.<name>.edit]) an edit canary on a fixed input image; a model of the family that does not edit
(no VAE encoder) drops it; the self-test runs it once per served size as an instruction edit (behind the engine
protocol: a generate that records its batches), reports it apart from the timed shapes, and a recording made
before the edit canary existed still matches the suite. The real run on the tiny Kontext model:
tests/integration/test_edit_canary.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from engines.config import SelfTestPlan, Shape, load_canaries
from engines.health import selftest
from engines.types.request import Batch, BatchResult, GeneratedImage
from server.settings import CONFIG_DIR


def test_the_shipped_edit_canaries_and_a_model_that_does_not_edit() -> None:
    suite = load_canaries(CONFIG_DIR / "canaries.toml")
    for family in ("flux-kontext", "qwen-image-edit"):
        edit = suite.for_family(family).edit
        assert edit is not None and (edit.name, edit.image, edit.steps) == ("hat", 64, 2), family
        assert suite.for_family(family, edits=False).edit is None
    assert suite.for_family("flux").edit is None and suite.edit is None


def test_the_fixed_input_image_is_one_picture_at_every_size() -> None:
    small, large = selftest.canary_input(64, 64), selftest.canary_input(256, 192)
    assert small.dtype == np.uint8 and small.shape == (64, 64, 3) and large.shape == (192, 256, 3)
    assert np.array_equal(small, selftest.canary_input(64, 64))  # fixed: the same bytes each boot
    assert small.std() > 30  # a picture, not a flat fill the sanity check would refuse
    resized = np.asarray(Image.fromarray(large).resize((64, 64), Image.Resampling.BILINEAR), dtype=np.int16)
    assert np.abs(resized - small).mean() < 8


def test_the_self_test_runs_it_per_served_size_as_an_instruction_edit(tmp_path: Path) -> None:
    suite = load_canaries(CONFIG_DIR / "canaries.toml").for_family("flux-kontext")
    plan = SelfTestPlan(suite, (Shape(64, 64, 1), Shape(64, 64, 2), Shape(96, 64, 1)), (), timed_runs=1)
    ran: list[Batch] = []

    def generate(batch: Batch) -> BatchResult:
        ran.append(batch)
        pixels = [selftest.canary_input(batch.width, batch.height) for _ in batch.images]
        return BatchResult(tuple(GeneratedImage(Image.fromarray(p), s.seed) for p, s in zip(pixels, batch.images,
                                                                                               strict=True)),
                           "CPUExecutionProvider")

    report = selftest.run(plan, generate, tmp_path)
    assert [r.shape for r in report.shapes] == ["64x64x1", "64x64x2", "96x64x1"]
    assert [r.shape for r in report.edits] == ["64x64x1-edit", "96x64x1-edit"]
    edits = [b for b in ran if b.mode == "instruct"]
    assert [(b.width, b.height, b.steps, len(b.images)) for b in edits] == [(64, 64, 2, 1), (96, 64, 2, 1)]
    refs = edits[0].images[0].edit.references if edits[0].images[0].edit else ()
    assert len(refs) == 1 and np.array_equal(refs[0], selftest.canary_input(64, 64))
    assert edits[0].images[0].prompt == "put a red hat on it" and edits[0].images[0].seed == 77
    recorded = selftest.record(plan, generate, tmp_path).read_text(encoding="utf-8")
    assert '"96x64x1-edit"' in recorded
    plain = SelfTestPlan(load_canaries(CONFIG_DIR / "canaries.toml").for_family("flux"), plan.shapes, ())
    assert "edit" not in selftest._suite(plain)  # recordings made before the edit canary still match
