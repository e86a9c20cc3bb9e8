"""Profile drift (issue 53, point 2): the TensorRT engines' recorded optimization profiles against the running
configuration, as a pure function (engines/health/trt_coverage.py), the record the build plan writes
(engines/build/trtplan.py), and the self-test's largest call (SelfTestPlan.row_shapes, engines/health/selftest.py).

An input outside an explicitly given profile fails at run time instead of rebuilding (onnxruntime
onnxruntime/core/providers/tensorrt/tensorrt_execution_provider.cc, PR #18217): that is why boot must refuse."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from engines.build import trtplan
from engines.config import Canary, CanarySuite, SelfTestPlan, Shape
from engines.errors import SelfTestError
from engines.health import selftest, trt_coverage
from engines.health.trt_coverage import Demand
from engines.types.request import Batch, BatchResult, GeneratedImage
from tests.unit.test_trtplan import _model

UNET = {"min": {"sample": [1, 4, 64, 64], "timestep": [1], "encoder_hidden_states": [1, 77, 768]},
        "opt": {"sample": [4, 4, 64, 64], "timestep": [4], "encoder_hidden_states": [4, 77, 768]},
        "max": {"sample": [8, 4, 64, 64], "timestep": [8], "encoder_hidden_states": [8, 77, 768]},
        "rows": {"min": 1, "max": 8, "per_image": 2}}
VAE = {"min": {"latent_sample": [1, 4, 64, 64]}, "opt": {"latent_sample": [2, 4, 64, 64]},
       "max": {"latent_sample": [4, 4, 64, 64]}, "rows": {"min": 1, "max": 4, "per_image": 1}}


def _manifest(*sizes: str) -> dict[str, Any]:
    """Engines built for batch 1..4 images at each size (the UNet takes 8 rows: classifier-free guidance)."""
    return {"sizes": {s: {"context_models": {"unet": f"{s}/unet_ctx.onnx", "vae_decoder": f"{s}/vae_decoder_ctx.onnx"},
                          trt_coverage.RECORD: {"unet": UNET, "vae_decoder": VAE}} for s in sizes}}


def test_a_configuration_within_the_recorded_profiles_is_covered() -> None:
    manifest = _manifest("512x512", "768x768")
    assert trt_coverage.problems(manifest, Demand(4, ("512x512", "768x768"), "production")) == []
    assert trt_coverage.problems(manifest, Demand(1, ("768x768",), "production")) == []
    assert trt_coverage.problems(manifest, Demand(4, (), "production")) == []  # native size: every built size
    assert trt_coverage.refusal(manifest, Demand(4, ("512x512",), "production"), "m") is None


def test_more_images_per_call_than_built_is_refused_per_component_with_value_bound_and_rebuild() -> None:
    manifest = _manifest("512x512")
    found = trt_coverage.problems(manifest, Demand(5, ("512x512",), "production"))
    assert found == [
        "unet at 512x512: 5 images per call need 10 rows, the engine's profile takes at most 8 (4 images, max "
        "shapes sample:8x4x64x64,timestep:8,encoder_hidden_states:8x77x768)",
        "vae_decoder at 512x512: 5 images per call need 5 rows, the engine's profile takes at most 4 (4 images, "
        "max shapes latent_sample:4x4x64x64)"]
    why = trt_coverage.refusal(manifest, Demand(5, ("512x512",), "prod-eu"), "/models/sd15")
    assert why is not None
    assert "max(queue.max_batch, limits.max_n, serving.batch_sizes) = 5" in why
    assert "`sdserve engines build --model /models/sd15 --profile prod-eu`" in why
    # no served size given (the native size): every built size is checked
    assert len(trt_coverage.problems(_manifest("512x512", "640x640"), Demand(5, (), "p"))) == 4


def test_a_served_size_without_an_engine_is_refused_naming_the_built_ones() -> None:
    found = trt_coverage.problems(_manifest("512x512"), Demand(4, ("512x512", "768x512"), "production"))
    assert found == ["768x512: no engine for this served size (built: 512x512)"]


@pytest.mark.parametrize("damage", ["no record", "no component", "no rows", "bad rows", "no max shapes"])
def test_an_engine_without_a_well_formed_profile_record_covers_nothing(damage: str) -> None:
    manifest = _manifest("512x512")
    entry = manifest["sizes"]["512x512"]
    records = entry[trt_coverage.RECORD] = copy.deepcopy(entry[trt_coverage.RECORD])
    if damage == "no record":
        del entry[trt_coverage.RECORD]
    elif damage == "no component":
        del records["unet"]
    elif damage == "no rows":
        del records["unet"]["rows"]
    elif damage == "bad rows":
        records["unet"]["rows"]["per_image"] = 0
    else:
        del records["unet"]["max"]
    found = trt_coverage.problems(manifest, Demand(1, ("512x512",), "production"))
    assert "unet at 512x512: no recorded optimization profile" in found[0]
    assert (len(found) == 2) == (damage == "no record")  # the VAE's record is intact unless all of it is gone


def test_the_demand_is_the_largest_call_the_plan_carries() -> None:
    suite = CanarySuite(canary=(Canary(name="c", prompt="p", seed=1),))
    plan = SelfTestPlan(suite, (Shape(512, 512, 1), Shape(512, 512, 2), Shape(768, 512, 1)), (), batch_sizes=(1, 2),
                        max_images=6, profile="prod")
    assert Demand.from_plan(plan) == Demand(6, ("512x512", "768x512"), "prod")
    assert Demand.from_plan(SelfTestPlan(suite, (), (), batch_sizes=(1, 3))) == Demand(3, (), "production")


def test_parse_shapes_reads_the_provider_option_syntax() -> None:
    assert trt_coverage.parse_shapes("sample:2x4x8x8,timestep:,ids:2x77") == {
        "sample": [2, 4, 8, 8], "timestep": [], "ids": [2, 77]}
    with pytest.raises(ValueError, match="name:dims"):
        trt_coverage.parse_shapes("sample")


def test_the_build_plan_records_each_components_profile_and_rows(tmp_path: Path) -> None:
    """What the build writes into trt/manifest.json (trt_build copies the plan's record): the exact shapes TensorRT
    gets, and rows that agree with them: 2 per image where CFG doubles the batch, 1 for the VAE."""
    profiles = trtplan.profiles_from([(512, 512)], batch_max=4, batch_opt=2)
    plan = trtplan.plan(_model(tmp_path), profiles, trtplan.BuildFlags())
    entry = plan["sizes"]["512x512"]
    record = entry[trt_coverage.RECORD]
    assert sorted(record) == sorted(entry["components"])
    for component, rec in record.items():
        options = entry["components"][component]["provider_options"]
        assert rec["max"] == trt_coverage.parse_shapes(options["trt_profile_max_shapes"])
        assert rec["rows"]["max"] == max(dims[0] for dims in rec["max"].values() if dims)
        assert rec["rows"]["min"] == max(dims[0] for dims in rec["min"].values() if dims)
    assert record["unet"]["rows"] == {"min": 1, "max": 8, "per_image": 2}
    assert record["text_encoder"]["rows"] == {"min": 1, "max": 8, "per_image": 2}
    assert record["vae_decoder"]["rows"] == {"min": 1, "max": 4, "per_image": 1}
    assert trt_coverage.problems({"sizes": {"512x512": {**entry, "context_models": entry["components"]}}},
                                 Demand(4, ("512x512",), "p")) == []
    assert len(trt_coverage.problems({"sizes": {"512x512": {**entry, "context_models": entry["components"]}}},
                                      Demand(5, ("512x512",), "p"))) == 3


class _Engine:
    """A fake generate whose engines take at most ``limit`` images per call (what a TensorRT profile does)."""

    def __init__(self, limit: int, black_from: int = 0) -> None:
        self.limit, self.black_from, self.calls = limit, black_from, list[int]()

    def __call__(self, batch: Batch) -> BatchResult:
        self.calls.append(len(batch.images))
        if len(batch.images) > self.limit:
            raise RuntimeError(f"[ONNXRuntimeError] : 1 : FAIL : sample dim 0 {2 * len(batch.images)} is out of "
                               f"the profile's range 1..{2 * self.limit}")
        noise = np.random.default_rng(len(self.calls)).integers(0, 255, (8, 8, 3), dtype=np.uint8)
        if self.black_from and len(batch.images) >= self.black_from:
            noise[:] = 0
        return BatchResult(tuple(GeneratedImage(Image.fromarray(noise), 1) for _ in batch.images), "fake")


def _plan(max_images: int) -> SelfTestPlan:
    suite = CanarySuite(canary=(Canary(name="c", prompt="p", seed=1),), steps=2)
    return SelfTestPlan(suite, (Shape(64, 64, 1), Shape(64, 64, 2)), (), timed_runs=1, batch_sizes=(1, 2),
                        max_images=max_images)


def test_the_self_test_runs_the_largest_call_once_untimed(tmp_path: Path) -> None:
    assert _plan(4).row_shapes() == (Shape(64, 64, 4),)
    assert _plan(2).row_shapes() == () and _plan(0).row_shapes() == ()  # a batch size reaches it already
    engine = _Engine(limit=4)
    report = selftest.run(_plan(4), engine, tmp_path)
    assert engine.calls == [1, 1, 2, 2, 4]  # warm + 1 timed per batch size, then the largest call once
    assert [s.shape for s in report.shapes] == ["64x64x1", "64x64x2"] and report.passed  # a check, not a baseline


def test_an_insane_image_from_the_largest_call_fails_the_self_test(tmp_path: Path) -> None:
    engine = _Engine(limit=4, black_from=4)
    with pytest.raises(SelfTestError, match=r"64x64x4: canary 'c': all-black image"):
        selftest.run(_plan(4), engine, tmp_path)


def test_a_largest_call_the_engines_cannot_take_fails_the_self_test(tmp_path: Path) -> None:
    with pytest.raises(SelfTestError, match=r"64x64x4: the largest call the configuration forms .* = 4 images\) "
                                            r"failed: .*out of the profile's range 1\.\.6"):
        selftest.run(_plan(4), _Engine(limit=3), tmp_path)


def test_recording_includes_the_largest_call(tmp_path: Path) -> None:
    path = selftest.record(_plan(4), _Engine(limit=4), tmp_path)
    assert "64x64x4" in path.read_text()
