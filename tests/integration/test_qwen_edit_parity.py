"""Our torch-free ORT Qwen-Image-Edit-Plus pipeline vs diffusers' QwenImageEditPlusPipeline on the same tiny weights
(engines/build/qwen_edit.py; the reference pipeline built in memory on them) and the same initial noise: one and two
input images of other sizes, with a negative prompt (true CFG with norm rescaling) and without one (no CFG), within
1/255; the output size rule; the vision tower's host side against transformers' own functions. Sessions run on
onnxruntime's CPU provider (onnxruntime/python/onnxruntime_inference_collection.py InferenceSession)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError, ModelLoadError
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import FlowPipeline, load_pipeline, pack_latents
from engines.pipelines.flow_family import detect_dit
from engines.pipelines.qwen_edit import VAE_AREA, VisionInputs, calculate_dimensions, edit_size
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPT, NEGATIVE, SEED, STEPS = "put a red hat on it", "blurry", 11, 2
SMALL_AREA = 256 * 256
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""


@pytest.fixture(scope="module")
def edit(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(ONNX folder, diffusers' QwenImageEditPlusPipeline on the same weights)."""
    from engines.build.qwen_edit import build_tiny_qwen_edit

    out = tmp_path_factory.mktemp("qwen_edit") / "onnx"
    pipe = build_tiny_qwen_edit(out, reference=True)
    pipe.set_progress_bar_config(disable=True)
    return out, pipe


@functools.lru_cache(maxsize=1)
def _ours(folder: Path) -> FlowPipeline:
    return load_pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


def _input_image(width: int, height: int, phase: float = 0.0) -> np.ndarray:
    """A smooth pattern with edges (the resizes, the vision tower and the encoder see structure, not noise)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([127 + 120 * np.sin(x / 7.0 + phase), 127 + 120 * np.cos(y / 5.0), (x + y) % 256], axis=-1)
    return np.ascontiguousarray(image.clip(0, 255).astype(np.uint8))


@pytest.mark.parametrize(("sizes", "negative", "area"), [(((72, 48),), True, VAE_AREA),
                                                         (((72, 48),), False, SMALL_AREA),
                                                         (((40, 56), (64, 48)), True, SMALL_AREA)])
def test_instruction_edit_matches_diffusers(sizes: tuple[tuple[int, int], ...], negative: bool, area: int,
                                            edit: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``area``: the reference latents' pixel count, diffusers' own (1024²) once, a smaller one in both pipelines
    (the module constant each reads at call time) to keep the other cases fast."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    from engines.pipelines import qwen_edit

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", area)
    monkeypatch.setattr(qwen_edit, "VAE_AREA", area)
    folder, theirs_pipe = edit
    width, height = 64, 48
    refs = tuple(_input_image(w, h, i) for i, (w, h) in enumerate(sizes))
    guidance = 4.0 if negative else 1.0
    spec = ImageSpec(PROMPT, seed=SEED, guidance_scale=guidance, negative_prompt=NEGATIVE if negative else "",
                     edit=EditImage(np.asarray(Image.fromarray(refs[0]).resize((width, height))), references=refs))
    batch = Batch((spec,), width=width, height=height, steps=STEPS)
    assert batch.mode == "instruct"
    ours = _ours(folder)(batch)
    noise = image_rng(SEED).standard_normal((1, 16, height // 8, width // 8), dtype=np.float32)
    with torch.no_grad():
        theirs = theirs_pipe(image=[Image.fromarray(r) for r in refs], prompt=PROMPT,
                             negative_prompt=NEGATIVE if negative else None, true_cfg_scale=4.0, height=height,
                             width=width, num_inference_steps=STEPS, latents=torch.from_numpy(pack_latents(noise)),
                             output_type="np").images
    theirs = np.asarray((theirs * 255).round().astype(np.uint8))
    assert ours.images.shape == theirs.shape == (1, height, width, 3)
    diff = np.abs(ours.images.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nqwen-image-edit parity, inputs {sizes}, negative {negative}: {match:.6f} within 1/255, "
          f"max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs.std() > 10


def test_output_size_rule_matches_diffusers() -> None:
    """diffusers' rule: calculate_dimensions(1024², last image's aspect), floored to 16; the served function."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions as theirs

    for w, h in ((72, 48), (40, 88), (1000, 1000), (333, 777)):
        assert calculate_dimensions(1024 * 1024, w / h) == theirs(1024 * 1024, w / h)
        tw, th = theirs(1024 * 1024, w / h)
        assert edit_size(((10, 10), (w, h))) == (tw // 16 * 16, th // 16 * 16)


def test_vision_inputs_match_the_qwen2_vl_processor_and_window_index() -> None:
    """The patches equal transformers' Qwen2-VL image processor's (PIL backend); the window order its
    get_vision_window_index's."""
    from transformers import Qwen2VLImageProcessorPil
    from transformers.vision_utils import get_vision_window_index

    processor = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "hidden_size": 16, "num_heads": 2}
    config = {"image_mean": list(processor.image_mean), "image_std": list(processor.image_std),
              "min_pixels": 3136, "max_pixels": 12845056}
    image = Image.fromarray(_input_image(416, 320))
    ours = VisionInputs(image, config, vision)
    theirs = processor(images=[image], return_tensors="np")
    np.testing.assert_allclose(ours.pixels, theirs["pixel_values"], atol=1e-5)
    index, _ = get_vision_window_index(torch.as_tensor(theirs["image_grid_thw"]), 2, 112, 14)
    np.testing.assert_array_equal(ours.window_index, index.numpy())


