"""The ControlNet canary at boot (issue 56, item 6; engines/health/controlnet_canary.py) on the tiny SD 1.x model with
the tiny ControlNet `sdserve engines tiny --controlnet` builds: every loaded ControlNet runs at weight 1 (finite,
sane, moving the image) and weight 0 (the plain image, proving the residual UNet equals the plain one). A ControlNet
whose weights give NaN is refused by name with its reason (left out of /controlnet/model_list and the sessions, a unit
naming it gets the reason) and the server still becomes ready; a residual UNet made wrong fails the self-test naming
ControlNet (exit 24 where the profile exits on a boot failure). Real ONNX Runtime on its CPU provider
(onnxruntime/python/onnxruntime_inference_collection.py InferenceSession); a NaN weight propagates through its
Conv/MatMul kernels as IEEE arithmetic does (onnxruntime/core/providers/cpu/nn/conv.cc)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from engines.artifacts import file_table
from engines.config import Shape
from engines.engine import OrtEngine
from engines.errors import InvalidRequestError, SelfTestError
from engines.health import controlnet_canary
from engines.types.request import ControlUnit
from server.bootstrap import selftest_plan
from server.settings import load_settings
from tests.e2e.conftest import ServerProcess, dev_config

pytestmark = pytest.mark.slow


def _rewrite(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    """Every float initializer of the ONNX file ``path`` through ``change`` (array -> array)."""
    model = onnx.load(path)
    for tensor in model.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind == "f" and array.size > 1:
            tensor.CopyFrom(numpy_helper.from_array(change(array).astype(array.dtype), tensor.name))
    onnx.save(model, path)


def _resign(model: Path) -> None:
    """The model folder's manifest re-signed, so artifact verification passes and only the output is wrong."""
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in file_table(model).items() if k != "selftest.json"}
    (model / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def built(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a copy of the tiny model with unet_controlnet/, a ControlNet library with the tiny ControlNet ``edges``), as
    `sdserve engines tiny --controlnet` builds them (engines/build/controlnet.py build_tiny_controlnet); the library
    also holds ``broken``: the tiny ControlNet with every weight NaN."""
    from engines.build.controlnet import build_tiny_controlnet

    root = tmp_path_factory.mktemp("controlnet-canary")
    model, library = root / "model", root / "controlnets"
    shutil.copytree(tiny_model, model, ignore=shutil.ignore_patterns("selftest.json"))
    build_tiny_controlnet(library / "edges", model=model)
    shutil.copytree(library / "edges", library / "broken")
    _rewrite(library / "broken" / "model.onnx", lambda a: np.full_like(a, np.nan))
    return model, library


@pytest.fixture(scope="module")
def wrong_residual(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the model whose residual UNet's weights are perturbed (re-signed): its plain path differs."""
    model = tmp_path_factory.mktemp("wrong-residual") / "model"
    shutil.copytree(built[0], model)
    rng = np.random.default_rng(5)
    _rewrite(model / "unet_controlnet" / "model.onnx", lambda a: a * (1 + 0.5 * rng.standard_normal(a.shape)))
    _resign(model)
    return model


def _engine(model: Path, library: Path) -> OrtEngine:
    settings = load_settings("dev")
    runtime = settings.runtime.model_copy(update={"controlnet": settings.runtime.controlnet.model_copy(
        update={"dir": str(library)})})
    plan = dataclasses.replace(selftest_plan(settings), timed_runs=1, batch_sizes=(1,))
    engine = OrtEngine(model, runtime, plan=plan)
    engine.load()
    return engine


def test_the_canary_passes_a_good_net_and_refuses_a_nan_one_by_name(built: tuple[Path, Path]) -> None:
    model, library = built
    engine = _engine(model, library)
    try:
        controls = getattr(engine.pipeline, "controls", None)
        assert controls is not None and sorted(controls.nets) == ["broken", "edges"]  # both loaded before the canary
        report = engine.self_test()
        assert report.passed
        assert sorted(controls.nets) == ["edges"]
        assert [r.shape.rsplit("-", 1)[1] for r in report.controlnets] == ["broken", "edges"]  # the report has both
        broken, edges = report.controlnets
        assert broken.failures[0].startswith("refused: ControlNet canary at weight 1") and not edges.failures
        assert edges.distances["weight 0"] <= 1.0  # the plain image (0.0 here; another CPU may round apart)
        assert "weight 1: output refused" in controls.refused["broken"]
        sessions = engine.capabilities().sessions
        assert "controlnet_edges" in sessions and "controlnet_broken" not in sessions  # what model_list reads
        size = engine.info.default_size
        batch = dataclasses.replace(controlnet_canary.canary_batch(engine.resolved_plan(), Shape(size, size, 1)),
                                    control=(ControlUnit(controlnet_canary.control_image(size, size), "broken"),))
        with pytest.raises(InvalidRequestError, match="ControlNet canary at weight 1") as refused:
            engine.generate(batch)
        assert refused.value.param == "controlnet.model"
        # the result as the report carries it: the served net's distances, weight 0 within and weight 1 beyond
        plan = engine.resolved_plan()
        (result,) = controlnet_canary.check(plan, [engine.pipeline], engine.generate)
        print(f"\ncontrolnet canary distances: {result.distances} (tolerance {plan.tolerance})")
        assert result.shape == f"{size}x{size}x1-controlnet-edges" and not result.failures
        assert result.distances["weight 0"] <= plan.tolerance < result.distances["weight 1"]
        assert result.p50_s > 0
    finally:
        engine.close()


def test_a_wrong_residual_unet_fails_the_self_test_naming_controlnet(wrong_residual: Path,
                                                                    built: tuple[Path, Path]) -> None:
    engine = _engine(wrong_residual, built[1])
    try:
        with pytest.raises(SelfTestError, match=r"ControlNet canary at \d+x\d+: at weight 0 the residual denoiser"):
            engine.self_test()
        reasons = engine.capabilities().verdict.reasons
        assert any("with ControlNet edges: fingerprint distance" in r for r in reasons), reasons
    finally:
        engine.close()


def test_the_server_becomes_ready_without_the_refused_net(built: tuple[Path, Path]) -> None:
    model, library = built
    server = ServerProcess("--profile", "dev", "--model", str(model), "--controlnet-dir", str(library))
    try:
        server.wait_ready(timeout=300)
        listed = httpx.get(f"{server.url}/controlnet/model_list").json()["model_list"]
        assert [t.split(" [")[0] for t in listed] == ["edges"], listed
        assert "ControlNet broken refused: ControlNet canary at weight 1: output refused" in server.log
    finally:
        assert server.stop() == 0, server.log


def test_a_wrong_residual_unet_exits_24(wrong_residual: Path, built: tuple[Path, Path], tmp_path: Path) -> None:
    config = dev_config(tmp_path, replace={'on_boot_failure = "stay_unready"': 'on_boot_failure = "exit"'})
    server = ServerProcess("--config", str(config), "--model", str(wrong_residual), "--controlnet-dir",
                           str(built[1]))
    code = server.proc.wait(timeout=300)
    server.stop()
    assert code == 24, server.log  # ExitCode.SELF_TEST_FAILED
    assert "at weight 0 the residual denoiser" in server.log and "with ControlNet edges" in server.log
