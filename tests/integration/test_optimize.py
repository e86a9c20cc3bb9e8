"""`engines optimize` on the tiny models, on this CPU machine: one export, a cuda target with every attention fused
(counted against the config, checked on the CPU), a tensorrt target in standard ONNX only, and the build refusing
a partial fusion. Kernel availability claims (fusion_report.KERNELS) are checked against ONNX Runtime itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines.artifacts import verify_model
from engines.build import optimize
from engines.build.attention_fusion import fuse_attention
from engines.build.fusion_report import attention_summary, check_attention, expected_attention
from engines.build.optimize import feeds_for, output_difference, unsupported_widths
from engines.errors import ArtifactError

TOLERANCE = 1e-4
"""Max |difference| of any output vs the unoptimized graph on the same inputs (fp32; seen: <= 5e-6)."""


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True, timeout=600)


def _optimize(model: Path, out: Path, target: str) -> dict[str, Any]:
    """`sdserve engines optimize` in a subprocess, as a user runs it; its optimize.json."""
    done = _cli("engines", "optimize", "--model", str(model), "--out", str(out), "--target", target)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads((out / "optimize.json").read_text()))


@pytest.fixture(scope="module")
def families(tiny_family: Callable[[str], Path]) -> dict[str, Path]:
    """The tiny models of the other UNet families (tests/conftest.py ``tiny_family``: shared with the support matrix,
    read only here)."""
    return {f: tiny_family(f) for f in ("sd2", "sdxl", "turbo")}


def _components(model: Path) -> list[str]:
    return sorted(p.parent.name for p in model.glob("*/model.onnx"))


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"]).run(None, feeds)


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_config_counts_match_the_exported_attention(tiny_model: Path, families: dict[str, Path]) -> None:
    """The config-derived count is an independent oracle: one Softmax per exported attention."""
    seen = {}
    for name, model in {"sd1": tiny_model, **families}.items():
        for component in _components(model):
            config = json.loads((model / component / "config.json").read_text())
            graph = onnx.load(str(model / component / "model.onnx"))
            softmax = sum(n.op_type == "Softmax" for n in graph.graph.node)
            assert expected_attention(component, config) == softmax, (name, component)
            seen[f"{name}/{component}"] = softmax
    assert seen["sd1/unet"] == 12 and seen["sdxl/unet"] == 24 and seen["sdxl/text_encoder_2"] == 5
    assert seen["sd1/vae_decoder"] == 1


@pytest.mark.parametrize("family", ["sd2", "sdxl", "turbo"])
def test_every_attention_of_each_family_fuses_within_tolerance(family: str, families: dict[str, Path]) -> None:
    """The cuda target's attention rewrite on the other families (sd1 runs the whole CLI below)."""
    model = families[family]
    for component in _components(model):
        path = model / component / "model.onnx"
        feeds = feeds_for(path, component)
        graph = onnx.load(str(path))
        report = fuse_attention(graph, feeds)
        expected = expected_attention(component, json.loads((model / component / "config.json").read_text()))
        check_attention(component, expected, report)
        assert report["fused"] == expected and not report["unfused"]
        assert not any(n.op_type == "Softmax" for n in graph.graph.node)
        assert _max_diff(_run(graph, feeds), _run(path, feeds)) < TOLERANCE, (family, component)


