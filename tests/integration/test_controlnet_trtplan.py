"""The TensorRT plans of ControlNet (engines/build/trtplan.py ``controlnet_plan`` and the ``unet_controlnet``
component of ``plan``) on the tiny SD 1.x and SDXL builds with their tiny ControlNets
(engines/build/controlnet.py ``build_tiny_controlnet``): the ControlNet's engine takes the UNet's rows (every CFG
row), latents, text states (SDXL's added conditions too) and the control image at the output's pixels; the residual
UNet's engine takes each residual at its level's size; every option set passes ONNX Runtime's real Python option
parser (onnxruntime/python/onnxruntime_pybind_state.cc, ``CreateExecutionProviderFactoryInstance``). Before, the
model's plan left ``unet_controlnet/`` out and a ControlNet folder had no plan at all.

The residual shapes are checked against the real graphs: the ControlNet run on ONNX Runtime's CPU provider at the
plan's opt shapes gives exactly the residuals the residual UNet's opt profile declares."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines.build import trtplan
from engines.build.trt_build import parser_verdicts
from engines.errors import ArtifactError

SIZES = [(64, 64), (128, 96)]
BATCH_MAX, BATCH_OPT = 3, 2


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """family -> (model folder with unet_controlnet/, its tiny ControlNet's folder)."""
    from engines.build.controlnet import build_tiny_controlnet
    from engines.build.tiny import build_tiny

    out = {}
    for family in ("sd1", "sdxl"):
        root = tmp_path_factory.mktemp(f"controlnet_trtplan_{family}")
        model = build_tiny(root / "model", family=family)
        out[family] = (model, build_tiny_controlnet(root / "controlnets" / "canny", model))
    return out


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def _profiles() -> list[trtplan.ShapeProfile]:
    return trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT)


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_controlnet_and_residual_unet_plans_pass_orts_parser(family: str, built: dict[str, tuple[Path, Path]]) -> None:
    model, net = built[family]
    plan = trtplan.plan(model, _profiles(), trtplan.BuildFlags())
    assert "unet_controlnet" in plan["sizes"]["64x64"]["components"]
    net_plan = trtplan.controlnet_plan(net, model, _profiles(), trtplan.BuildFlags())
    for folder, p in ((model, plan), (net, net_plan)):
        verdicts = parser_verdicts(folder, p)
        assert verdicts and not {k: v for k, v in verdicts.items() if not v["accepted"]}
    spec = net_plan["sizes"]["128x96"]["components"]["controlnet"]
    context = Path(spec["provider_options"]["trt_ep_context_file_path"])
    assert spec["source"] == "model.onnx" and not context.is_absolute()
    options = spec["provider_options"]
    low, high = _shapes(options, "min"), _shapes(options, "max")
    assert low["controlnet_cond"] == [1, 3, 96, 128] and high["controlnet_cond"] == [2 * BATCH_MAX, 3, 96, 128]
    assert high["sample"] == [2 * BATCH_MAX, 4, 12, 16] and high["conditioning_scale"] == [2 * BATCH_MAX]
    assert ("text_embeds" in high) == (family == "sdxl")
    assert net_plan["sizes"]["128x96"][trtplan.RECORD]["controlnet"]["rows"]["per_image"] == 2


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_the_controlnets_residuals_are_what_the_residual_unet_plan_takes(
        family: str, built: dict[str, tuple[Path, Path]]) -> None:
    model, net = built[family]
    unet = _shapes(trtplan.plan(model, _profiles(), trtplan.BuildFlags())["sizes"]["128x96"]["components"]
                   ["unet_controlnet"]["provider_options"], "opt")
    feeds_shapes = _shapes(trtplan.controlnet_plan(net, model, _profiles(), trtplan.BuildFlags())["sizes"]["128x96"]
                           ["components"]["controlnet"]["provider_options"], "opt")
    session = ort.InferenceSession(str(net / "model.onnx"), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in session.get_inputs()}
    feeds = {name: (np.zeros(shape, np.int64) if "int64" in types[name] else
                    np.random.default_rng(0).random(shape).astype(np.float16 if "float16" in types[name]
                                                                  else np.float32))
             for name, shape in feeds_shapes.items()}
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True))
    residuals = {k: v for k, v in unet.items() if k.startswith((trtplan.RESIDUAL_DOWN, trtplan.RESIDUAL_MID))}
    assert len(residuals) == len(outputs) >= 7
    for name, shape in residuals.items():
        produced = outputs[name.replace("additional_residual", "res_sample")]
        assert list(produced.shape) == shape, name


def test_a_controlnet_for_another_base_is_refused_by_name(built: dict[str, tuple[Path, Path]]) -> None:
    with pytest.raises(ArtifactError, match="canny is an SDXL ControlNet"):
        trtplan.controlnet_plan(built["sdxl"][1], built["sd1"][0], _profiles(), trtplan.BuildFlags())
