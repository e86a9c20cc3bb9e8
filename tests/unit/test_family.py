"""Family detection from a folder's JSON files, UNet input roles, SDXL's output and time-id conventions, per-family
request defaults, and the cond-only step and text-join graphs (run on ORT's CPU provider)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from engines.config import Shape, load_canaries
from engines.errors import ModelLoadError
from engines.numerics.schedulers import Lin
from engines.numerics.step_graph import build_step_graph, build_text_join_graph, step_coefficients
from engines.pipelines import unet_family as families
from server.settings import Settings

SD_UNET = {"sample_size": 64, "in_channels": 4, "cross_attention_dim": 768, "block_out_channels": [320, 640]}
VAE = {"block_out_channels": [128, 256, 512, 512], "scaling_factor": 0.18215}


def _folder(root: Path, index: dict[str, Any], unet: dict[str, Any], scheduler: dict[str, Any],
            vae: dict[str, Any] = VAE, parts: tuple[str, ...] = ("text_encoder",)) -> Path:
    for name, data in (("model_index.json", index), ("unet/config.json", unet),
                       ("scheduler/scheduler_config.json", scheduler), ("vae_decoder/config.json", vae)):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(data))
    for part in parts:
        (root / part).mkdir(exist_ok=True)
    return root


def test_real_configs_give_their_families(tmp_path: Path) -> None:
    """The published configs' distinguishing keys: SD 1.5, SD 2.1 (768-v), SDXL base, SDXL-Turbo, SD-Turbo."""
    sd15 = families.detect(_folder(tmp_path / "a", {"_class_name": "StableDiffusionPipeline"}, SD_UNET,
                                   {"_class_name": "PNDMScheduler"}))
    assert (sd15.name, sd15.native_size, sd15.cfg_default) == ("sd1", 512, True)
    sd21 = families.detect(_folder(tmp_path / "b", {"_class_name": "StableDiffusionPipeline"},
                                   {**SD_UNET, "sample_size": 96, "cross_attention_dim": 1024,
                                    "use_linear_projection": True},
                                   {"prediction_type": "v_prediction"}))
    assert (sd21.name, sd21.native_size, sd21.prediction_type) == ("sd2", 768, "v_prediction")
    xl_unet = {**SD_UNET, "sample_size": 128, "cross_attention_dim": 2048, "addition_embed_type": "text_time"}
    xl_vae = {**VAE, "scaling_factor": 0.13025, "force_upcast": True}
    xl = families.detect(_folder(tmp_path / "c", {"_class_name": "StableDiffusionXLPipeline"}, xl_unet,
                                 {"timestep_spacing": "leading"}, xl_vae, ("text_encoder", "text_encoder_2")))
    assert (xl.name, xl.native_size, xl.text_encoders, xl.vae_scaling_factor) == ("sdxl", 1024, 2, 0.13025)
    assert xl.force_zeros_for_empty_prompt and xl.vae_force_upcast
    xl_turbo = families.detect(_folder(tmp_path / "d", {"_class_name": "StableDiffusionXLPipeline",
                                                        "force_zeros_for_empty_prompt": False},
                                       {**xl_unet, "sample_size": 64}, {"timestep_spacing": "trailing"}, xl_vae,
                                       ("text_encoder", "text_encoder_2")))
    assert (xl_turbo.name, xl_turbo.base, xl_turbo.native_size) == ("turbo", "sdxl", 512)
    assert not xl_turbo.cfg_default and not xl_turbo.force_zeros_for_empty_prompt
    sd_turbo = families.detect(_folder(tmp_path / "e", {"_class_name": "StableDiffusionPipeline"},
                                       {**SD_UNET, "use_linear_projection": True}, {"timestep_spacing": "trailing"}))
    assert (sd_turbo.name, sd_turbo.base, sd_turbo.default_steps, sd_turbo.default_guidance) == \
        ("turbo", "sd2", 1, 0.0)
    assert "family turbo (base sd2)" in sd_turbo.describe()


def test_defaulted_spacing_is_not_trailing(tmp_path: Path) -> None:
    """diffusers' _use_default_values marks keys the saving class defaulted: they are unset, as the schedulers read."""
    scheduler = {"timestep_spacing": "trailing", "_use_default_values": ["timestep_spacing"]}
    folder = _folder(tmp_path, {}, SD_UNET, scheduler)
    assert families.detect(folder).name == "sd1"


def test_unknown_pipeline_class_is_named(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"_class_name": "FluxPipeline"}, SD_UNET, {})
    with pytest.raises(ModelLoadError, match="model_index.json names 'FluxPipeline'"):
        families.detect(folder)


SHAPES: dict[str, list[int | str]] = {"sample": ["b", 4, "h", "w"], "timestep": [1],
                                      "encoder_hidden_states": ["b", 77, 2048]}
XL = families.Family("sdxl", "sdxl", 1024, "epsilon", "leading", 2, 0.13025, True, True, 30, 5.0)
SD1 = families.Family("sd1", "sd1", 512, "epsilon", "", 1, 0.18215, False, False, 20, 7.5)


def test_unet_roles_by_rank_and_sdxl_pair_by_width() -> None:
    io = families.unet_io(XL, {**SHAPES, "cond_a": ["b", 1280], "cond_b": ["b", 6]}, ["out"])
    assert (io.sample, io.timestep, io.hidden, io.text_embeds, io.time_ids) == \
        ("sample", "timestep", "encoder_hidden_states", "cond_a", "cond_b")
    assert families.unet_io(SD1, SHAPES, ["out"]).text_embeds is None


