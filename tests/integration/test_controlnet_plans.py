"""The TensorRT and memory plans of ControlNet (engines/build/trtplan.py ``controlnet_plan`` and the ``unet_controlnet``
component of ``plan``) on the tiny SD 1.x and SDXL builds with their tiny ControlNets
(engines/build/controlnet.py ``build_tiny_controlnet``): the ControlNet's engine takes the UNet's rows (every CFG
row), latents, text states (SDXL's added conditions too) and the control image at the output's pixels; the residual
UNet's engine takes each residual at its level's size; every option set passes ONNX Runtime's real Python option
parser (onnxruntime/python/onnxruntime_pybind_state.cc, ``CreateExecutionProviderFactoryInstance``). Before, the
model's plan left ``unet_controlnet/`` out and a ControlNet folder had no plan at all.

The residual shapes are checked against the real graphs: the ControlNet run on ONNX Runtime's CPU provider at the
plan's opt shapes gives exactly the residuals the residual UNet's opt profile declares.

Memory (engines/health/controlnet_memory.py, memory_plan.py, request_memory.py, server/admission.py): with a
ControlNet folder configured, the plan counts ``unet_controlnet/`` as a second UNet, each ControlNet's weights from
its file, and the most residual sets (four: two alternating output and two sum buffers from three units on),
whose bytes equal what the real ControlNet outputs at that shape; a request's denoiser stage holds the sets its
units keep (one unit: one), only when it has units; `sdserve doctor` (a real process) lists them. Before, none of it
was counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines.build import trtplan
from engines.build.trt_build import parser_verdicts
from engines.errors import ArtifactError, InvalidRequestError
from engines.health import memory_plan, request_memory
from server.admission import MemoryAsk, MemoryBudget, admit_memory

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


def _residual_outputs(net: Path, width: int, height: int, rows: int) -> int:
    """Bytes of the residuals the real SD 1.x ControlNet returns for ``rows`` rows at ``width`` x ``height``."""
    session = ort.InferenceSession(str(net / "model.onnx"), providers=["CPUExecutionProvider"])
    text = next(i.shape[1:] for i in session.get_inputs() if i.name == "encoder_hidden_states")
    rng = np.random.default_rng(0)
    shapes = {"sample": (rows, 4, height // 8, width // 8), "timestep": (rows,), "encoder_hidden_states": (rows, *text),
              "controlnet_cond": (rows, 3, height, width), "conditioning_scale": (rows,)}
    return sum(o.nbytes for o in session.run(None, {k: rng.random(v).astype(np.float32) for k, v in shapes.items()}))


def test_the_memory_plan_counts_the_residual_unet_the_controlnets_and_their_residuals(
        built: dict[str, tuple[Path, Path]]) -> None:
    model, net = built["sd1"]
    served = memory_plan.Served(128, 96, 2, tensorrt=False)
    plain, controlled = memory_plan.plan(model, served), memory_plan.plan(model, served, controlnet_dir=net.parent)
    parts = {c["name"]: c for c in controlled["components"]}
    assert {"unet_controlnet", "controlnet:canny"} <= set(parts) and "unet_controlnet" not in \
        {c["name"] for c in plain["components"]}
    assert parts["unet_controlnet"]["params"] == parts["unet"]["params"]  # the same network, a second copy
    assert 0 < parts["controlnet:canny"]["params"] < parts["unet"]["params"]  # the down half and mid block
    section = controlled["controlnet"]
    assert section["served"] and section["nets"] == ["canny"]
    assert section["residual_bytes"] == 4 * _residual_outputs(net, 128, 96, 2 * 2)  # the most sets, CFG rows
    added = parts["unet_controlnet"]["weights"] + parts["controlnet:canny"]["weights"] + section["residual_bytes"]
    grown = controlled["device"]["base"] - plain["device"]["base"]
    assert grown >= added  # plus activations where they exceed the rest's (one CUDA arena: the largest)
    assert controlled["device"]["weights"] - plain["device"]["weights"] == added - section["residual_bytes"]


def test_a_controlnet_folder_without_the_residual_unet_adds_nothing(built: dict[str, tuple[Path, Path]],
                                                                    tiny_model: Path) -> None:
    served = memory_plan.Served(64, 64, 1, tensorrt=False)
    plan = memory_plan.plan(tiny_model, served, controlnet_dir=built["sd1"][1].parent)
    assert not plan["controlnet"]["served"] and "unet_controlnet/model.onnx" in plan["controlnet"]["note"]
    assert plan["device"] == memory_plan.plan(tiny_model, served)["device"]


def test_a_controlled_request_holds_the_residuals_and_admission_counts_them(
        built: dict[str, tuple[Path, Path]]) -> None:
    """256x256, one image in a denoiser call shared by 8 (``[queue] max_batch``): the denoiser is the peak stage."""
    model, net = built["sd1"]
    memory = request_memory.for_folder(model)
    assert memory is not None and memory.controlnet
    plain, controlled = memory.need(256, 256, 8, 1), memory.need(256, 256, 8, 1, controls=1)
    residuals = _residual_outputs(net, 256, 256, 2 * 8)  # one unit: one set
    unet = memory.stage("unet", 256, 256, 8)
    assert dict(controlled.stages)["denoiser"] == int((unet + residuals) * request_memory.ARENA_SLACK)
    assert dict(plain.stages)["denoiser"] == int(unet * request_memory.ARENA_SLACK)
    assert controlled.stage == "denoiser" and "ControlNet residuals (1 set)" in controlled.why
    three = memory.need(256, 256, 8, 1, controls=3)  # outputs and sums alternate: four sets held
    assert dict(three.stages)["denoiser"] == int((unet + 4 * residuals) * request_memory.ARENA_SLACK)
    assert "ControlNet residuals (4 sets)" in three.why
    budget = MemoryBudget((plain.peak_bytes + controlled.peak_bytes) // 2, "test")
    admit_memory(memory, budget, [MemoryAsk(256, 256, 1, 8, 1)])  # without units it fits
    with pytest.raises(InvalidRequestError, match="ControlNet residuals"):
        admit_memory(memory, budget, [MemoryAsk(256, 256, 1, 8, 1, controls=1)])


def test_doctor_lists_the_controlnet_parts(built: dict[str, tuple[Path, Path]]) -> None:
    """A real `sdserve doctor` process with ``SDSERVE_CONTROLNET_DIR`` (server/settings.py): its memory plan names
    the residual UNet and the ControlNet as components and the residual bytes."""
    model, net = built["sd1"]
    env = {**os.environ, "SDSERVE_CONTROLNET_DIR": str(net.parent)}
    done = subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--profile", "dev", "--model", str(model),
                           "--plan-size", "128x96", "--json"], env=env, capture_output=True, text=True, timeout=120)
    plan = json.loads(done.stdout)["memory_plan"]
    assert {"unet_controlnet", "controlnet:canny"} <= {c["name"] for c in plan["components"]}
    assert plan["controlnet"]["served"] and plan["controlnet"]["residual_bytes"] > 0
    text = subprocess.run([sys.executable, "-m", "server.cli", "doctor", "--profile", "dev", "--model", str(model),
                           "--plan-size", "128x96"], env=env, capture_output=True, text=True, timeout=120).stdout
    assert "controlnet:canny" in text and "unet_controlnet" in text
    residuals = plan["controlnet"]["residual_bytes"] / (1 << 30)
    assert f"ControlNet ({net.parent}): canny; residuals {residuals:.2f} GiB in the device total" in text, text
