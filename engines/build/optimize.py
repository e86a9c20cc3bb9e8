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
and measured faster than the unfused graph at 256x256 and up (docs/benchmarks.md)."""


CUDA_WIDTHS: dict[str, tuple[str, frozenset[int]]] = {
    # op -> (its fusion option, the last-dim widths its CUDA kernel takes). Checked at run time by the kernel
    # ("Number of channels should be 320, 640 or 1280", contrib_ops/cuda/diffusion/bias_add.cc; "hidden size should
    # be 2560, 5120 or 10240", contrib_ops/cuda/diffusion/bias_split_gelu.cc), never by ORT's fusions, and the
    # CPU numerics twin cannot run them: a graph fused at another width only fails on a GPU.
    "BiasAdd": ("enable_bias_add", frozenset({320, 640, 1280})),
    "BiasSplitGelu": ("enable_bias_splitgelu", frozenset({2560, 5120, 10240})),
}


def unsupported_widths(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Per CUDA-only op of CUDA_WIDTHS in ``model``, the widths (its bias initializer's length; -1 when the bias is
    not an initializer) its CUDA kernel refuses."""
    sizes = {i.name: list(i.dims) for i in model.graph.initializer}
    found: dict[str, list[int]] = {}
    for node in model.graph.node:
        if node.op_type in CUDA_WIDTHS:
            dims = sizes.get(node.input[1]) if len(node.input) > 1 else None
            width = dims[-1] if dims else -1
            if width not in CUDA_WIDTHS[node.op_type][1]:
                found.setdefault(node.op_type, []).append(width)
    return {op: sorted(set(widths)) for op, widths in found.items()}


def _options(model_type: str, target: Target, refused: tuple[str, ...] = ()) -> Any:
    from onnxruntime.transformers.fusion_options import FusionOptions

    options = FusionOptions(model_type)
    for name in (CUDA_ONLY if target != "cuda" else refused):
        setattr(options, name, False)
    # Attention is ours (attention_fusion.py); ORT's matchers raise or find nothing on these exports. Packed QKV/KV
    # is left out (fusion_report.LEFT_OUT).
    options.enable_attention = False
    options.enable_packed_qkv = options.enable_packed_kv = False
    return options


def _ort_fusions(src: Path, model_type: str, target: Target, refused: tuple[str, ...] = ()) -> Any:
    from onnxruntime.transformers.optimizer import optimize_model

    return optimize_model(str(src), model_type=model_type, num_heads=0, hidden_size=0, opt_level=0,
                          optimization_options=_options(model_type, target, refused), use_gpu=target == "cuda")


def _guarded_fusions(src: Path, model_type: str, target: Target, result: dict[str, Any]) -> Any:
    """ORT's fusions; for ``cuda``, done again without a CUDA-only fusion that produced a width its kernel
    refuses (recorded in ``result["cuda_fusions_refused"]``), so `--target cuda` never ships a graph that fails on
    the GPU."""
    optimized = _ort_fusions(src, model_type, target)
    refused = unsupported_widths(optimized.model) if target == "cuda" else {}
    if not refused:
        return optimized
    result["cuda_fusions_refused"] = {op: {"widths": w, "supported": sorted(CUDA_WIDTHS[op][1])}
                                      for op, w in refused.items()}
    log.warning("%s: not fusing %s: widths %s are not ones the CUDA kernels take", src.parent.name,
                ", ".join(refused), refused)
    return _ort_fusions(src, model_type, target, tuple(CUDA_WIDTHS[op][0] for op in refused))


PROTOBUF_LIMIT = 1_900_000_000
"""Bytes of weights above which a graph is saved with its initializers in a file beside it: protobuf refuses to
serialize a message over 2 GB (ORT #12882, "Protobuf serialization failed"); the fp32 SD 1.5 UNet is ~3.4 GB."""


