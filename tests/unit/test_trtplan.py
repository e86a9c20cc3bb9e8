"""The TensorRT build plan on synthetic graphs shaped like optimum's SD exports (symbolic batch, sequence, channels):
every dim resolved from the configs, one profile per engine, one engine per size, only relative paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest
from onnx import TensorProto, helper

from engines.artifacts import COMPONENTS
from engines.build import trtplan
from engines.build.trt_build import session_options
from engines.errors import ArtifactError

# Input dims as optimum-cli names them (optimum/exporters/onnx/model_configs.py, UNetOnnxConfig & friends).
OPTIMUM: dict[str, dict[str, list[int | str]]] = {
    "text_encoder": {"input_ids": ["batch_size", "sequence_length"]},
    "unet": {"sample": ["batch_size", "num_channels", "height", "width"], "timestep": ["steps"],
             "encoder_hidden_states": ["batch_size", "sequence_length", "hidden_size"]},
    "vae_decoder": {"latent_sample": ["batch_size", "num_channels_latent", "height_latent", "width_latent"]},
}
CONFIGS: dict[str, dict[str, Any]] = {
    "text_encoder/config.json": {"hidden_size": 768, "max_position_embeddings": 77},
    "unet/config.json": {"in_channels": 4, "out_channels": 4, "cross_attention_dim": 768},
    "vae_decoder/config.json": {"latent_channels": 4, "block_out_channels": [128, 256, 512, 512]},
    "tokenizer/tokenizer_config.json": {"model_max_length": 77},
}


def _graph(path: Path, inputs: dict[str, list[int | str]]) -> None:
    """A graph with these inputs (float, int64 for input_ids) and one Identity per input."""
    def info(name: str, dims: list[int | str]) -> onnx.ValueInfoProto:
        kind = TensorProto.INT64 if name == "input_ids" else TensorProto.FLOAT
        return helper.make_tensor_value_info(name, kind, dims)

    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in inputs]
    graph = helper.make_graph(nodes, "g", [info(n, d) for n, d in inputs.items()],
                              [info(f"{n}_out", d) for n, d in inputs.items()])
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _model(root: Path, inputs: dict[str, dict[str, list[int | str]]] = OPTIMUM,
           configs: dict[str, dict[str, Any]] = CONFIGS) -> Path:
    for component, spec in inputs.items():
        _graph(root / component / "model.onnx", spec)
    for rel, data in configs.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(json.dumps(data))
    return root


def _plan(model: Path, sizes: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    profiles = trtplan.profiles_from(sizes or [(512, 512)], batch_max=4, batch_opt=2)
    return trtplan.plan(model, profiles, trtplan.BuildFlags())


def _options(plan: dict[str, Any], size: str, component: str) -> dict[str, str]:
    options: dict[str, str] = plan["sizes"][size]["components"][component]["provider_options"]
    return options


def test_symbolic_dims_are_resolved_from_the_configs_not_set_to_one(tmp_path: Path) -> None:
    plan = _plan(_model(tmp_path))
    unet = _options(plan, "512x512", "unet")
    # min: one image without CFG (guidance <= 1 runs the conditional rows only); opt/max: doubled for CFG. The
    # timestep has one value per row (step-level batching joins rows at different steps in one call).
    assert unet["trt_profile_min_shapes"] == "sample:1x4x64x64,timestep:1,encoder_hidden_states:1x77x768"
    assert unet["trt_profile_opt_shapes"] == "sample:4x4x64x64,timestep:4,encoder_hidden_states:4x77x768"
    assert unet["trt_profile_max_shapes"] == "sample:8x4x64x64,timestep:8,encoder_hidden_states:8x77x768"
    assert _options(plan, "512x512", "text_encoder")["trt_profile_max_shapes"] == "input_ids:8x77"
    assert _options(plan, "512x512", "vae_decoder")["trt_profile_min_shapes"] == "latent_sample:1x4x64x64"


def test_channels_come_from_each_components_config(tmp_path: Path) -> None:
    """An inpainting UNet takes 9 channels while the VAE decodes 4: each input reads its own config."""
    unet = {"in_channels": 9, "out_channels": 4, "cross_attention_dim": 1024}
    configs: dict[str, dict[str, Any]] = {**CONFIGS, "unet/config.json": unet,
                                          "text_encoder/config.json": {"hidden_size": 1024}}
    plan = _plan(_model(tmp_path, configs=configs))
    assert _options(plan, "512x512", "unet")["trt_profile_max_shapes"].startswith("sample:8x9x64x64,")
    assert "encoder_hidden_states:8x77x1024" in _options(plan, "512x512", "unet")["trt_profile_max_shapes"]
    assert _options(plan, "512x512", "vae_decoder")["trt_profile_max_shapes"] == "latent_sample:4x4x64x64"


@pytest.mark.parametrize(("rel", "key", "needle"), [
    ("unet/config.json", "cross_attention_dim", "unet input 'encoder_hidden_states' dim 2 (hidden_size)"),
    ("unet/config.json", "in_channels", "unet input 'sample' dim 1 (num_channels)"),
])
def test_a_dim_no_config_resolves_is_refused_naming_input_and_dim(tmp_path: Path, rel: str, key: str,
                                                                   needle: str) -> None:
    configs = {k: dict(v) for k, v in CONFIGS.items()}
    configs[rel].pop(key)
    if key == "cross_attention_dim":
        configs["text_encoder/config.json"].pop("hidden_size")
    with pytest.raises(ArtifactError, match="unresolved dim") as info:
        _plan(_model(tmp_path, configs=configs))
    assert needle in str(info.value)


def test_an_input_of_unknown_layout_with_a_symbolic_dim_is_refused(tmp_path: Path) -> None:
    """An extra UNet input no family has (a ControlNet-style scale): no role is known, so nothing may be guessed."""
    inputs: dict[str, dict[str, list[int | str]]] = {**OPTIMUM, "unet": {**OPTIMUM["unet"],
                                                                         "cond_scale": ["batch_size", 6]}}
    with pytest.raises(ArtifactError, match=r"unet input 'cond_scale' dim 0 \(batch_size\) cannot be resolved"):
        _plan(_model(tmp_path, inputs=inputs))


def test_sdxl_second_encoder_and_extra_unet_inputs_are_planned_from_the_configs(tmp_path: Path) -> None:
    """SDXL: text_encoder_2 gets its own engine; text_embeds (pooled projection) and time_ids (6 micro-conditioning
    values) resolve by name, the pooled width from text_encoder_2's projection_dim."""
    inputs: dict[str, dict[str, list[int | str]]] = {
        **OPTIMUM, "text_encoder_2": {"input_ids": ["batch_size", "sequence_length"]},
        "unet": {**OPTIMUM["unet"], "text_embeds": ["batch_size", "pooled"], "time_ids": ["batch_size", "n"]}}
    configs = {**CONFIGS, "text_encoder_2/config.json": {"hidden_size": 1280, "projection_dim": 1280},
               "unet/config.json": {"in_channels": 4, "out_channels": 4, "cross_attention_dim": 2048}}
    plan = _plan(_model(tmp_path, inputs=inputs, configs=configs))
    assert set(plan["sizes"]["512x512"]["components"]) == {"text_encoder", "text_encoder_2", "unet", "vae_decoder"}
    unet = _options(plan, "512x512", "unet")
    assert unet["trt_profile_max_shapes"] == ("sample:8x4x64x64,timestep:8,encoder_hidden_states:8x77x2048,"
                                              "text_embeds:8x1280,time_ids:8x6")
    assert _options(plan, "512x512", "text_encoder_2")["trt_profile_opt_shapes"] == "input_ids:4x77"


