"""`sdserve engines export --dtype fp16|bf16` of the tiny FLUX.2 [klein] and Z-Image diffusers folders, through the
real CLI, with the external-data threshold forced low (engines/build/dit_folder.py ``EXTERNAL_OVER``: a real
checkpoint's components pass protobuf's 2 GB, the tiny ones never do), so every component is written as it would be
for the real checkpoints: ``model.onnx`` plus ``model.onnx.data``.

- fp16 (transformer fp16, the Qwen3 text encoder and the VAE fp32: dit_folder ``half_plan``): ONNX Runtime's CPU
  provider loads the graphs, reading the weights from the external file the graph names, relative to its folder
  (onnxruntime/core/framework/tensorprotoutils.cc ``GetExternalDataInfo``), and the served pipeline's images stay
  close to the fp32 export's (same weights, same seeds).
- bf16 (transformer and text encoder bf16, VAE fp32): the CPU provider has no bf16 kernels (test_dit_half.py shows
  the load refused), so the graphs' initializer types are what is checked, read from the protobuf without weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from engines.build import dit_folder
from engines.config import RuntimeSettings
from engines.pipelines.flow import load_pipeline
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec
from server.cli.main import main

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]
BATCH = Batch((ImageSpec("a photo of an astronaut riding a horse", seed=11, guidance_scale=0.0),),
              width=64, height=64, steps=3)
FP16_MAX, FP16_MEAN = 3, 0.1
"""Tolerance of the fp16 export's uint8 image against the fp32 export's (max and mean |diff|, in 1/255), measured
here first and set with margin: Z-Image 1/255, mean 0.015; FLUX.2 [klein] 1/255, mean 0.016."""


def _cpu() -> Runtime:
    return Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))


def _components(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if (p / "model.onnx").is_file())


def _types(model: Path) -> dict[int, int]:
    """Initializer element type -> count, every initializer stored in ``model.onnx.data``."""
    graph = onnx.load(str(model), load_external_data=False).graph
    found: dict[int, int] = {}
    for init in graph.initializer:
        if init.data_location == TensorProto.EXTERNAL:
            assert {e.key: e.value for e in init.external_data}["location"] == "model.onnx.data"
        found[init.data_type] = found.get(init.data_type, 0) + 1
    return found


def _main_type(model: Path) -> int:
    types = _types(model)
    return max(types, key=lambda t: types[t])


@pytest.mark.parametrize("family", ["z-image-turbo", "flux2-klein"])
def test_half_exports_write_external_data_and_the_planned_types(family: str, dit_build: Builder, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, src = dit_build(family)
    monkeypatch.setattr(dit_folder, "EXTERNAL_OVER", 0)
    out = {}
    for dtype in ("fp16", "bf16"):
        out[dtype] = tmp_path / dtype
        assert main(["engines", "export", "--from", str(src), "--out", str(out[dtype]), "--dtype", dtype]) == 0
        names = [c.name for c in _components(out[dtype])]
        assert {"text_encoder", "transformer", "vae_decoder"} <= set(names)
        for component in _components(out[dtype]):
            assert (component / "model.onnx.data").stat().st_size > 0, component
        assert not list(fp32.glob("*/model.onnx.data"))  # the default threshold: the tiny fp32 build stays inline
    fp16, bf16 = out["fp16"], out["bf16"]
    assert _main_type(fp16 / "transformer" / "model.onnx") == TensorProto.FLOAT16
    assert _main_type(bf16 / "transformer" / "model.onnx") == TensorProto.BFLOAT16
    assert _main_type(bf16 / "text_encoder" / "model.onnx") == TensorProto.BFLOAT16
    assert _types(fp16 / "text_encoder" / "model.onnx").keys() == {TensorProto.FLOAT}
    assert TensorProto.BFLOAT16 not in _types(bf16 / "vae_decoder" / "model.onnx")
    manifest = (fp16 / "manifest.json").read_text(encoding="utf-8")
    assert "transformer/model.onnx.data" in manifest and '"dtype": "fp16"' in manifest

    for component in _components(fp16):  # the CPU provider loads every fp16 graph with its external weights
        session = ort.InferenceSession(str(component / "model.onnx"), providers=["CPUExecutionProvider"])
        assert all(i.type in ("tensor(float)", "tensor(int64)") for i in session.get_inputs()), component
    half = load_pipeline(fp16, _cpu())(BATCH, max_sequence_length=48).images
    full = load_pipeline(fp32, _cpu())(BATCH, max_sequence_length=48).images
    diff = np.abs(half.astype(np.int16) - full.astype(np.int16))
    assert half.shape == full.shape and half.std() > 1.0
    assert int(diff.max()) <= FP16_MAX and float(diff.mean()) <= FP16_MEAN, (int(diff.max()), float(diff.mean()))
