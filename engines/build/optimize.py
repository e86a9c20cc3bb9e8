"""`sdserve engines optimize`: one export, three targets, each checked.

- ``cuda``: every attention (UNet self/cross, CLIP, the VAE's mid block) rewritten into ORT's fused
  ``MultiHeadAttention`` (engines/build/attention_fusion.py), then ORT's transformer-optimizer fusions including the
  CUDA-only ones (GroupNorm, SkipGroupNorm, BiasSplitGelu, NhwcConv, BiasAdd). The fused attention count must equal
  the attention layers in the component's config, or the build fails (ArtifactError, exit 23).
- ``cpu``: the same without the CUDA-only fusions (they have no CPU kernel; engines/build/fusion_report.py).
- ``tensorrt``: standard ONNX only (TensorRT's parser cannot import com.microsoft ops and fuses attention itself):
  ORT's basic, provider-independent rewrites (constant folding, redundant nodes), checked to hold no other domain.

Optional fp16 with an fp32 keep-list. optimize.json records fusions, attention counts, the kernels each fused op
runs on, and the max output difference against the unoptimized model on the CPU: of the whole graph where every op
has a CPU kernel, else of the same graph built without the CUDA-only fusions (and says which).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort

from engines.artifacts import write_model_manifest
from engines.build.attention_fusion import fuse_attention
from engines.build.fusion_report import (
    KERNELS,
    LEFT_OUT,
    check_attention,
    check_standard,
    domains,
    expected_attention,
)
from engines.errors import ConfigError

log = logging.getLogger(__name__)
Target = Literal["cpu", "cuda", "tensorrt"]
MODEL_TYPES = {"text_encoder": "clip", "text_encoder_2": "clip", "unet": "unet", "vae_decoder": "vae",
               "vae_encoder": "vae"}
CUDA_ONLY = ("enable_group_norm", "enable_skip_group_norm", "enable_nhwc_conv", "enable_bias_splitgelu",
             "enable_packed_qkv", "enable_packed_kv", "enable_bias_add")
# Ops kept in fp32 when converting to fp16: they overflow or lose too much in half precision. (LayerNormalization,
# SkipLayerNormalization and Sqrt are not listed: ORT 1.31's converter then emits duplicate Cast names on these
# graphs; ORT's fp16 LayerNorm kernels accumulate in fp32 anyway.)
FP32_KEEP = ("Resize", "GroupNorm", "InstanceNormalization", "Softmax", "Pow", "ReduceMean", "Exp")
ATTENTION_OPS = ("Attention", "MultiHeadAttention", "PackedAttention", "PackedMultiHeadAttention",
                 "GroupQueryAttention")
CPU_FUSED_ATTENTION = True
"""Fuse attention for the CPU target too: MultiHeadAttention has a CPU kernel (MLAS flash attention without a mask)
and measured faster than the unfused graph at 256x256 and up (README, Benchmarks)."""


def _options(model_type: str, target: Target) -> Any:
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(model_type)
    if target != "cuda":
        for name in CUDA_ONLY:
            setattr(options, name, False)
    # Attention is ours (attention_fusion.py); ORT's matchers raise or find nothing on these exports. Packed QKV/KV
    # is left out (fusion_report.LEFT_OUT).
    options.enable_attention = False
    options.enable_packed_qkv = options.enable_packed_kv = False
    return options


def _ort_fusions(src: Path, model_type: str, target: Target) -> Any:
    from onnxruntime.transformers.optimizer import optimize_model

    return optimize_model(str(src), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0,
                          optimization_options=_options(model_type, target), use_gpu=target == "cuda")


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    large = model.ByteSize() > 1_900_000_000  # protobuf's 2 GB limit: real SD UNets keep weights beside the graph
    onnx.save(model, str(path), save_as_external_data=large, location=f"{path.name}.data" if large else None)


def _standard(src: Path, dst: Path) -> onnx.ModelProto:
    """ORT's basic level, offline: provider-independent rewrites in standard ops; unused opset imports dropped."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    model = onnx.load(str(dst))
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in used or o.domain in ("", "ai.onnx")]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model