def _save(model: onnx.ModelProto, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    large = model.ByteSize() > PROTOBUF_LIMIT  # real SD UNets keep their weights beside the graph
    onnx.save(model, str(path), save_as_external_data=large, location=f"{path.name}.data" if large else None)


def weight_bytes(model: Path) -> int:
    """The model file and every external-data file beside it that it names (weights are not read)."""
    proto = onnx.load(str(model), load_external_data=False)
    files = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    return model.stat().st_size + sum((model.parent / f).stat().st_size for f in files
                                      if (model.parent / f).is_file())


def standard_options(src: Path, dst: Path) -> ort.SessionOptions:
    """ORT's basic level, saving the optimized graph to ``dst``, its initializers beside it past PROTOBUF_LIMIT."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(dst)
    if weight_bytes(src) > PROTOBUF_LIMIT:
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         f"{dst.name}.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return options


def _standard(src: Path, dst: Path) -> onnx.ModelProto:
    """ORT's basic level, offline: provider-independent rewrites in standard ops; unused opset imports dropped.
    A model past PROTOBUF_LIMIT is written with its initializers in ``<dst>.data`` (session config keys
    session.optimized_model_external_initializers_file_name / _min_size_in_bytes,
    onnxruntime_session_options_config_keys.h), which a single ModelProto could not hold."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    ort.InferenceSession(str(src), standard_options(src, dst), providers=["CPUExecutionProvider"])
    model = onnx.load(str(dst))
    _remove(dst.parent / f"{dst.name}.data")  # in memory now; _save writes it again (onnx appends to a data file)
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
        optimized = _guarded_fusions(fused_src, model_type, target, result)
        result["fusions"] = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        if fp16:
            optimized.convert_float_to_float16(keep_io_types=True, op_block_list=list(FP32_KEEP))
            _unique_node_names(optimized.model)
        model = optimized.model
        if target == "cuda":
            result["cuda_attention"] = _cuda_attention(model, component, config, fp16)
        _save(model, dst)
        if fused_src != src:
            _remove(fused_src, fused_src.parent / f"{fused_src.name}.data")
    ops = [n.op_type for n in model.graph.node]
    result |= {"attention_fused": sum(op in ATTENTION_OPS for op in ops), "domains": domains(model),
               "nodes_before": len(onnx.load(str(src), load_external_data=False).graph.node),
               "nodes_after": len(ops)}
    if "attention" in result:
        result["fusions"]["MultiHeadAttention"] = result["attention"]["fused"]
    return result


def cuda_attention_kernel(sequence_length: int | None, has_bias: bool, fp16: bool) -> str:
    """The kernel ORT's CUDA MultiHeadAttention picks for a fused attention, from the conditions in
    contrib_ops/cuda/bert/multihead_attention.cc (ComputeInternal): flash, cuDNN SDPA and the TensorRT fused
    runners all need ``attention_bias`` absent; memory-efficient attention takes a bias only when
    ``S % (4 * sizeof(T)) == 0`` (and, in fp32, a sequence past MinSeqLenForEfficientAttentionFp32). Else it runs
    the unfused path (cuBLAS GEMMs, a softmax kernel, the S x S scores in memory). CLIP's causal mask is such a
    bias, and S = 77 is a multiple of neither 16 (fp32) nor 8 (fp16): CLIP attention runs unfused on CUDA."""
    if not has_bias:
        return "fused (no attention_bias: flash or memory-efficient attention)"
    align = 4 * (2 if fp16 else 4)
    if sequence_length is not None and sequence_length % align == 0:
        return (f"memory-efficient attention (attention_bias, S={sequence_length} a multiple of {align}"
                + ("" if fp16 else ", if past the fp32 length threshold") + ")")
    return (f"unfused on CUDA: attention_bias rules out flash, cuDNN SDPA and the fused runners, and S="
            f"{sequence_length if sequence_length is not None else 'unknown'} is not a multiple of {align}, which "
            "memory-efficient attention needs with a bias")


def _cuda_attention(model: onnx.ModelProto, component: str, config: dict[str, Any], fp16: bool) -> dict[str, Any]:
    """What optimize.json says about the CUDA kernel of the component's fused attention (with a bias or not)."""
    nodes = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    biased = sum(1 for n in nodes if len(n.input) > 5 and n.input[5])
    length = config.get("max_position_embeddings") if component.startswith("text_encoder") else None
    kernel = cuda_attention_kernel(length if isinstance(length, int) else None, biased > 0, fp16)
    if kernel.startswith("unfused"):
        log.warning("%s: %d fused attention node(s) run unfused on CUDA: %s", component, biased, kernel)
    return {"nodes": len(nodes), "with_attention_bias": biased, "kernel": kernel}


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


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
