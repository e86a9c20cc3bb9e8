"""The TensorRT and memory plans of FLUX.1 ControlNet (engines/build/trtplan_controlnet.py, the
``transformer_controlnet`` component of engines/build/trtplan.py ``plan``, engines/health/controlnet_memory.py) on the
tiny FLUX.1 dev model with its tiny ControlNets (engines/build/controlnet_dit.py): the residual transformer's engine
takes one residual per block at the packed latents' tokens; a ControlNet's engine takes the transformer's rows,
tokens and text, its control latents, one scale per row, the union kind's ``controlnet_mode`` and one more rope row;
every option set passes ONNX Runtime's real Python option parser (onnxruntime/python/onnxruntime_pybind_state.cc,
``CreateExecutionProviderFactoryInstance``). Before, the DiT plan left ``transformer_controlnet/`` out, a FLUX.1
ControlNet had no plan, and the memory plan counted no FLUX.1 residual.

The shapes are checked against the real graphs: each ControlNet run on ONNX Runtime's CPU provider at its plan's opt
shapes gives exactly the residuals the residual transformer's opt profile declares, and the residual transformer
runs on them. The residual bytes equal a hand count from the tiny config and what the real ControlNet returns."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engines.build import trtplan
from engines.build.trt_build import parser_verdicts
from engines.build.trtplan_controlnet import flux_controlnet_plan, net_plan
from engines.errors import ArtifactError, InvalidRequestError
from engines.health import controlnet_memory, memory_plan, request_memory
from server.admission import MemoryAsk, MemoryBudget, admit_memory

SIZES = [(64, 64), (128, 96)]
BATCH_MAX, BATCH_OPT = 3, 2


@pytest.fixture(scope="module")
def flux(dit_build: Callable[[str], tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the tiny FLUX.1 dev model with transformer_controlnet/, a ControlNet folder with ``canny`` and
    ``union`` (FLUX.1) and ``sd`` (an SD 1.x ControlNet), and the plain model."""
    from engines.build.controlnet import build_tiny_controlnet
    from engines.build.controlnet_dit import build_tiny_flux_controlnet

    plain = dit_build("flux")[0]
    root = tmp_path_factory.mktemp("flux_controlnet_plans")
    model = root / "model"
    shutil.copytree(plain, model)
    build_tiny_flux_controlnet(root / "nets" / "canny", model)
    build_tiny_flux_controlnet(root / "nets" / "union", union=True)
    build_tiny_controlnet(root / "nets" / "sd", family="sd1")
    return {"model": model, "plain": plain, "nets": root / "nets"}


def _profiles() -> list[trtplan.ShapeProfile]:
    return trtplan.profiles_from(SIZES, BATCH_MAX, BATCH_OPT)


def _shapes(options: dict[str, str], bound: str) -> dict[str, list[int]]:
    return {name: [int(d) for d in dims.split("x")] for name, dims in
            (item.split(":") for item in options[f"trt_profile_{bound}_shapes"].split(","))}


def _options(plan: dict, component: str, size: str = "128x96") -> dict[str, str]:
    return plan["sizes"][size]["components"][component]["provider_options"]


def test_the_residual_transformer_and_each_controlnet_plan_pass_orts_parser(flux: dict[str, Path]) -> None:
    model, nets = flux["model"], flux["nets"]
    plan = trtplan.plan(model, _profiles(), trtplan.BuildFlags())
    assert "transformer_controlnet" in plan["sizes"]["64x64"]["components"]
    assert "transformer_controlnet" not in trtplan.plan(flux["plain"], _profiles(), trtplan.BuildFlags())["sizes"][
        "64x64"]["components"]
    plans = {name: flux_controlnet_plan(nets / name, model, _profiles(), trtplan.BuildFlags())
             for name in ("canny", "union")}
    for folder, p in ((model, plan), (nets / "canny", plans["canny"]), (nets / "union", plans["union"])):
        verdicts = parser_verdicts(folder, p)
        assert len(verdicts) >= len(SIZES) and all(v["accepted"] for v in verdicts.values()), verdicts
    # 128x96: latents 16x12 at the tiny VAE's 8x, 2x2-packed: 8 x 6 = 48 tokens; FLUX.1 never doubles its rows
    residual = _shapes(_options(plan, "transformer_controlnet"), "max")
    assert residual["block_residual_0"] == residual["single_residual_0"] == [BATCH_MAX, 48, 32]
    assert _shapes(_options(plan, "transformer_controlnet"), "min")["block_residual_0"] == [1, 48, 32]
    canny, union = (_shapes(_options(plans[n], "controlnet"), "max") for n in ("canny", "union"))
    assert canny["controlnet_cond"] == canny["hidden_states"] == [BATCH_MAX, 48, 64]
    assert canny["conditioning_scale"] == [BATCH_MAX] and "controlnet_mode" not in canny
    assert union["controlnet_mode"] == [BATCH_MAX, 1]
    text = canny["encoder_hidden_states"][1]
    assert canny["rope_cos"] == [text + 48, 16] and union["rope_cos"] == [text + 48 + 1, 16]  # the mode token
    assert canny["encoder_hidden_states"] == residual["encoder_hidden_states"]
    spec = plans["canny"]["sizes"]["128x96"]["components"]["controlnet"]
    context = Path(spec["provider_options"]["trt_ep_context_file_path"])
    assert spec["source"] == "model.onnx" and not context.is_absolute()
    assert plans["canny"]["sizes"]["128x96"][trtplan.RECORD]["controlnet"]["rows"] == {"min": 1, "max": BATCH_MAX,
                                                                                       "per_image": 1}
    # the precision of the transformer they are part of (an fp32 export: the registry's bf16)
    assert _options(plans["canny"], "controlnet")["trt_bf16_enable"] == _options(plan, "transformer")[
        "trt_bf16_enable"] == _options(plan, "transformer_controlnet")["trt_bf16_enable"] == "True"