def test_unet_inputs_no_role_takes_are_named() -> None:
    with pytest.raises(ModelLoadError, match=r"inputs \['text_embeds', 'time_ids'\] that a sd1 UNet"):
        families.unet_io(SD1, {**SHAPES, "text_embeds": ["b", 1280], "time_ids": ["b", 6]}, ["out"])
    with pytest.raises(ModelLoadError, match=r"no input for \['text_embeds', 'time_ids'\]"):
        families.unet_io(XL, SHAPES, ["out"])


def test_penultimate_output_of_ours_and_optimums_exports() -> None:
    assert families.penultimate_output(["last_hidden_state", "hidden_states.11"], {"num_hidden_layers": 12}) == \
        "hidden_states.11"
    every = ["text_embeds", "last_hidden_state", *(f"hidden_states.{i}" for i in range(33))]
    assert families.penultimate_output(every, {"num_hidden_layers": 32}) == "hidden_states.31"
    assert families.penultimate_output(every, {}) == "hidden_states.31"
    with pytest.raises(ModelLoadError, match="penultimate"):
        families.penultimate_output(["last_hidden_state"], {"num_hidden_layers": 12})


def test_time_ids_default_to_the_target_size() -> None:
    assert families.time_ids(768, 1344) == [768.0, 1344.0, 0.0, 0.0, 768.0, 1344.0]
    assert families.time_ids(1024, 1024, (512, 512), (32, 16)) == [512.0, 512.0, 32.0, 16.0, 1024.0, 1024.0]


def test_family_defaults_from_profile_builtin_or_general() -> None:
    settings = Settings.model_validate({"family_defaults": {"sdxl": {"steps": 30, "guidance_scale": 5.0}}})
    assert (settings.defaults_for("sdxl").steps, settings.defaults_for("sdxl").guidance_scale) == (30, 5.0)
    assert (settings.defaults_for("turbo").steps, settings.defaults_for("turbo").guidance_scale) == (1, 0.0)
    assert settings.defaults_for("sd1") == settings.defaults
    flux, sd35 = settings.defaults_for("flux"), settings.defaults_for("sd35")  # the DiT families' model cards
    assert (flux.steps, flux.guidance_scale, sd35.steps, sd35.guidance_scale) == (28, 3.5, 28, 4.5)
    with pytest.raises(ValueError, match="family_defaults.pixart: unknown family"):
        Settings.model_validate({"family_defaults": {"pixart": {}}})


def _run(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return [np.asarray(o) for o in session.run(None, feeds)]


def test_cond_only_step_takes_n_rows_and_equals_cfg_with_twin_halves() -> None:
    rng = np.random.default_rng(0)
    n, shape = 2, (2, 4, 3, 3)
    sample, prev, text = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    coeffs = step_coefficients(Lin(0.9, -0.3, 0.1), Lin(1.1, -0.5), np.ones(n))
    base = {"sample": sample, "prev": prev, "noise": np.zeros(shape, np.float32), "coeffs": coeffs,
            "in_scale": np.array([0.5], np.float32)}
    cond = _run(build_step_graph(np.float32, np.float32, cfg=False), {**base, "model_out": text})
    full = _run(build_step_graph(np.float32, np.float32), {**base, "model_out": np.concatenate([text, text])})
    assert cond[2].shape == shape and full[2].shape == (2 * n, *shape[1:])
    np.testing.assert_allclose(cond[0], full[0], rtol=1e-6)
    np.testing.assert_allclose(cond[0], 0.9 * sample - 0.3 * text + 0.1 * prev, rtol=1e-5, atol=1e-6)


def test_text_join_concatenates_and_zeros_rows() -> None:
    rng = np.random.default_rng(1)
    h1, h2 = rng.standard_normal((3, 5, 2), dtype=np.float32), rng.standard_normal((3, 5, 4), dtype=np.float32)
    pooled = rng.standard_normal((3, 4), dtype=np.float32)
    keep = np.array([[0.0], [1.0], [1.0]], np.float32)
    hidden, embeds = _run(build_text_join_graph(np.float32, np.float32, np.float32, np.float16, np.float32),
                          {"h1": h1, "h2": h2, "pooled": pooled, "keep": keep})
    assert hidden.dtype == np.float16 and hidden.shape == (3, 5, 6)
    assert not hidden[0].any() and not embeds[0].any()
    np.testing.assert_array_equal(hidden[1:], np.concatenate([h1, h2], axis=2)[1:].astype(np.float16))
    np.testing.assert_array_equal(embeds[1:], pooled[1:])


def test_canary_set_per_family_from_the_shipped_file() -> None:
    from server.settings import CONFIG_DIR

    suite = load_canaries(CONFIG_DIR / "canaries.toml")
    from engines.pipelines.flow_family import DIT_FAMILIES

    assert set(suite.family) == set(families.FAMILY_NAMES) | set(DIT_FAMILIES)  # every family its own canary set
    turbo = suite.for_family("turbo")
    assert (turbo.steps, turbo.guidance_scale, turbo.canary) == (2, 0.0, suite.canary)
    assert turbo.batch(Shape(64, 64, 1)).images[0].guidance_scale == 0.0
    assert suite.for_family("sd2").scheduler == "ddim" and suite.for_family("sdxl").guidance_scale == 5.0
    assert suite.for_family("unknown") is suite