def test_a_fixed_dim_that_contradicts_the_plan_is_refused(tmp_path: Path) -> None:
    """A VAE exported with a fixed batch of 1 cannot take the opt batch 2."""
    inputs: dict[str, dict[str, list[int | str]]] = {**OPTIMUM, "vae_decoder": {"latent_sample": [1, 4, "h", "w"]}}
    with pytest.raises(ArtifactError, match=r"vae_decoder input 'latent_sample' dim 0 is 1 in the graph, but the "
                                            r"plan needs 2 \(batch\)"):
        _plan(_model(tmp_path, inputs=inputs))


def test_one_profile_per_engine_and_one_engine_per_size(tmp_path: Path) -> None:
    plan = _plan(_model(tmp_path), [(512, 512), (768, 512)])
    assert list(plan["sizes"]) == ["512x512", "768x512"]
    wide = _options(plan, "768x512", "unet")
    assert wide["trt_profile_max_shapes"].startswith("sample:8x4x64x96,")
    for size in ("512x512", "768x512"):
        for component in COMPONENTS:
            options = _options(plan, size, component)
            for key in ("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes"):
                names = [part.split(":")[0] for part in options[key].split(",")]
                assert len(names) == len(set(names)), f"{size} {component} {key} declares a second profile"
            assert options["trt_ep_context_file_path"] == f"trt/{size}/{component}_ctx.onnx"
    with pytest.raises(ArtifactError, match="sizes repeat"):
        _plan(_model(tmp_path), [(512, 512), (512, 512)])