def _feeds(session: ort.InferenceSession, shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    types = {i.name: i.type for i in session.get_inputs()}
    return {name: np.zeros(shape, np.int64) if "int64" in types[name] else rng.random(shape).astype(np.float32)
            for name, shape in shapes.items()}


@pytest.mark.parametrize("name", ["canny", "union"])
def test_the_controlnets_residuals_are_what_the_residual_transformer_plan_takes(name: str,
                                                                                flux: dict[str, Path]) -> None:
    model = flux["model"]
    residual = _shapes(_options(trtplan.plan(model, _profiles(), trtplan.BuildFlags()), "transformer_controlnet"),
                       "opt")
    net = _shapes(_options(flux_controlnet_plan(flux["nets"] / name, model, _profiles(), trtplan.BuildFlags()),
                           "controlnet"), "opt")
    session = ort.InferenceSession(str(flux["nets"] / name / "model.onnx"), providers=["CPUExecutionProvider"])
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, _feeds(session, net)), strict=True))
    wanted = {k: v for k, v in residual.items() if k.startswith(("block_residual_", "single_residual_"))}
    assert len(wanted) == len(outputs) == 2
    produced = {k.replace("controlnet_block_sample_", "block_residual_")
                .replace("controlnet_single_block_sample_", "single_residual_"): v for k, v in outputs.items()}
    assert {k: list(v.shape) for k, v in produced.items()} == wanted
    transformer = ort.InferenceSession(str(model / "transformer_controlnet" / "model.onnx"),
                                       providers=["CPUExecutionProvider"])
    feeds = _feeds(transformer, {k: v for k, v in residual.items() if k not in wanted}) | produced
    (out,) = transformer.run(None, feeds)
    assert list(out.shape) == residual["hidden_states"]


def test_a_controlnet_for_another_base_is_refused_by_name(flux: dict[str, Path], tiny_model: Path) -> None:
    with pytest.raises(ArtifactError, match="ControlNet sd is an SD ControlNet, this is a DiT model"):
        net_plan(flux["nets"] / "sd", flux["model"], _profiles(), trtplan.BuildFlags())
    with pytest.raises(ArtifactError, match="ControlNet canny is a FLUX.1 ControlNet, .* is no FLUX.1 model"):
        net_plan(flux["nets"] / "canny", tiny_model, _profiles(), trtplan.BuildFlags())
    with pytest.raises(ArtifactError, match="has no transformer_controlnet/model.onnx"):  # serves no ControlNet
        net_plan(flux["nets"] / "canny", flux["plain"], _profiles(), trtplan.BuildFlags())


TINY_SET = (1 + 1) * (2 * 16) * 4
"""Hand count of one residual set per row and token: the tiny transformer's one double and one single block
(engines/build/controlnet_dit.py CONTROLNET_FLUX), 2 heads x 16 = 32 wide, fp32 inputs."""


