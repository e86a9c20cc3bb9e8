"""Every served family against diffusers' torch pipelines on the same weights and initial latents (SD 2.x with
v-prediction, Turbo with guidance 0 and trailing spacing, SDXL with both encoders), the cond-only UNet batch of
guidance <= 1, and the refusal of folders of no served family."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from engines.build.tiny import build_tiny
from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.pipelines import unet_family as families
from engines.pipelines.contract import image_rng
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

SCHEDULERS = {"euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
              "ddim": "DDIMScheduler", "dpmpp_2m": "DPMSolverMultistepScheduler"}
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [11, 12]
CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(ONNX folder, diffusers folder) per family, built once for the module."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in ("sd2", "turbo", "sdxl"):
        out[name] = (build_tiny(root / name / "onnx", diffusers_out=root / name / "diffusers", family=name),
                     root / name / "diffusers")
    return out


@pytest.fixture(scope="module")
def pipes(builds: dict[str, tuple[Path, Path]]) -> dict[str, StableDiffusionOnnx]:
    return {name: StableDiffusionOnnx(onnx_dir, Runtime(CPU)) for name, (onnx_dir, _) in builds.items()}


def _theirs(family: str, builds: dict[str, tuple[Path, Path]], scheduler: str, latents: np.ndarray,
            **call: Any) -> np.ndarray:
    import diffusers

    onnx_dir, diffusers_dir = builds[family]
    cls = diffusers.StableDiffusionXLPipeline if family == "sdxl" else diffusers.StableDiffusionPipeline
    extra = {} if family == "sdxl" else {"safety_checker": None}
    pipe = cls.from_pretrained(diffusers_dir, **extra)
    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(config)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        images = pipe(PROMPTS, latents=torch.from_numpy(latents), output_type="np", **call).images
    return np.asarray((images * 255).round().astype(np.uint8))


def _compare(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} pixels differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"
    # The comparison has teeth: images of different seeds differ far more than the tolerance.
    assert (np.abs(mine[0].astype(np.int16) - mine[1].astype(np.int16)) > 1).mean() > 0.5


def _run(pipe: StableDiffusionOnnx, family: str, builds: dict[str, tuple[Path, Path]], scheduler: str,
         holder: list[list[np.random.Generator]], width: int, height: int, steps: int, guidance: float,
         negative: str = "") -> None:
    rngs = [image_rng(seed) for seed in SEEDS]
    latents = np.stack([r.standard_normal((4, height // 8, width // 8), dtype=np.float32) for r in rngs])
    holder.append(rngs)
    theirs = _theirs(family, builds, scheduler, latents, height=height, width=width, num_inference_steps=steps,
                     guidance_scale=guidance, negative_prompt=[negative] * 2 if negative else None)
    batch = Batch(tuple(ImageSpec(p, negative, s, guidance) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  width, height, steps, scheduler)
    _compare(pipe(batch, latents=latents).images, theirs, f"{family}/{scheduler}")


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_sd2_v_prediction_matches_diffusers(scheduler: str, pipes: dict[str, StableDiffusionOnnx],
                                            builds: dict[str, tuple[Path, Path]],
                                            shared_step_noise: list[list[np.random.Generator]]) -> None:
    pipe = pipes["sd2"]
    assert pipe.family.prediction_type == "v_prediction" and pipe.tokenizer.pad_id == 0  # "!" pads SD 2.x
    _run(pipe, "sd2", builds, scheduler, shared_step_noise, 96, 96, 12, 7.5)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("steps", [1, 4])
def test_turbo_guidance_zero_matches_diffusers(scheduler: str, steps: int, pipes: dict[str, StableDiffusionOnnx],
                                               builds: dict[str, tuple[Path, Path]],
                                               shared_step_noise: list[list[np.random.Generator]]) -> None:
    assert pipes["turbo"].schedule.timestep_spacing == "trailing"
    _run(pipes["turbo"], "turbo", builds, scheduler, shared_step_noise, 64, 64, steps, 0.0)


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_sdxl_matches_diffusers(scheduler: str, pipes: dict[str, StableDiffusionOnnx],
                                builds: dict[str, tuple[Path, Path]],
                                shared_step_noise: list[list[np.random.Generator]]) -> None:
    """Non-square, an empty negative prompt (zeros under force_zeros_for_empty_prompt, as diffusers with None)."""
    _run(pipes["sdxl"], "sdxl", builds, scheduler, shared_step_noise, 128, 96, 10, 5.0)


def test_sdxl_negative_prompt_matches_diffusers(pipes: dict[str, StableDiffusionOnnx],
                                                builds: dict[str, tuple[Path, Path]],
                                                shared_step_noise: list[list[np.random.Generator]]) -> None:
    _run(pipes["sdxl"], "sdxl", builds, "euler", shared_step_noise, 128, 128, 8, 6.0, negative="blurry, lowres")


def test_sdxl_force_zeros_for_empty_prompt_has_an_effect(pipes: dict[str, StableDiffusionOnnx],
                                                          builds: dict[str, tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    """The same weights with force_zeros_for_empty_prompt false condition on the encoded "" instead of zeros."""
    folder = _copy(builds["sdxl"][0], tmp_path / "no_zeros")
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "force_zeros_for_empty_prompt": False}))
    encoded = StableDiffusionOnnx(folder, Runtime(CPU))
    batch = Batch((ImageSpec(PROMPTS[0], "", 3, 5.0),), 128, 128, 4, "euler")
    zeroed, plain = pipes["sdxl"](batch).images, encoded(batch).images
    assert (np.abs(zeroed.astype(np.int16) - plain.astype(np.int16)) > 1).mean() > 0.1


def _unet_rows(pipe: StableDiffusionOnnx, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    rows: list[int] = []
    original = pipe.unet.run

    def spy(feeds: dict[str, Any], outputs: dict[str, Any], adapters: Any = None) -> None:
        sample = feeds[pipe.io.sample]
        rows.append(int(sample.shape()[0] if hasattr(sample, "shape") and callable(sample.shape)
                        else sample.shape[0]))
        original(feeds, outputs, adapters)

    monkeypatch.setattr(pipe.unet, "run", spy)
    return rows


@pytest.mark.parametrize("family", ["turbo", "sdxl"])
def test_guidance_at_most_one_runs_the_unet_on_n_rows(family: str, pipes: dict[str, StableDiffusionOnnx],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = pipes[family]
    size = pipe.default_size
    rows = _unet_rows(pipe, monkeypatch)
    specs = tuple(ImageSpec(p, "", s, 0.0) for p, s in zip(PROMPTS, SEEDS, strict=True))
    pipe(Batch(specs, size, size, 3, "euler"))
    assert rows == [2, 2, 2]  # n, not 2n
    rows.clear()
    mixed = (specs[0], ImageSpec(PROMPTS[1], "", SEEDS[1], 7.0))  # one image with CFG: the batch runs 2n rows
    pipe(Batch(mixed, size, size, 2, "euler"))
    assert rows == [4, 4]


def test_guidance_below_one_is_the_conditional_prediction(pipes: dict[str, StableDiffusionOnnx]) -> None:
    """As diffusers: guidance <= 1 means no CFG at all, so 0, 0.5 and 1 give the same image."""
    pipe = pipes["turbo"]
    images = [pipe(Batch((ImageSpec(PROMPTS[0], "ugly", 5, w),), 64, 64, 2, "euler")).images for w in (0, 0.5, 1)]
    assert np.array_equal(images[0], images[1]) and np.array_equal(images[0], images[2])


def test_families_detected(builds: dict[str, tuple[Path, Path]], tiny_model: Path) -> None:
    sd1 = families.detect(tiny_model)
    assert (sd1.name, sd1.native_size, sd1.text_encoders, sd1.prediction_type) == ("sd1", 64, 1, "epsilon")
    sd2 = families.detect(builds["sd2"][0])
    assert (sd2.name, sd2.base, sd2.native_size, sd2.prediction_type) == ("sd2", "sd2", 96, "v_prediction")
    turbo = families.detect(builds["turbo"][0])
    assert (turbo.name, turbo.base, turbo.timestep_spacing, turbo.cfg_default) == ("turbo", "sd2", "trailing", False)
    assert (turbo.default_steps, turbo.default_guidance) == (1, 0.0)
    xl = families.detect(builds["sdxl"][0])
    assert (xl.name, xl.text_encoders, xl.vae_scaling_factor, xl.native_size) == ("sdxl", 2, 0.13025, 128)
    assert xl.force_zeros_for_empty_prompt and xl.vae_force_upcast and xl.cfg_default


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "manifest.json").unlink()
    return dst


def add_unet_input(folder: Path, name: str = "control_scale") -> None:
    """A UNet with an input no family has (as a ControlNet-fused or custom export would add)."""
    model = onnx.load(folder / "unet" / "model.onnx")
    model.graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]))
    onnx.save(model, folder / "unet" / "model.onnx")


def test_unet_with_extra_inputs_is_refused_naming_them(tiny_model: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_model, tmp_path / "odd")
    add_unet_input(folder)
    with pytest.raises(ModelLoadError, match=r"inputs \['control_scale'\] that a sd1 UNet does not take"):
        StableDiffusionOnnx(folder, Runtime(CPU))


def test_sdxl_unet_in_an_sd_folder_is_refused(builds: dict[str, tuple[Path, Path]], tiny_model: Path,
                                             tmp_path: Path) -> None:
    folder = _copy(tiny_model, tmp_path / "mixed")
    shutil.copy(builds["sdxl"][0] / "unet" / "model.onnx", folder / "unet" / "model.onnx")
    with pytest.raises(ModelLoadError, match=r"\['text_embeds', 'time_ids'\]"):
        StableDiffusionOnnx(folder, Runtime(CPU))


@pytest.mark.parametrize(("edit", "named"), [
    (("model_index.json", "_class_name", "StableDiffusion3Pipeline"), "StableDiffusion3Pipeline"),
    (("unet/config.json", "in_channels", 5), "in_channels 5"),
    (("unet/config.json", "time_cond_proj_dim", 256), "time_cond_proj_dim 256"),
    (("unet/config.json", "class_embed_type", "timestep"), "class_embed_type 'timestep'"),
])
def test_unknown_families_are_refused_by_their_configs(edit: tuple[str, str, object], named: str,
                                                       tiny_model: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_model, tmp_path / "other")
    path = folder / edit[0]
    path.write_text(json.dumps({**json.loads(path.read_text()), edit[1]: edit[2]}))
    with pytest.raises(ModelLoadError, match=named):
        families.detect(folder)


def test_sdxl_refiner_layout_is_refused(builds: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    folder = _copy(builds["sdxl"][0], tmp_path / "refiner")
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(ModelLoadError, match="without both text_encoder and text_encoder_2"):
        families.detect(folder)


def test_sdxl_fp16_vae_with_force_upcast_is_refused(builds: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """SDXL's VAE overflows in fp16: an fp16 decoder is refused at load unless its config says it was fixed."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    folder = _copy(builds["sdxl"][0], tmp_path / "fp16vae")
    model = convert_float_to_float16(onnx.load(folder / "vae_decoder" / "model.onnx"), keep_io_types=False)
    onnx.save(model, folder / "vae_decoder" / "model.onnx")
    with pytest.raises(ModelLoadError, match="force_upcast"):
        StableDiffusionOnnx(folder, Runtime(CPU))
    config = folder / "vae_decoder" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "force_upcast": False}))
    fixed = StableDiffusionOnnx(folder, Runtime(CPU))  # an fp16-fixed VAE loads
    assert fixed.vae_decoder.input_dtype("latent_sample") is np.float16