def optimize_component(src: Path, dst: Path, component: str, target: Target, fp16: bool) -> dict[str, Any]:
    """Optimize one component's graph for ``target`` into ``dst``; returns its optimize.json entry."""
    model_type = MODEL_TYPES[component]
    config = json.loads((src.parent / "config.json").read_text(encoding="utf-8"))
    result: dict[str, Any] = {"fp16": fp16}
    if target == "tensorrt":
        model = _standard(src, dst)
        check_standard(component, model)
        _save(model, dst)
        result["fusions"] = {}
    else:
        model = onnx.load(str(src))
        expected = expected_attention(component, config)
        fused_src = src
        if target == "cuda" or CPU_FUSED_ATTENTION:
            attention = fuse_attention(model, feeds_for(src, component))
            attention["expected"] = expected
            check_attention(component, expected, attention)
            result["attention"] = attention
            fused_src = dst.parent / "attention_fused.onnx"
            _save(model, fused_src)
        optimized = _ort_fusions(fused_src, model_type, target)
        result["fusions"] = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        if fp16:
            optimized.convert_float_to_float16(keep_io_types=True, op_block_list=list(FP32_KEEP))
            _unique_node_names(optimized.model)
        model = optimized.model
        _save(model, dst)
        if fused_src != src:
            fused_src.unlink()
    ops = [n.op_type for n in model.graph.node]
    result |= {"attention_fused": sum(op in ATTENTION_OPS for op in ops), "domains": domains(model),
               "nodes_before": len(onnx.load(str(src), load_external_data=False).graph.node),
               "nodes_after": len(ops)}
    if "attention" in result:
        result["fusions"]["MultiHeadAttention"] = result["attention"]["fused"]
    return result


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
        elif component == "vae_encoder":  # an image at 8x the latent probe (the tiny VAE's scale factor)
            shape = [1, 3, 64, 64]
        else:
            shape = [d if isinstance(d, int) else 2 for d in arg.shape]
            if component == "unet" and len(shape) == 4:
                shape[2:] = [8, 8]
        if "int" in arg.type:
            feeds[arg.name] = rng.integers(0, 49406, shape).astype(np.int64 if "64" in arg.type else np.int32)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32) * (100.0 if len(shape) <= 1 else 1.0)
    return feeds


def feeds_for(model: Path, component: str) -> dict[str, np.ndarray]:
    """Random inputs of the smallest shapes the component takes (seeded): for probes and output differences."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return _feeds(session, component, np.random.default_rng(0))


def output_difference(a: Path, b: Path, component: str) -> float:
    """Max |difference| over all outputs on the same random inputs (CPU)."""
    sa = ort.InferenceSession(str(a), providers=["CPUExecutionProvider"])
    sb = ort.InferenceSession(str(b), providers=["CPUExecutionProvider"])
    feeds = _feeds(sa, component, np.random.default_rng(0))
    return max(float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max())
               for x, y in zip(sa.run(None, feeds), sb.run(None, feeds), strict=True))


def _no_cpu_kernel(model: Path) -> list[str]:
    """Fused ops in ``model`` without a CPU kernel (fusion_report.KERNELS)."""
    ops = {n.op_type for n in onnx.load(str(model), load_external_data=False).graph.node}
    return sorted(op for op in ops if op in KERNELS and KERNELS[op]["cpu"] is None)


def numerics(src: Path, dst: Path, component: str, target: Target, fp16: bool) -> dict[str, Any]:
    """The CPU check of one optimized component: the whole graph, or (CUDA-only ops present) the same rewrite
    without them, built in a temporary folder."""
    missing = _no_cpu_kernel(dst)
    if not missing:
        return {"max_abs_diff_vs_unoptimized": output_difference(src, dst, component), "checked_graph": "the output"}
    with tempfile.TemporaryDirectory() as tmp:
        twin = Path(tmp) / component / "model.onnx"
        twin.parent.mkdir()
        shutil.copy(src.parent / "config.json", twin.parent / "config.json")
        optimize_component(src, twin, component, "cpu", fp16)
        diff = output_difference(src, twin, component)
    return {"max_abs_diff_vs_unoptimized": diff,
            "checked_graph": f"the same rewrite without the CUDA-only ops ({', '.join(missing)}: no CPU kernel)"}


def optimize_folder(src: Path, out: Path, target: Target = "cpu", fp16: bool = False,
                    vae_fp32: bool = True) -> dict[str, Any]:
    """Copy ``src`` to ``out`` with optimized components; writes optimize.json and a fresh manifest."""
    if fp16 and target == "tensorrt":
        raise ConfigError("--fp16 with --target tensorrt: TensorRT builds fp16 engines from the fp32 graph itself "
                          "(tensorrt.fp16 in the profile); drop --fp16")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("trt", "selftest.json", "optimize.json"))
    report: dict[str, Any] = {"target": target, "fp16": fp16, "components": {},
                              "kernels": {op: KERNELS[op] for op in KERNELS}, "left_out": LEFT_OUT}
    for component in [c for c in MODEL_TYPES if (src / c / "model.onnx").is_file()]:
        half = fp16 and not (component.startswith("vae_") and vae_fp32)
        source, dest = src / component / "model.onnx", out / component / "model.onnx"
        for stale in dest.parent.glob("model.onnx*"):
            stale.unlink()
        result = optimize_component(source, dest, component, target, half)
        result |= numerics(source, dest, component, target, half)
        report["components"][component] = result
        log.info("%s: fusions %s, attention fused: %s", component, result["fusions"], result["attention_fused"])
    (out / "optimize.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    manifest = json.loads((src / "manifest.json").read_text()) if (src / "manifest.json").is_file() else {}
    manifest["source"] = {**manifest.get("source", {}), "optimized": {"target": target, "fp16": fp16}}
    write_model_manifest(out, manifest)
    return report
