"""`sdserve engines optimize`: ONNX Runtime's transformer-optimizer fusions per component, optional fp16 with an
fp32 keep-list, and the output difference against the unoptimized model on the same inputs.

``target="cpu"`` leaves out the fusions whose fused ops only have CUDA kernels (GroupNorm, NHWC conv, BiasSplitGelu,
packed QKV, BiasAdd); ``target="cuda"`` enables them. A fusion pass that fails on a graph pattern (e.g. attention
exported by a newer torch) is retried without attention fusion, and the report says so.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort

from engines.artifacts import write_model_manifest

log = logging.getLogger(__name__)
Target = Literal["cpu", "cuda"]
MODEL_TYPES = {"text_encoder": "clip", "unet": "unet", "vae_decoder": "vae"}
CUDA_ONLY = ("enable_group_norm", "enable_skip_group_norm", "enable_nhwc_conv", "enable_bias_splitgelu",
             "enable_packed_qkv", "enable_packed_kv", "enable_bias_add")
# Ops kept in fp32 when converting to fp16: they overflow or lose too much in half precision. (LayerNormalization,
# SkipLayerNormalization and Sqrt are not listed: ORT 1.31's converter then emits duplicate Cast names on these
# graphs; ORT's fp16 LayerNorm kernels accumulate in fp32 anyway.)
FP32_KEEP = ("Resize", "GroupNorm", "InstanceNormalization", "Softmax", "Pow", "ReduceMean", "Exp")
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "PackedAttention", "PackedMultiHeadAttention",
                 "GroupQueryAttention")


def _options(model_type: str, target: Target, attention: bool) -> Any:
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(model_type)
    if target == "cpu":
        for name in CUDA_ONLY:
            setattr(options, name, False)
    options.enable_attention = attention
    return options


def optimize_component(src: Path, dst: Path, component: str, target: Target, fp16: bool) -> dict[str, Any]:
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = MODEL_TYPES[component]
    note = ""
    try:
        model = optimize_model(str(src), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0,
                               optimization_options=_options(model_type, target, True), use_gpu=target == "cuda")
    except Exception as exc:  # the optimizer's pattern matchers raise plain TypeError/ValueError on odd graphs
        note = f"attention fusion failed ({type(exc).__name__}: {exc}); optimized without it"
        log.warning("%s: %s", component, note)
        model = optimize_model(str(src), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0,
                               optimization_options=_options(model_type, target, False), use_gpu=target == "cuda")
    fusions = {k: v for k, v in model.get_fused_operator_statistics().items() if v}
    if fp16:
        model.convert_float_to_float16(keep_io_types=True, op_block_list=list(FP32_KEEP))
        _unique_node_names(model.model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    model.save_model_to_file(str(dst))
    ops = [n.op_type for n in onnx.load(str(dst), load_external_data=False).graph.node]
    return {"fusions": fusions, "attention_fused": any(op in ATTENTION_OPS for op in ops), "fp16": fp16,
            "note": note, "nodes_before": len(onnx.load(str(src), load_external_data=False).graph.node),
            "nodes_after": len(ops)}


def _unique_node_names(model: onnx.ModelProto) -> None:
    """The fp16 converter can name two inserted Cast nodes alike, which ORT refuses; suffix the repeats."""
    seen: dict[str, int] = {}
    for node in model.graph.node:
        if node.name in seen:
            seen[node.name] += 1
            node.name = f"{node.name}_{seen[node.name]}"
        else:
            seen[node.name] = 0


def _feeds(session: ort.InferenceSession, component: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for arg in session.get_inputs():
        if component == "vae_decoder":
            shape = [1, 4, 8, 8]
        else:
            shape = [d if isinstance(d, int) else 2 for d in arg.shape]
            if component == "unet" and len(shape) == 4:
                shape[2:] = [8, 8]
        if "int" in arg.type:
            feeds[arg.name] = rng.integers(0, 49406, shape).astype(np.int64 if "64" in arg.type else np.int32)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32) * (100.0 if len(shape) <= 1 else 1.0)
    return feeds


def output_difference(a: Path, b: Path, component: str) -> float:
    """Max |difference| of the first output on the same random inputs (CPU)."""
    sa = ort.InferenceSession(str(a), providers=["CPUExecutionProvider"])
    sb = ort.InferenceSession(str(b), providers=["CPUExecutionProvider"])
    feeds = _feeds(sa, component, np.random.default_rng(0))
    return float(np.abs(sa.run(None, feeds)[0].astype(np.float32) - sb.run(None, feeds)[0].astype(np.float32)).max())


def optimize_folder(src: Path, out: Path, target: Target = "cpu", fp16: bool = False,
                    vae_fp32: bool = True) -> dict[str, Any]:
    """Copy ``src`` to ``out`` with optimized components; writes optimize.json and a fresh manifest."""
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("trt", "selftest.json"))
    report: dict[str, Any] = {"target": target, "fp16": fp16, "components": {}}
    for component in MODEL_TYPES:
        half = fp16 and not (component == "vae_decoder" and vae_fp32)
        result = optimize_component(src / component / "model.onnx", out / component / "model.onnx", component,
                                    target, half)
        if target == "cpu":
            result["max_abs_diff_vs_unoptimized"] = output_difference(src / component / "model.onnx",
                                                                      out / component / "model.onnx", component)
        report["components"][component] = result
        log.info("%s: fusions %s, attention fused: %s", component, result["fusions"], result["attention_fused"])
    (out / "optimize.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").is_file() else {}
    manifest["source"] = {**manifest.get("source", {}), "optimized": {"target": target, "fp16": fp16}}
    write_model_manifest(out, manifest)
    return report
