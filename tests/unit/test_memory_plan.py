"""The memory plan (engines/health/memory_plan.py): every parameter formula against the module torch builds from
the same config (tiny, mid-size and released sizes, on the meta device: no memory is allocated), the ONNX header
scan against onnx's own reading on real exported folders, and the plan's arithmetic."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.health import memory_plan as mp
from server.cli.doctor import quantity_bytes, render_plan

CONFIGS = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs.json").read_text())
GIB = 1 << 30


def config_folder(root: Path, name: str) -> Path:
    """A config-only folder of a released model (tests/data/model_configs.json): JSON files, no weights."""
    for rel, body in CONFIGS[name].items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_text(json.dumps(body), encoding="utf-8")
    return root / name


def _torch_counts(model: torch.nn.Module, *parts: str) -> tuple[int, int]:
    """(parameters, Linear/Conv weight elements) of ``model`` or of its named children ``parts``."""
    modules = [model.get_submodule(p) for p in parts if getattr(model, p, None) is not None] if parts else [model]
    params = sum(p.numel() for m in modules for p in m.parameters())
    weights = sum(sub.weight.numel() for m in modules for sub in m.modules()
                  if isinstance(sub, torch.nn.Linear | torch.nn.Conv2d))
    return params, weights


def _flux(**kw: Any) -> Any:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(**kw)


def _sd3(**kw: Any) -> Any:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(**kw)


def _unet(**kw: Any) -> Any:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**kw)


def _t5(**kw: Any) -> Any:
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**kw))


def _clip(projection: bool, **kw: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(CLIPTextConfig(**kw))


def _config(model: Any) -> dict[str, Any]:
    config = model.config
    return dict(config.to_dict() if hasattr(config, "to_dict") else config)


FLUX_DEV = CONFIGS["flux-dev"]["transformer/config.json"]
SD35_LARGE = CONFIGS["sd35-large"]["transformer/config.json"]
TINY_CLIP = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=5, vocab_size=1000,
                 projection_dim=16)
DENOISERS: list[tuple[str, Callable[[], Any], Callable[[dict[str, Any]], mp.Tally]]] = [
    ("flux tiny (diffusers' tests)", lambda: _flux(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                                   attention_head_dim=16, num_attention_heads=2,
                                                   joint_attention_dim=32, pooled_projection_dim=32,
                                                   axes_dims_rope=[4, 4, 8]), mp.flux_transformer),
    ("flux mid (patch 2, out channels, guidance)",
     lambda: _flux(patch_size=2, in_channels=4, out_channels=8, num_layers=2, num_single_layers=3,
                   attention_head_dim=16, num_attention_heads=3, joint_attention_dim=40, pooled_projection_dim=24,
                   axes_dims_rope=[4, 4, 8], guidance_embeds=True), mp.flux_transformer),
    ("FLUX.1-dev", lambda: _flux(**{k: v for k, v in FLUX_DEV.items() if not k.startswith("_")}),
     mp.flux_transformer),
    ("sd3 tiny", lambda: _sd3(sample_size=32, patch_size=1, in_channels=4, num_layers=1, attention_head_dim=8,
                              num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                              pooled_projection_dim=64, out_channels=4), mp.sd3_transformer),
    ("sd3.5 mid (dual attention, qk norm)",
     lambda: _sd3(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=3,
                  attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=48,
                  pooled_projection_dim=64, pos_embed_max_size=96, dual_attention_layers=(0, 1),
                  qk_norm="rms_norm"), mp.sd3_transformer),
    ("SD 3.5 Large", lambda: _sd3(**{k: v for k, v in SD35_LARGE.items() if not k.startswith("_")}),
     mp.sd3_transformer),
    ("unet tiny (one attention level)",
     lambda: _unet(block_out_channels=(32, 64), layers_per_block=2, sample_size=32, cross_attention_dim=32,
                   down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                   up_block_types=("CrossAttnUpBlock2D", "UpBlock2D")), mp.unet),
    ("unet inpainting, 3 levels, 1 layer", lambda: _unet(
        block_out_channels=(32, 64, 64), layers_per_block=1, sample_size=32, in_channels=9, cross_attention_dim=24,
        attention_head_dim=4, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")), mp.unet),
    ("SD 1.5", lambda: _unet(**{k: v for k, v in CONFIGS["sd15"]["unet/config.json"].items()
                                if not k.startswith("_")}), mp.unet),
    ("SD 2.1 (linear projections)", lambda: _unet(sample_size=96, cross_attention_dim=1024,
                                                  attention_head_dim=[5, 10, 20, 20], use_linear_projection=True),
     mp.unet),
    ("SDXL (text_time, deep transformers)", lambda: _unet(
        sample_size=128, block_out_channels=(320, 640, 1280), cross_attention_dim=2048,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=[1, 2, 10], attention_head_dim=[5, 10, 20], use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816),
     mp.unet),
    ("t5 tiny (gated)", lambda: _t5(d_model=96, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=1000,
                                    relative_attention_num_buckets=8, feed_forward_proj="gated-gelu"), mp.t5_encoder),
    ("t5 (relu)", lambda: _t5(d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=2, vocab_size=500),
     mp.t5_encoder),
    ("T5-XXL", lambda: _t5(**{k: v for k, v in CONFIGS["flux-dev"]["text_encoder_2/config.json"].items()
                              if k not in ("architectures", "model_type")}), mp.t5_encoder),
]


@pytest.mark.parametrize(("make", "formula"), [d[1:] for d in DENOISERS], ids=[d[0] for d in DENOISERS])
def test_the_formula_counts_what_torch_builds(make: Callable[[], Any],
                                              formula: Callable[[dict[str, Any]], mp.Tally]) -> None:
    with torch.device("meta"):
        model = make()
    tally = formula(_config(model))
    assert (tally.params, tally.adaptable) == _torch_counts(model)


@pytest.mark.parametrize("projection", [False, True])
@pytest.mark.parametrize("config", [TINY_CLIP, CONFIGS["flux-dev"]["text_encoder/config.json"],
                                    CONFIGS["sd35-large"]["text_encoder_2/config.json"]],
                         ids=["tiny", "CLIP-L", "CLIP-G"])
def test_clip_formula(config: dict[str, Any], projection: bool) -> None:
    with torch.device("meta"):
        model = _clip(projection, **{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    tally = mp.clip_text(_config(model), projection)
    assert (tally.params, tally.adaptable) == _torch_counts(model)


@pytest.mark.parametrize("config", [
    dict(block_out_channels=(4,), layers_per_block=1, latent_channels=4, norm_num_groups=1, use_quant_conv=False,
         use_post_quant_conv=False),
    dict(block_out_channels=(32, 64), down_block_types=("DownEncoderBlock2D",) * 2,
         up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1,
         mid_block_add_attention=False),
    {k: v for k, v in CONFIGS["sd15"]["vae/config.json"].items() if not k.startswith("_")},
    {k: v for k, v in CONFIGS["flux-dev"]["vae/config.json"].items() if not k.startswith("_")},
], ids=["tiny", "no mid attention", "SD 1.5", "FLUX.1 (16 channels, no quant convs)"])
def test_vae_halves(config: dict[str, Any]) -> None:
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(**config)
    assert mp.vae_decoder(_config(vae)).params == _torch_counts(vae, "post_quant_conv", "decoder")[0]
    assert mp.vae_encoder(_config(vae)).params == _torch_counts(vae, "encoder", "quant_conv")[0]


@pytest.mark.parametrize(("name", "expected"), [
    ("flux-dev", {"text_encoder": 123_060_480, "text_encoder_2": 4_762_310_656, "transformer": 11_901_408_320}),
    ("sd35-large", {"text_encoder": 123_650_304, "text_encoder_2": 694_659_840, "text_encoder_3": 4_762_310_656,
                    "transformer": 8_056_627_520}),
    ("sd15", {"text_encoder": 123_060_480, "unet": 859_520_964}),
])
def test_released_configs_give_the_released_sizes(tmp_path: Path, name: str, expected: dict[str, int]) -> None:
    plan = mp.plan(config_folder(tmp_path, name), mp.Served(1024, 1024, 1))
    parts = {c["name"]: c for c in plan["components"]}
    assert {k: parts[k]["params"] for k in expected} == expected
    vae = parts["vae_decoder"]["params"] + parts["vae_encoder"]["params"]
    assert vae == (83_653_863 if name == "sd15" else 83_819_683)  # AutoencoderKL: both halves, quant convs
    assert all(c["source"] == "config" for c in parts.values()) and plan["missing"] == []


def test_flux_dev_under_tensorrt_is_bf16_and_its_lora_variant_is_the_fp32_export(tmp_path: Path) -> None:
    plan = mp.plan(config_folder(tmp_path, "flux-dev"), mp.Served(1024, 1024, 1))
    parts = {c["name"]: c for c in plan["components"]}
    t = parts["transformer"]
    assert (t["dtype"], t["weights"], t["stored_dtype"], t["variant_bytes"]) == (
        "bf16", 2 * 11_901_408_320, "fp32", 4 * 11_901_408_320)
    assert t["external"] and not parts["text_encoder"]["external"]  # over 2 GiB at fp32: external data
    assert parts["text_encoder"]["dtype"] == "fp16" and parts["vae_decoder"]["dtype"] == "bf16"
    assert parts["vae_decoder"]["variant_bytes"] == 0  # LoRA adapts text encoders and the denoiser only
    d = plan["device"]
    assert d["weights"] == sum(c["weights"] for c in parts.values())
    assert d["base"] == d["weights"] + d["activations"] + mp.OVERHEAD
    assert d["lora_denoiser"] == (d["base"] + t["variant_bytes"] + t["merge_buffers"] + d["lora_cache"]
                                  + t["variant_activations"])
    assert d["base"] < d["lora_denoiser"] < d["lora_all"]
    assert d["largest_set"] == t["adaptable_bytes"] > d["lora_cache"] and not d["largest_set_fits_cache"]
    h = plan["host"]
    assert h["peak_load"] == mp.OVERHEAD + t["weights"]  # the largest engine, read whole before deserializing
    assert h["page_cache"] == 0 < h["page_cache_lora"]  # TensorRT never reads the ONNX files; the variants do


def test_activations_follow_the_formula(tmp_path: Path) -> None:
    """Flux at 1024x1024: 512 T5 tokens + 64x64 packed latents, width 3072, 24 heads, bf16, one row per image."""
    one = mp.plan(config_folder(tmp_path, "flux-dev"), mp.Served(1024, 1024, 1))
    two = mp.plan(tmp_path / "flux-dev", mp.Served(1024, 1024, 2))
    tokens = 512 + 64 * 64
    expected = tokens * 3072 * 20 * 2 + 24 * tokens**2 * 4
    act = {c["name"]: c["activations"] for c in one["components"]}
    assert act["transformer"] == expected
    assert {c["name"]: c["activations"] for c in two["components"]}["transformer"] == 2 * expected
    sd15 = mp.plan(config_folder(tmp_path, "sd15"), mp.Served(512, 512, 1))
    assert sd15["served"]["rows"] == 2  # classifier-free guidance doubles the UNet's rows


def test_engines_per_size_and_the_cuda_policy(tmp_path: Path) -> None:
    folder = config_folder(tmp_path, "flux-dev")
    one, two = mp.plan(folder, mp.Served(1024, 1024, 1)), mp.plan(folder, mp.Served(1024, 1024, 1, sizes=2))
    assert two["device"]["weights"] == 2 * one["device"]["weights"]  # one engine per served size, each its weights
    assert two["device"]["activations"] == 2 * one["device"]["activations"]
    cuda = mp.plan(folder, mp.Served(1024, 1024, 1, sizes=2, tensorrt=False))
    parts = {c["name"]: c for c in cuda["components"]}
    assert cuda["served"]["engines_per_component"] == 1 and parts["transformer"]["dtype"] == "fp32"
    assert cuda["device"]["activations"] == max(c["activations"] for c in parts.values())  # one shared arena
    assert cuda["host"]["page_cache"] == sum(c["file_bytes"] for c in parts.values() if c["external"])


def test_dtype_override_and_budgets(tmp_path: Path) -> None:
    folder = config_folder(tmp_path, "flux-dev")
    fp32 = mp.plan(folder, mp.Served(1024, 1024, 1), "fp32", mp.Budgets(80 * GIB, "test", 32 * GIB, "pod"))
    assert {c["dtype"] for c in fp32["components"]} == {"fp32"}
    verdicts = fp32["device"]["verdicts"]
    assert verdicts["base"]["fits"] and not verdicts["lora_denoiser"]["fits"]
    assert verdicts["lora_denoiser"]["margin"] == 80 * GIB - fp32["device"]["lora_denoiser"] < 0
    assert not fp32["host"]["verdicts"]["peak_load"]["fits"]  # a 44 GiB fp32 engine read whole: over 32 GiB
    with pytest.raises(ModelLoadError, match="dtype 'int8'"):
        mp.plan(folder, mp.Served(1024, 1024, 1), "int8")


def test_a_refused_or_empty_folder_says_why(tmp_path: Path) -> None:
    kontext = tmp_path / "kontext"
    kontext.mkdir()
    (kontext / "model_index.json").write_text(json.dumps({"_class_name": "FluxKontextInpaintPipeline"}))
    with pytest.raises(ModelLoadError, match="Kontext inpainting"):
        mp.plan(kontext, mp.Served(1024, 1024, 1))
    with pytest.raises(ModelLoadError, match="not a folder"):
        mp.plan(tmp_path / "nowhere", mp.Served(1024, 1024, 1))


def test_for_runtime_reads_the_policy(tmp_path: Path) -> None:
    folder = config_folder(tmp_path, "sd15")
    trt = mp.for_runtime(folder, RuntimeSettings(), 512, 512, 4, 1, None, mp.Budgets())
    cuda = mp.for_runtime(folder, RuntimeSettings(providers=("CUDAExecutionProvider",), lora={"cache_mb": 64}),
                          512, 512, 4, 1, None, mp.Budgets())
    assert {c["dtype"] for c in trt["components"]} == {"fp16"} and trt["served"]["policy"] == "tensorrt"
    assert {c["dtype"] for c in cuda["components"]} == {"fp32"} and cuda["device"]["lora_cache"] == 64 << 20


# ---- exported folders: the header scan ------------------------------------------------------------------------

def _onnx_counts(path: Path) -> tuple[dict[int, int], set[str]]:
    model = onnx.load(str(path), load_external_data=False)
    elements: dict[int, int] = {}
    for init in model.graph.initializer:
        elements[init.data_type] = elements.get(init.data_type, 0) + math.prod(init.dims)
    names = {i.name for i in model.graph.initializer}
    weights = {n.input[1] for n in model.graph.node
               if n.op_type in ("MatMul", "Gemm", "Conv") and len(n.input) > 1 and n.input[1] in names}
    return elements, weights


@pytest.mark.parametrize("component", ["text_encoder", "unet", "vae_decoder", "vae_encoder"])
def test_the_scan_reads_what_onnx_reads(tiny_model: Path, component: str) -> None:
    path = tiny_model / component / "model.onnx"
    scan = mp.scan_onnx(path)
    assert (scan.elements, scan.weight_names) == _onnx_counts(path)
    assert scan.external == set()


def test_exported_unet_folder_matches_its_configs(tiny_model: Path) -> None:
    """The files' counts against the configs' formulas: the Linear/Conv weights (LoRA's targets) one for one; the
    rest within 1% (the exporter folds a few norm and embedding constants)."""
    plan = mp.plan(tiny_model, mp.Served(64, 64, 1))
    lay = mp.layout(tiny_model)
    for c in plan["components"]:
        tally = mp.count(c["kind"], json.loads((tiny_model / c["name"] / "config.json").read_text()))
        assert c["source"] == "onnx" and c["stored_dtype"] == "fp32"
        assert abs(c["params"] - tally.params) <= tally.params / 100, c["name"]
        if c["adaptable"]:
            assert c["adaptable_bytes"] == 4 * tally.adaptable, c["name"]
        size = (tiny_model / c["name"] / "model.onnx").stat().st_size
        assert c["file_bytes"] == size and c["weights"] == 2 * c["params"]  # fp16 engines under TensorRT
    assert lay.family == "sd1"


def test_exported_flux_folder_matches_torch(dit_build: Callable[[str], tuple[Path, Path]]) -> None:
    from diffusers import FluxTransformer2DModel
    from transformers import T5EncoderModel

    onnx_dir, diffusers_dir = dit_build("flux")
    plan = mp.plan(onnx_dir, mp.Served(64, 64, 1))
    parts = {c["name"]: c for c in plan["components"]}
    assert plan["family"] == "flux" and set(parts) == {"text_encoder", "text_encoder_2", "transformer",
                                                       "vae_decoder", "vae_encoder"}
    for name, kind in (("transformer", FluxTransformer2DModel), ("text_encoder_2", T5EncoderModel)):
        params, weights = _torch_counts(kind.from_pretrained(diffusers_dir / name))
        assert abs(parts[name]["params"] - params) <= params / 100 and parts[name]["source"] == "onnx"
        assert parts[name]["adaptable_bytes"] == 4 * weights


def test_external_data_is_sized_by_stat_and_typed_from_the_graph(tmp_path: Path) -> None:
    """fp16 weights kept beside the graph: the scan names the data file and its type without reading it."""
    w = numpy_helper.from_array(np.ones((64, 32), np.float16), "w")
    shape = numpy_helper.from_array(np.array([1, 32], np.int64), "shape")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="/proj/MatMul")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 32])], [w, shape])
    path = tmp_path / "unet" / "model.onnx"
    path.parent.mkdir()
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, location="weights.bin",
              size_threshold=0)
    scan = mp.scan_onnx(path)
    assert scan.external == {"weights.bin"} and scan.elements == {TensorProto.FLOAT16: 2048, TensorProto.INT64: 2}
    assert scan.weight_names == {"w"}
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"block_out_channels": [32]}))
    layout = mp.Layout("sd1", {"unet": "unet"}, True, 0, {})
    c = mp.component(tmp_path, "unet", "unet", layout, mp.Served(64, 64, 1, tensorrt=False), None)
    assert (c.stored_dtype, c.dtype, c.params, c.external) == ("fp16", "fp16", 2048, True)
    assert c.file_bytes == path.stat().st_size + (tmp_path / "unet" / "weights.bin").stat().st_size
    assert (c.weights, c.adaptable_bytes, c.variant_bytes) == (2048 * 2 + 16, 2048 * 2, 2048 * 2 + 16)
    (tmp_path / "unet" / "weights.bin").unlink()
    with pytest.raises(ModelLoadError, match="external data file"):
        mp.component(tmp_path, "unet", "unet", layout, mp.Served(64, 64, 1), None)


def test_a_broken_file_or_config_is_a_model_error(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\x3a\xff\xff\xff\xff\x0f")  # graph field, length past the end
    with pytest.raises(ModelLoadError, match="not a readable ONNX model"):
        mp.scan_onnx(path)
    folder = config_folder(tmp_path, "flux-dev")
    (folder / "transformer" / "config.json").write_text(json.dumps({**FLUX_DEV, "num_layers": "many"}))
    with pytest.raises(ModelLoadError, match="config.json holds values"):
        mp.plan(folder, mp.Served(1024, 1024, 1))


# ---- doctor's side -------------------------------------------------------------------------------------------

def test_pod_quantities() -> None:
    assert [quantity_bytes(q) for q in ("32Gi", "4Gi", "512Mi", "1G", "1000")] == [
        32 * GIB, 4 * GIB, 512 << 20, 10**9, 1000]
    with pytest.raises(ValueError, match="invalid literal"):
        quantity_bytes("lots")


def test_render_names_each_verdict(tmp_path: Path) -> None:
    plan = mp.plan(config_folder(tmp_path, "flux-dev"), mp.Served(1024, 1024, 1),
                   budgets=mp.Budgets(60 * GIB, "--device-memory-gib", 32 * GIB, "pod limit 32Gi"))
    text = "\n".join(render_plan(plan))
    assert "device without LoRA: 40.99 GiB" in text and "fits in 60.00 GiB (--device-memory-gib)" in text
    assert "device with LoRA on the transformer: 91.22 GiB  DOES NOT FIT in 60.00 GiB" in text
    assert "such a set is refused; with cache_mb >= 45389" in text
    assert render_plan({"error": "no family"}) == ["memory plan: unavailable: no family"]