def test_every_path_in_the_plan_is_relative(tmp_path: Path) -> None:
    """ORT logs an ERROR for an absolute trt_engine_cache_path when dumping EP-context models and joins a relative one
    to the context model's folder (tensorrt_execution_provider.cc, onnx_ctx_model_helper.cc)."""
    model = _model(tmp_path / "built-here")
    plan = _plan(model)
    text = json.dumps(plan)
    assert str(tmp_path) not in text
    for component in COMPONENTS:
        options = _options(plan, "512x512", component)
        assert options["trt_engine_cache_path"] == "engines"
        for key, value in options.items():
            if key.endswith("_path"):
                assert not Path(value).is_absolute() and ".." not in Path(value).parts, key
        resolved = session_options(model, options)
        assert resolved["trt_ep_context_file_path"] == str(model / "trt" / "512x512" / f"{component}_ctx.onnx")
        assert resolved["trt_timing_cache_path"] == str(model / "trt" / "timing")
        assert resolved["trt_engine_cache_path"] == "engines"  # stays relative to the context model


def test_dynamic_quantization_ops_are_named(tmp_path: Path) -> None:
    model = _model(tmp_path)
    graph = onnx.load(str(model / "unet" / "model.onnx"))
    graph.graph.node.extend([helper.make_node("DynamicQuantizeLinear", ["sample"], ["q", "s", "z"]),
                             helper.make_node("MatMulInteger", ["q", "q"], ["m"])])
    onnx.save(graph, str(model / "unet" / "model.onnx"))
    assert trtplan.trt_unimportable_ops(model) == {"unet": {"DynamicQuantizeLinear": 1, "MatMulInteger": 1}}
    with pytest.raises(ArtifactError, match=r"unet: DynamicQuantizeLinear x1, MatMulInteger x1"):
        trtplan.refuse_unimportable(model)


def test_the_vae_encoder_gets_an_engine_at_pixel_size_when_the_folder_has_one(tmp_path: Path) -> None:
    """Edits encode the image on the device: a folder with vae_encoder/ plans its engine per size, its input at the
    image's pixel size (not the latent size), one image per row (no CFG doubling)."""
    inputs = {**OPTIMUM, "vae_encoder": {"sample": ["batch_size", "num_channels", "height", "width"]}}
    plan = _plan(_model(tmp_path, inputs=inputs), sizes=[(512, 768)])
    assert "vae_encoder" in plan["sizes"]["512x768"]["components"]
    encoder = _options(plan, "512x768", "vae_encoder")
    assert encoder["trt_profile_min_shapes"] == "sample:1x3x768x512"
    assert encoder["trt_profile_max_shapes"] == "sample:4x3x768x512"
    assert "vae_encoder" not in _plan(_model(tmp_path / "no-encoder"))["sizes"]["512x512"]["components"]