def test_family_model_info_and_refusals(edit: tuple[Path, Any], tmp_path: Path) -> None:
    """The exported folder is qwen-image-edit and says it takes 1 to 3 images by diffusers' size rule; four images
    and references of other sizes in one batch are refused naming image; the first Edit release is refused by
    name (2511, ``zero_cond_t``, is served: test_qwen_edit_2511_parity.py)."""
    folder, _ = edit
    assert detect_dit(folder).name == "qwen-image-edit"
    pipe = _ours(folder)
    info = pipe.model_info("edit")
    assert "instruct" in info.modes and info.instruct_images == 3
    assert info.instruct_size is not None and info.instruct_size(((72, 48),)) == edit_size(((72, 48),))
    ref = _input_image(32, 32)

    def batch(*refs: tuple[np.ndarray, ...]) -> Batch:
        return Batch(tuple(ImageSpec(PROMPT, seed=1, edit=EditImage(ref, references=r)) for r in refs), width=32,
                     height=32, steps=1)

    with pytest.raises(InvalidRequestError, match="1 to 3") as four:
        pipe(batch((ref,) * 4))
    with pytest.raises(InvalidRequestError, match="same sizes") as mixed:
        pipe(batch((ref,), (_input_image(64, 32),)))
    assert four.value.param == mixed.value.param == "image"
    for name, config, said in (("edit-1", {}, "first release"),):
        other = tmp_path / name
        (other / "transformer").mkdir(parents=True)
        (other / "scheduler").mkdir()
        index = json.loads((folder / "model_index.json").read_text())
        index["_class_name"] = "QwenImageEditPlusPipeline" if config else "QwenImageEditPipeline"
        (other / "model_index.json").write_text(json.dumps(index))
        shutil.copyfile(folder / "scheduler" / "scheduler_config.json", other / "scheduler" / "scheduler_config.json")
        base = json.loads((folder / "transformer" / "config.json").read_text())
        (other / "transformer" / "config.json").write_text(json.dumps({**base, **config}))
        with pytest.raises(ModelLoadError, match=said):
            detect_dit(other)


def test_edit_rows_sharing_transformer_calls_get_their_solo_images(edit: tuple[Path, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two edit requests (other input images of one size, other prompts, one with CFG) on the engine, the second
    joining the first's running set after a step (their rows in one transformer call, engines/pipelines/flow.py),
    give the images each gives alone, within 1/255."""
    from engines.engine import OrtEngine
    from engines.pipelines import qwen_edit

    monkeypatch.setattr(qwen_edit, "VAE_AREA", SMALL_AREA)
    engine = OrtEngine(edit[0], RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    engine.load()

    def batch(prompt: str, seed: int, guidance: float, phase: float) -> Batch:
        ref = _input_image(72, 48, phase)
        return Batch((ImageSpec(prompt, seed=seed, guidance_scale=guidance, negative_prompt=NEGATIVE,
                                edit=EditImage(ref[:32, :32], references=(ref,))),), width=32, height=32, steps=3)

    first, later = batch(PROMPT, 3, 4.0, 0.0), batch("make it blue", 4, 1.0, 1.5)
    alone = [np.asarray(engine.generate(b).images[0].image, np.int16) for b in (first, later)]
    running = [(first, engine.begin(first))]
    results: dict[int, Any] = {}
    for tick in range(20):
        if tick == 1:
            running.append((later, engine.begin(later)))
        assert len({engine.step_key(b) for b, _ in running}) == 1
        engine.tick([r for _, r in running])
        for b, run in list(running):
            if run.finished:
                results[id(b)] = engine.finish(run)
                running.remove((b, run))
        if not running:
            break
    for solo, b in zip(alone, (first, later), strict=True):
        assert int(np.abs(solo - np.asarray(results[id(b)].images[0].image, np.int16)).max()) <= 1
    assert int(np.abs(alone[0] - alone[1]).max()) > 8