def test_tiny_builds_are_deterministic(builds: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    again = build_tiny(tmp_path / "sdxl", family="sdxl")
    files = json.loads((again / "manifest.json").read_text())["files"]
    assert files == json.loads((builds["sdxl"][0] / "manifest.json").read_text())["files"]
    assert {"text_encoder_2/model.onnx", "tokenizer_2/tokenizer.json"} <= set(files)


@pytest.mark.parametrize("family", ["sd2", "sdxl"])
def test_engines_export_of_a_diffusers_folder_serves_the_same_images(family: str,
                                                                      builds: dict[str, tuple[Path, Path]],
                                                                      pipes: dict[str, StableDiffusionOnnx],
                                                                      tmp_path: Path) -> None:
    """`sdserve engines export` on the diffusers folder of each family gives the model the tiny build exported."""
    from engines.build.export import export_folder

    exported = StableDiffusionOnnx(export_folder(builds[family][1], tmp_path / "exported"), Runtime(CPU))
    # save_pretrained may write a defaulted timestep_spacing out as a choice: the same schedule either way.
    assert replace(exported.family, timestep_spacing="") == replace(pipes[family].family, timestep_spacing="")
    size = pipes[family].default_size
    batch = Batch((ImageSpec(PROMPTS[0], "", 9, 6.0),), size, size, 3, "ddim")  # spacing "leading" either way
    diff = np.abs(exported(batch).images.astype(np.int16) - pipes[family](batch).images.astype(np.int16))
    assert diff.max() <= 1