def test_cuda_target_fuses_every_attention_and_matches_on_cpu(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "cuda"
    report = _optimize(tiny_model, out, "cuda")
    for name, component in report["components"].items():
        assert component["attention"]["fused"] == component["attention"]["expected"] > 0, name
        assert component["fusions"]["MultiHeadAttention"] == component["attention_fused"]
        assert component["max_abs_diff_vs_unoptimized"] < TOLERANCE, name
    unet = report["components"]["unet"]
    assert {"GroupNorm", "SkipGroupNorm", "NhwcConv"} <= set(unet["fusions"])
    # The tiny UNet's GEGLU widths (8 x its block channels) are not ones BiasSplitGelu's CUDA kernel takes
    # (bias_split_gelu.cc): the fusion is refused, named, and no node of an unsupported width is left.
    config = json.loads((tiny_model / "unet" / "config.json").read_text())
    geglu = {8 * c for c, kind in zip(config["block_out_channels"], config["down_block_types"], strict=True)
             if "CrossAttn" in kind}  # a transformer block's GEGLU projects C to 2 x 4C
    refused = unet["cuda_fusions_refused"]["BiasSplitGelu"]
    assert refused["widths"] == sorted(geglu) and 2560 in refused["supported"]
    assert "BiasSplitGelu" not in unet["fusions"] and "BiasAdd" not in unet["fusions"]
    assert unsupported_widths(onnx.load(str(out / "unet" / "model.onnx"))) == {}
    # CLIP's fused attention carries the causal mask as attention_bias at S = 77: unfused on CUDA, and said so.
    clip = report["components"]["text_encoder"]["cuda_attention"]
    assert clip["with_attention_bias"] == clip["nodes"] > 0 and clip["kernel"].startswith("unfused on CUDA")
    assert report["components"]["unet"]["cuda_attention"]["with_attention_bias"] == 0
    assert "GroupNorm" in unet["checked_graph"]  # checked on the twin without CUDA-only ops, and says so
    assert report["kernels"]["MultiHeadAttention"]["cpu"].endswith("cpu/bert/multihead_attention.cc")
    assert "packed QKV / packed KV" in report["left_out"]
    verify_model(out, "full")
    summary = attention_summary(out)  # what `sdserve accept` reads
    assert summary["unet"] == {"target": "cuda", "expected": 12, "fused_in_graph": 12}
    assert all(c["expected"] == c["fused_in_graph"] for c in summary.values())
    # The CUDA-only ops really have no CPU kernel (KERNELS says None): ORT refuses the graph on the CPU.
    with pytest.raises(Exception, match="GroupNorm|NhwcConv|BiasSplitGelu|SkipGroupNorm"):
        ort.InferenceSession(str(out / "unet" / "model.onnx"), providers=["CPUExecutionProvider"])


def test_tensorrt_target_stays_standard_onnx(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "trt"
    report = _optimize(tiny_model, out, "tensorrt")
    for name, component in report["components"].items():
        graph = onnx.load(str(out / name / "model.onnx"))
        assert {n.domain for n in graph.graph.node} <= {""}, name
        assert {o.domain for o in graph.opset_import} <= {"", "ai.onnx"}, name
        assert component["attention_fused"] == 0 and component["max_abs_diff_vs_unoptimized"] < TOLERANCE
        assert component["nodes_after"] < component["nodes_before"]


def test_a_partial_fusion_fails_the_build(tiny_model: Path, tmp_path: Path) -> None:
    """One attention whose pattern the rewrite cannot take (an Identity between Softmax and P.V) is named."""
    path = tiny_model / "unet" / "model.onnx"
    graph = onnx.load(str(path))
    softmax = next(n for n in graph.graph.node if n.op_type == "Softmax")
    user = next(n for n in graph.graph.node if softmax.output[0] in n.input)
    user.input[list(user.input).index(softmax.output[0])] = "probe_identity"
    graph.graph.node.append(onnx.helper.make_node("Identity", [softmax.output[0]], ["probe_identity"]))
    report = fuse_attention(graph, feeds_for(path, "unet"))
    assert report["fused"] == 11 and list(report["unfused"]) == [softmax.name]
    with pytest.raises(ArtifactError, match="11 fused attention node.*has 12"):
        check_attention("unet", 12, report)


def test_a_config_that_disagrees_with_the_graph_exits_23(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config_file = model / "text_encoder" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_hidden_layers": 6}))
    done = _cli("engines", "optimize", "--model", str(model), "--out", str(tmp_path / "out"), "--target", "cuda")
    assert done.returncode == 23, done.stderr[-2000:]  # ExitCode.ARTIFACT_INVALID
    assert "text_encoder: 5 fused attention node(s), its config has 6" in done.stdout + done.stderr


def test_the_fused_node_carries_the_causal_mask(tiny_model: Path) -> None:
    """CLIP's causal mask becomes MultiHeadAttention's attention_bias: without it the output changes."""
    path = tiny_model / "text_encoder" / "model.onnx"
    feeds = feeds_for(path, "text_encoder")
    graph = onnx.load(str(path))
    fuse_attention(graph, feeds)
    reference = _run(path, feeds)
    assert _max_diff(_run(graph, feeds), reference) < TOLERANCE
    for node in graph.graph.node:
        if node.op_type == "MultiHeadAttention":
            assert node.input[5]
            node.input[5] = ""
    assert _max_diff(_run(graph, feeds), reference) > 1e-3


def test_a_model_past_the_protobuf_limit_is_saved_with_external_initializers(
        tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensorrt target's optimized-model save (ORT's optimized_model_filepath) writes the initializers beside
    the graph once the weights pass the limit (2 GB for real; lowered here): without it ORT serializes one
    ModelProto and protobuf fails past 2 GB (ORT #12882)."""
    monkeypatch.setattr(optimize, "PROTOBUF_LIMIT", 100_000)
    src = tiny_model / "text_encoder" / "model.onnx"
    raw = tmp_path / "raw" / "model.onnx"
    raw.parent.mkdir()
    ort.InferenceSession(str(src), optimize.standard_options(src, raw), providers=["CPUExecutionProvider"])
    written = onnx.load(str(raw), load_external_data=False)
    assert (raw.parent / "model.onnx.data").stat().st_size > 100_000
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in written.graph.initializer)
    dst = tmp_path / "text_encoder" / "model.onnx"
    optimize.optimize_component(src, dst, "text_encoder", "tensorrt", False)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert output_difference(src, dst, "text_encoder") < TOLERANCE
