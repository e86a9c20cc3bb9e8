"""`sdserve engines build --controlnet-dir DIR` (server/cli/engines.py, engines/build/trtplan_controlnet.py) as real
processes on the tiny SD 1.x and FLUX.1 models with one ControlNet folder holding an SD 1.x ControlNet and two
FLUX.1 ones (the plain and the union kind): the dry run prints each ControlNet's plan beside the model's with its
option sets' verdicts from ONNX Runtime's real Python parser (onnxruntime/python/onnxruntime_pybind_state.cc,
``CreateExecutionProviderFactoryInstance``), and each ControlNet for another base under ``controlnets_refused`` with
the reason, as the server leaves it out at load; ``[runtime.controlnet] dir`` (``SDSERVE_CONTROLNET_DIR``) is the
default folder. Without a GPU the build fails closed (exit 20) as `engines build` does, writing no engine anywhere.
Before, `engines build` planned no ControlNet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def folders(dit_build: Callable[[str], tuple[Path, Path]], tiny_model: Path,
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The FLUX.1 model (with transformer_controlnet/), the SD 1.x model (with unet_controlnet/), the nets' folder."""
    from engines.build.controlnet import build_tiny_controlnet
    from engines.build.controlnet_dit import build_tiny_flux_controlnet

    root = tmp_path_factory.mktemp("controlnet_engines_build")
    flux, sd = root / "flux", root / "sd1"
    shutil.copytree(dit_build("flux")[0], flux)
    shutil.copytree(tiny_model, sd)
    build_tiny_flux_controlnet(root / "nets" / "canny", flux)
    build_tiny_flux_controlnet(root / "nets" / "union", union=True)
    build_tiny_controlnet(root / "nets" / "sdcanny", sd)
    return {"flux": flux, "sd1": sd, "nets": root / "nets"}


def _build(model: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", "engines", "build", "--profile", "production",
                           "--model", str(model), *extra], capture_output=True, text=True, timeout=300,
                          env=env or dict(os.environ))


@pytest.mark.parametrize(("model", "planned", "refused", "why"), [
    ("flux", {"canny", "union"}, "sdcanny", "is an SD ControlNet, this is a DiT model"),
    ("sd1", {"sdcanny"}, "canny", "is a FLUX.1 ControlNet, sd1 is no FLUX.1 model"),
])
def test_the_dry_run_prints_each_controlnets_plan_beside_the_models(
        model: str, planned: set[str], refused: str, why: str, folders: dict[str, Path]) -> None:
    done = _build(folders[model], "--controlnet-dir", str(folders["nets"]), "--dry-run")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    residual = "transformer_controlnet" if model == "flux" else "unet_controlnet"
    assert residual in plan["sizes"]["512x512"]["components"] and f"512x512/{residual}" in plan["option_parser"]
    assert set(plan["controlnets"]) == planned
    for name in planned:
        net = plan["controlnets"][name]
        assert net["serves"] == folders[model].name and list(net["sizes"]) == ["512x512"]
        assert net["option_parser"] and all(v["accepted"] for v in net["option_parser"].values()), net
        options = net["sizes"]["512x512"]["components"]["controlnet"]["provider_options"]
        assert options["trt_ep_context_file_path"] == "trt/512x512/controlnet_ctx.onnx"
    assert why in plan["controlnets_refused"][refused] and f"ControlNet {refused} left out" in done.stderr
    assert str(folders["nets"]) not in done.stdout  # nothing in the plans ties the artifacts to this machine


def test_the_controlnet_folder_defaults_to_the_profiles(folders: dict[str, Path]) -> None:
    """``SDSERVE_CONTROLNET_DIR`` ([runtime.controlnet] dir, server/settings.py) without the flag; neither: no
    ControlNet section at all (the model's plan as before)."""
    env = {**os.environ, "SDSERVE_CONTROLNET_DIR": str(folders["nets"])}
    planned = json.loads(_build(folders["flux"], "--dry-run", env=env).stdout)
    assert set(planned["controlnets"]) == {"canny", "union"}
    bare = {k: v for k, v in os.environ.items() if k != "SDSERVE_CONTROLNET_DIR"}
    assert "controlnets" not in json.loads(_build(folders["flux"], "--dry-run", env=bare).stdout)


def test_a_controlnet_dir_that_is_no_folder_is_refused_by_name(folders: dict[str, Path]) -> None:
    done = _build(folders["flux"], "--controlnet-dir", str(folders["nets"] / "absent"), "--dry-run")
    assert done.returncode == 10 and "--controlnet-dir" in done.stderr and "not a folder" in done.stderr


def test_without_tensorrt_the_build_fails_closed_and_writes_no_engine(folders: dict[str, Path]) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("asserts the behaviour of a machine without a GPU")
    done = _build(folders["flux"], "--controlnet-dir", str(folders["nets"]))
    assert done.returncode == 20 and "libnvinfer.so.10" in done.stderr
    assert not [p for p in folders["nets"].rglob("trt") if p.is_dir()]
