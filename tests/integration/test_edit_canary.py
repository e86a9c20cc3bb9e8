"""The instruction edit canary at boot (issue 55, item 4) on the tiny FLUX.1 Kontext [dev] model: the family's
table in configs/canaries.toml ([family.flux-kontext.edit]) puts its prompt and seed on the fixed input image
(engines/health/selftest.py ``canary_input``); the engine's self-test runs it once per served size where the model
edits (its output sane and depending on the input image: the reference latents in the sequence), reports it apart
from the timed shapes, and a fingerprint recording covers it, so a changed edit path fails the boot. Real ONNX
Runtime on the CPU (its onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from engines.config import Shape
from engines.engine import OrtEngine
from engines.errors import SelfTestError
from engines.health import selftest
from server.bootstrap import selftest_plan
from server.settings import load_settings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kontext(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.build.kontext import build_tiny_kontext

    return build_tiny_kontext(tmp_path_factory.mktemp("kontext") / "onnx")


def _engine(model: Path) -> OrtEngine:
    settings = load_settings("dev")
    plan = dataclasses.replace(selftest_plan(settings), timed_runs=1, batch_sizes=(1,))
    engine = OrtEngine(model, settings.runtime, plan=plan)
    engine.load()
    return engine


def test_the_edit_canary_runs_at_boot_and_its_fingerprint_is_checked(kontext: Path) -> None:
    engine = _engine(kontext)
    try:
        plan = engine.resolved_plan()
        assert plan.suite.edit is not None and plan.suite.edit.name == "hat"
        report = engine.self_test()
        size = engine.info.default_size
        assert [r.shape for r in report.edits] == [f"{size}x{size}x1-edit"]
        assert [r.shape for r in report.shapes] == [f"{size}x{size}x1"]  # the timed shapes stay txt2img
        assert report.edits[0].p50_s > 0 and not report.edits[0].failures
        shape = Shape(size, size, 1)
        batch = selftest.edit_batch(plan, shape)
        assert batch.mode == "instruct" and batch.images[0].prompt == "put a red hat on it" and batch.steps == 2
        edited = np.asarray(engine.generate(batch).images[0].image, dtype=np.int16)
        plain = np.asarray(engine.generate(plan.suite.batch(shape)).images[0].image, dtype=np.int16)
        inverted = dataclasses.replace(batch, images=(dataclasses.replace(batch.images[0], edit=dataclasses.replace(
            batch.images[0].edit, references=(255 - selftest.canary_input(64, 64),))),))
        other = np.asarray(engine.generate(inverted).images[0].image, dtype=np.int16)
        print(f"\nkontext edit canary max |diff|: vs txt2img {np.abs(edited - plain).max()}/255, "
              f"vs the inverted input {np.abs(edited - other).max()}/255")
        assert np.abs(edited - other).max() > 0  # the canary's image comes from its input image
        path = selftest.record(plan, engine.generate, kontext)
        recorded = json.loads(path.read_text(encoding="utf-8"))
        assert f"{size}x{size}x1-edit" in recorded["shapes"] and recorded["suite"]["edit"]["name"] == "hat"
        stored = recorded["shapes"][f"{size}x{size}x1-edit"][0]
        stored["thumb"] = (np.array(stored["thumb"]) + 50).tolist()  # an edit path that changed
        path.write_text(json.dumps(recorded), encoding="utf-8")
        with pytest.raises(SelfTestError, match="-edit: canary 'hat' fingerprint distance"):
            engine.self_test()
    finally:
        engine.close()
        (kontext / "selftest.json").unlink(missing_ok=True)

