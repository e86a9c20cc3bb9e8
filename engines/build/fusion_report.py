"""What `engines optimize` promises per target, checked: attention blocks from each component's config against the
fused nodes in its graph, the kernel each fused op runs on, and TensorRT graphs in standard ONNX only.

Kernel sources named here were read in ONNX Runtime's repository (1.31 line); ``None`` means no kernel of that op is
registered for that provider, so a graph holding it cannot run there (CPU numerics are then checked on the graph
before the CUDA-only fusions, see optimize.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from engines.errors import ArtifactError

KERNELS: dict[str, dict[str, str | None]] = {
    "MultiHeadAttention": {"cpu": "onnxruntime/contrib_ops/cpu/bert/multihead_attention.cc",
                           "cuda": "onnxruntime/contrib_ops/cuda/bert/multihead_attention.cc"},
    "SkipLayerNormalization": {"cpu": "onnxruntime/contrib_ops/cpu/skip_layer_norm.cc",
                               "cuda": "onnxruntime/contrib_ops/cuda/bert/skip_layer_norm.cc"},
    "BiasGelu": {"cpu": "onnxruntime/contrib_ops/cpu/bert/bias_gelu.cc",
                 "cuda": "onnxruntime/contrib_ops/cuda/bert/fast_gelu.cc"},
    "QuickGelu": {"cpu": "onnxruntime/contrib_ops/cpu/activations.cc",
                  "cuda": "onnxruntime/contrib_ops/cuda/activation/activations.cc"},
    "GroupNorm": {"cpu": None, "cuda": "onnxruntime/contrib_ops/cuda/diffusion/group_norm.cc"},
    "SkipGroupNorm": {"cpu": None, "cuda": "onnxruntime/contrib_ops/cuda/diffusion/group_norm.cc"},
    "BiasSplitGelu": {"cpu": None, "cuda": "onnxruntime/contrib_ops/cuda/diffusion/bias_split_gelu.cc"},
    "NhwcConv": {"cpu": None, "cuda": "onnxruntime/contrib_ops/cuda/diffusion/nhwc_conv.cc"},
    "BiasAdd": {"cpu": None, "cuda": "onnxruntime/contrib_ops/cuda/diffusion/bias_add.cc"},
}
LEFT_OUT = {
    "packed QKV / packed KV": "not applied: ORT's CPU kernel refuses packed inputs (\"Packed QKV of shape (B, L, N, 3, "
    "H) not implemented for CPU\", onnxruntime/contrib_ops/cpu/bert/multihead_attention.cc), so their numerics "
    "cannot be checked on a machine without a GPU; the CUDA kernel takes separate Q/K/V and lays them out itself "
    "(onnxruntime/contrib_ops/cuda/bert/attention_prepare_qkv.cu), and separate weights keep LoRA-style weight "
    "updates a plain initializer swap. Measure packed against separate on a GPU before turning it on.",
}
STANDARD_DOMAINS = ("", "ai.onnx")


def _per_level(value: Any, levels: int) -> list[int]:
    if isinstance(value, int):
        return [value] * levels
    return [sum(v) if isinstance(v, list | tuple) else int(v) for v in value]


def unet_attention_blocks(config: dict[str, Any]) -> int:
    """Attention layers of a diffusers UNet2DConditionModel config: two (self + cross) per transformer block, in
    the cross-attention down blocks, the cross-attention mid block and the cross-attention up blocks."""
    down = list(config["down_block_types"])
    levels = len(down)
    layers = _per_level(config.get("layers_per_block", 2), levels)
    per_block = _per_level(config.get("transformer_layers_per_block", 1), levels)
    reverse = config.get("reverse_transformer_layers_per_block")
    up_per_block = _per_level(reverse, levels) if reverse else per_block[::-1]
    blocks = sum(n * t for kind, n, t in zip(down, layers, per_block, strict=True) if "CrossAttn" in kind)
    blocks += sum((n + 1) * t for kind, n, t in zip(config["up_block_types"], layers[::-1], up_per_block,
                                                     strict=True) if "CrossAttn" in kind)
    mid = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if mid == "UNetMidBlock2DCrossAttn":
        blocks += per_block[-1]
    return 2 * blocks


def expected_attention(component: str, config: dict[str, Any]) -> int:
    """How many attention layers ``component`` has, from its config.json alone."""
    if component.startswith("text_encoder"):
        return int(config["num_hidden_layers"])
    if component == "unet":
        return unet_attention_blocks(config)
    if component in ("vae_decoder", "vae_encoder"):  # AutoencoderKL: one single-head attention in each mid block
        return 1 if config.get("mid_block_add_attention", True) else 0
    raise ValueError(f"unknown component {component!r}")


def domains(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.domain or "ai.onnx" for n in model.graph.node))


def check_attention(component: str, expected: int, attention: dict[str, Any]) -> None:
    """Refuse the build when the fused attention count is not the config's: a partial fusion would serve."""
    if attention["fused"] != expected:
        left = "; ".join(f"{k}: {v}" for k, v in list(attention["unfused"].items())[:3])
        raise ArtifactError(f"{component}: {attention['fused']} fused attention node(s), its config has {expected} "
                            f"attention layer(s); not fused: {left or 'none found'}")


def check_standard(component: str, model: onnx.ModelProto) -> None:
    """TensorRT's ONNX parser imports standard ops only: refuse a graph with any other domain."""
    odd = {d: n for d, n in domains(model).items() if d not in STANDARD_DOMAINS}
    if odd:
        raise ArtifactError(f"{component}: the tensorrt target must stay standard ONNX, found {odd}")


def attention_summary(model_dir: Path) -> dict[str, dict[str, Any]]:
    """Per component of an optimized model folder: attention layers expected (config), fused nodes found in the
    graph file, and the target it was optimized for (optimize.json). For `sdserve accept`, beside the placement
    audit's per-provider count of those nodes; {} for a folder `engines optimize` did not write."""
    report_file = model_dir / "optimize.json"
    if not report_file.is_file():
        return {}
    report = json.loads(report_file.read_text(encoding="utf-8"))
    out: dict[str, dict[str, Any]] = {}
    for component in report.get("components", {}):
        graph = onnx.load(str(model_dir / component / "model.onnx"), load_external_data=False)
        fused = sum(1 for n in graph.graph.node if n.op_type == "MultiHeadAttention")
        config = json.loads((model_dir / component / "config.json").read_text(encoding="utf-8"))
        out[component] = {"target": report.get("target"), "expected": expected_attention(component, config),
                          "fused_in_graph": fused}
    return out
