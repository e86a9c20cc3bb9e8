"""The first-block cache's transformer parts in the memory plan (engines/health/memory_plan.py) and the decision
that loads them (engines/pipelines/first_block.py ``decide_parts``, engines/pipelines/flow.py ``prebuilt_what``):
loaded parts are counted, parts left out beside TensorRT engines are said, never both silently.

The folder is the released Flux.1 dev's configs (tests/data/model_configs.json) with three part files made with
onnx.helper, each one fp32 initializer of a known element count: the plan reads the parts' headers as it reads any
exported component's (engines/health/onnx_scan.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.health import memory_plan as mp
from engines.pipelines.first_block import NONE, PARTS, decide_parts
from engines.pipelines.flow import prebuilt_what
from server.cli.doctor import render_plan

CONFIGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
ELEMENTS = {"transformer_first": 3000, "transformer_rest": 5000, "transformer_skip": 700}
"""fp32 elements of each part's one initializer."""


def flux_folder(root: Path, parts: bool) -> Path:
    folder = root / "flux-dev"
    for rel, body in CONFIGS["flux-dev"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    for name, n in ELEMENTS.items() if parts else ():
        weight = numpy_helper.from_array(np.ones(n, np.float32), f"{name}_w")
        graph = helper.make_graph([helper.make_node("Add", ["x", f"{name}_w"], ["y"])], name,
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [weight])
        (folder / name).mkdir(parents=True, exist_ok=True)
        onnx.save(helper.make_model(graph), str(folder / name / "model.onnx"))
    return folder


def test_loaded_parts_are_counted_on_the_device(tmp_path: Path) -> None:
    """CUDA alone (no TensorRT): the parts load beside the transformer, so their weights add to every device
    total, at the files' dtype; doctor says so."""
    without = mp.plan(flux_folder(tmp_path / "a", parts=False), mp.Served(1024, 1024, 1, tensorrt=False))
    served = mp.plan(flux_folder(tmp_path / "b", parts=True), mp.Served(1024, 1024, 1, tensorrt=False))
    parts_bytes = 4 * sum(ELEMENTS.values())
    assert served["first_block"]["loaded"] and served["first_block"]["weights"] == parts_bytes
    for key in ("weights", "base", "lora_denoiser", "lora_all"):
        assert served["device"][key] - without["device"][key] == parts_bytes, key
    names = {c["name"]: c for c in served["components"]}
    assert {n: names[n]["params"] for n in PARTS} == ELEMENTS
    assert not any(names[n]["adaptable"] for n in PARTS)  # they run the base weights only
    assert "first-block cache parts loaded" in "\n".join(render_plan(served))


def test_parts_beside_tensorrt_engines_are_not_counted_and_said(tmp_path: Path) -> None:
    """Under TensorRT the transformer's engine leaves the parts out: not loaded, not counted, and the plan says
    they exist and why they are unused."""
    without = mp.plan(flux_folder(tmp_path / "a", parts=False), mp.Served(1024, 1024, 1))
    trt = mp.plan(flux_folder(tmp_path / "b", parts=True), mp.Served(1024, 1024, 1))
    assert trt["first_block"]["present"] and not trt["first_block"]["loaded"]
    assert trt["device"]["base"] == without["device"]["base"]
    assert not {c["name"] for c in trt["components"]} & set(PARTS)
    text = "\n".join(render_plan(trt))
    assert "parts present, NOT loaded" in text and "TensorRT engines" in text


@pytest.mark.parametrize(("sources", "what"), [
    ({"transformer": Path("trt/1024x1024/transformer_ctx.onnx")}, "TensorRT engines"),
    ({"transformer": Path("ep/openvino/64x64/transformer_ctx.onnx")}, "EP-context artifacts"),
])
def test_the_refusal_beside_prebuilt_engines_tells_the_truth(tmp_path: Path, sources: dict[str, Path],
                                                             what: str) -> None:
    """The 422 of ``cache.method = "first-block"`` when the folder has the parts but the profile serves the
    transformer from prebuilt engines: it says the parts exist, what serves the transformer, and the method to
    use; never "this model has none" (what it said before)."""
    decision = decide_parts(flux_folder(tmp_path, parts=True), "flux-dev", True, prebuilt_what(sources))
    assert decision.present and not decision.load
    assert "has the first-block cache's transformer parts" in decision.refusal
    assert what in decision.refusal and "use method 'output'" in decision.refusal
    assert "has none" not in decision.refusal


def test_the_decision_without_prebuilt_engines_and_without_parts(tmp_path: Path) -> None:
    """No prebuilt models (or a prebuilt set covering the parts): loaded; no parts: "has none"; a family that
    serves no parts (Qwen-Image): says that."""
    folder = flux_folder(tmp_path, parts=True)
    covered = {p: Path(f"trt/64x64/{p}_ctx.onnx") for p in ("transformer", *PARTS)}
    assert prebuilt_what(covered) == "" and decide_parts(folder, "flux-dev", True, "").load
    bare = decide_parts(flux_folder(tmp_path / "bare", parts=False), "flux-dev", True, prebuilt_what({}))
    assert (bare.present, bare.load, bare.refusal) == (False, False, NONE)
    qwen = decide_parts(folder, "qwen-image", False)
    assert not qwen.load and "not served for qwen-image" in qwen.refusal