def _one_set(net: Path, rows: int, width: int, height: int) -> int:
    """Bytes the real FLUX.1 ControlNet returns for ``rows`` rows at ``width`` x ``height`` (its samples, one per
    block of the tiny transformer: exactly one set)."""
    session = ort.InferenceSession(str(net / "model.onnx"), providers=["CPUExecutionProvider"])
    tokens, text = (height // 16) * (width // 16), 8
    shapes = {"hidden_states": [rows, tokens, 64], "controlnet_cond": [rows, tokens, 64],
              "encoder_hidden_states": [rows, text, 96], "pooled_projections": [rows, 32], "timestep": [rows],
              "rope_cos": [text + tokens, 16], "rope_sin": [text + tokens, 16], "guidance": [rows],
              "conditioning_scale": [rows]}
    return sum(o.nbytes for o in session.run(None, _feeds(session, shapes)))


def test_the_memory_plan_counts_the_residual_transformer_the_controlnets_and_their_residuals(
        flux: dict[str, Path]) -> None:
    model, nets = flux["model"], flux["nets"]
    served = memory_plan.Served(128, 96, 2, tensorrt=False)
    plain, controlled = memory_plan.plan(model, served), memory_plan.plan(model, served, controlnet_dir=nets)
    parts = {c["name"]: c for c in controlled["components"]}
    assert {"transformer_controlnet", "controlnet:canny", "controlnet:union"} <= set(parts)
    assert parts["transformer_controlnet"]["params"] == parts["transformer"]["params"]  # a second session
    section = controlled["controlnet"]
    assert section["served"] and section["residual_sets"] == 4 and not section["note"]
    # any number of units: two output and two sum sets; 2 rows (images, no CFG) x 48 tokens at 128x96
    assert section["residual_bytes"] == 4 * 2 * 48 * TINY_SET == 4 * _one_set(nets / "canny", 2, 128, 96)
    added = sum(parts[n]["weights"] for n in ("transformer_controlnet", "controlnet:canny", "controlnet:union"))
    assert controlled["device"]["base"] - plain["device"]["base"] >= added + section["residual_bytes"]
    larger = memory_plan.plan(model, memory_plan.Served(256, 192, 2, tensorrt=False), controlnet_dir=nets)
    assert larger["controlnet"]["residual_bytes"] == 4 * section["residual_bytes"]  # 4x the tokens
    assert controlnet_memory.residual_config(flux["plain"]) == {}  # no residual variant: nothing to price


def test_the_residual_sets_grow_with_the_units(flux: dict[str, Path]) -> None:
    """engines/pipelines/controlnet_dit.py ``run``: one unit keeps its outputs; two add the second's and their sum;
    from three the output and sum buffers alternate (two each)."""
    config = controlnet_memory.residual_config(flux["model"])
    one = 3 * 48 * TINY_SET
    assert [controlnet_memory.request_bytes(config, 128, 96, 3, 8, 2, units=u) for u in (1, 2, 3, 6)] == \
        [one, 3 * one, 4 * one, 4 * one]  # item size: the graph's fp32 inputs, not the 2 passed
    assert controlnet_memory.request_bytes(config, 128, 96, 3, 8, 4) == 4 * one


def test_admission_prices_a_flux_controlnet_unit(flux: dict[str, Path]) -> None:
    """A controlled FLUX.1 request's denoiser stage holds its residuals (RequestMemory.need ``controls``,
    server/admission.py MemoryAsk.controls): ``for_folder`` reads the transformer's config beside
    ``transformer_controlnet/`` (``residual_config``), and the sets follow the request's units."""
    model = flux["model"]
    memory = request_memory.for_folder(model)
    assert memory is not None and memory.controlnet == controlnet_memory.residual_config(model) != {}
    plain, controlled = memory.need(256, 256, 8, 1), memory.need(256, 256, 8, 1, controls=1)
    residuals = 1 * 8 * (256 // 16) ** 2 * TINY_SET  # one unit: one set (residual_sets)
    two = memory.need(256, 256, 8, 1, controls=2)
    assert dict(two.stages)["denoiser"] == int((memory.stage("transformer", 256, 256, 8) + 3 * residuals)
                                               * request_memory.ARENA_SLACK)  # two units: three sets
    stage = memory.stage("transformer", 256, 256, 8)
    assert dict(controlled.stages)["denoiser"] == int((stage + residuals) * request_memory.ARENA_SLACK)
    assert dict(plain.stages)["denoiser"] == int(stage * request_memory.ARENA_SLACK)
    budget = MemoryBudget((plain.peak_bytes + controlled.peak_bytes) // 2, "test")
    admit_memory(memory, budget, [MemoryAsk(256, 256, 1, 8, 1)])
    with pytest.raises(InvalidRequestError, match="ControlNet residuals"):
        admit_memory(memory, budget, [MemoryAsk(256, 256, 1, 8, 1, controls=1)])
