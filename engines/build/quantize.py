"""`sdserve engines quantize`: INT8 (dynamic, weights) UNet behind an accuracy gate.

The quantized model is accepted only if every canary's fingerprint stays within ``max_distance`` (pixel units,
8x8 thumbnails) of the unquantized model's on the same seeds; otherwise nothing is written and the command fails.

Dynamic quantization emits DynamicQuantizeLinear and MatMulInteger: the CPU and CUDA providers run them, TensorRT's
ONNX parser imports neither (onnx/onnx-tensorrt docs/operators.md: both "N"), so such a model is for the CUDA path
only and `sdserve engines build` refuses it (engines/build/trtplan.py ``trt_unimportable_ops``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from engines.artifacts import write_model_manifest
from engines.config import CanarySuite, RuntimeSettings, Shape
from engines.errors import ArtifactError
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.health import fingerprint


def _canaries(folder: Path, suite: CanarySuite, shape: Shape) -> list[np.ndarray]:
    pipe = StableDiffusionOnnx(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    images = pipe(suite.batch(shape)).images
    return [fingerprint(img) for img in images]


def quantize(src: Path, out: Path, suite: CanarySuite, shape: Shape, max_distance: float) -> dict[str, Any]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("trt", "selftest.json"))
    quantize_dynamic(str(src / "unet" / "model.onnx"), str(out / "unet" / "model.onnx"), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["MatMul", "Gemm"])
    ref, got = _canaries(src, suite, shape), _canaries(out, suite, shape)
    distances = [float(np.abs(a - b).max()) for a, b in zip(ref, got, strict=True)]
    gate = {"passed": max(distances) <= max_distance, "max_distance": round(max(distances), 3),
            "bound": max_distance, "canaries": suite.names(shape), "shape": shape.key, "weights": "int8 (dynamic)",
            "providers": "CUDA/CPU only: TensorRT does not import dynamic quantization"}
    if not gate["passed"]:
        shutil.rmtree(out)
        raise ArtifactError(f"INT8 refused by the accuracy gate: canary fingerprint distance {gate['max_distance']} "
                            f"over the bound {max_distance}")
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").is_file() else {}
    manifest["int8_gate"] = gate
    write_model_manifest(out, manifest)
    return gate
