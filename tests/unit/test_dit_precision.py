"""The DiT TensorRT precision follows each component's export (engines/build/trtplan_dit.py ``precision``), and the
memory plan charges it (engines/health/memory_plan.py): fp16 export -> fp16, bf16 -> bf16, fp32 -> the registry's
(the builder lowers it), an fp16 graph with fp32-kept weights (T5's ``wo``) -> bf16; a component without
``model.onnx`` keeps the registry's.

Graphs made with onnx.helper carry the element types of each export (one initializer per type, of known size), on the
released Flux.1 dev configs (tests/data/model_configs.json). The fp16 row's shares are a real tiny fp16 export's
(engines/build/dit_export.py ``export_dit(dtype="fp16")``, read once: T5 2.6 % fp32 elements, the transformer 16 fp32
elements of 83,632); exporting it here would take half a minute of these 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engines.build import trtplan_dit
from engines.health import memory_plan as mp
from engines.pipelines.flow_family import detect_dit

CONFIGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
FLUX = ("text_encoder", "text_encoder_2", "transformer", "vae_decoder")
"""Flux's components: CLIP, T5, the transformer, the VAE decoder."""


def write_graph(path: Path, weights: dict[int, int]) -> None:
    """A model.onnx whose initializers are ``weights``: ONNX element type -> element count (zeros)."""
    inits = [helper.make_tensor(f"w{t}", t, [n], np.zeros(n, np.uint8).tobytes() * (4 if t == 1 else 2), raw=True)
             for t, n in weights.items()]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])], inits)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph), str(path))


def flux_export(root: Path, types: dict[str, dict[int, int]]) -> Path:
    """The Flux.1 dev configs plus a model.onnx per component of ``types``."""
    folder = root / "flux-dev"
    for rel, body in CONFIGS["flux-dev"].items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(json.dumps(body), encoding="utf-8")
    for component, weights in types.items():
        write_graph(folder / component / "model.onnx", weights)
    return folder


FP32, FP16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
EXPORTS = {
    # fp32 (the default export): the registry's precisions, which the builder lowers the fp32 graphs to
    "fp32": ({c: {FP32: 1000} for c in FLUX},
             {"text_encoder": "fp16", "text_encoder_2": "bf16", "transformer": "bf16", "vae_decoder": "bf16"}),
    # as `engines export --dtype fp16` writes Flux: T5 with its fp32 `wo` keeps, the force-upcast VAE in fp32
    "fp16": ({"text_encoder": {FP16: 1000}, "text_encoder_2": {FP16: 800, FP32: 200},
              "transformer": {FP16: 1000, FP32: 4}, "vae_decoder": {FP32: 1000}},
             {"text_encoder": "fp16", "text_encoder_2": "bf16", "transformer": "fp16", "vae_decoder": "bf16"}),
    "bf16": ({"text_encoder": {FP16: 1000}, "text_encoder_2": {BF16: 1000}, "transformer": {BF16: 1000},
              "vae_decoder": {FP32: 1000}},
             {"text_encoder": "fp16", "text_encoder_2": "bf16", "transformer": "bf16", "vae_decoder": "bf16"}),
}


@pytest.mark.parametrize("dtype", list(EXPORTS))
def test_each_component_is_built_at_its_exported_dtype(tmp_path: Path, dtype: str) -> None:
    """The plan's per-component precision is the export's (before: bf16 for the transformer whatever the export,
    so an fp16 export was computed in bf16 and an fp32 one too)."""
    types, expected = EXPORTS[dtype]
    folder = flux_export(tmp_path, types)
    assert trtplan_dit.precisions(detect_dit(folder), folder) == expected


def test_fp16_and_fp32_exports_get_different_flags(tmp_path: Path) -> None:
    """The transformer's precision, and so its TensorRT flags (engines/build/trtplan.py ``_options``: fp16 ->
    trt_fp16_enable, bf16 -> trt_bf16_enable), differ between the fp16 and fp32 exports."""
    got = {d: trtplan_dit.precision(detect_dit(f), "transformer", f)
           for d, f in ((d, flux_export(tmp_path / d, EXPORTS[d][0])) for d in ("fp32", "fp16"))}
    assert got == {"fp32": "bf16", "fp16": "fp16"}  # before: bf16 for both


def test_a_component_without_an_export_keeps_the_registry_precision(tmp_path: Path) -> None:
    """A config-only folder: the registry's (bf16 transformer and T5, fp16 CLIP), what the memory plan sizes it at;
    an exported fp16 transformer beside it is charged as fp16, an fp32 one at the bf16 the builder lowers it to."""
    folder = flux_export(tmp_path / "config", {})
    dit = detect_dit(folder)
    assert [trtplan_dit.precision(dit, c, folder) for c in FLUX] == ["fp16", "bf16", "bf16", "bf16"]
    for dtype, engine in (("fp16", "fp16"), ("fp32", "bf16")):
        exported = flux_export(tmp_path / dtype, {"transformer": EXPORTS[dtype][0]["transformer"]})
        parts = {c["name"]: c for c in mp.plan(exported, mp.Served(1024, 1024, 1))["components"]}
        assert parts["transformer"]["dtype"] == engine
        assert parts["transformer"]["weights"] == 2 * parts["transformer"]["params"]
