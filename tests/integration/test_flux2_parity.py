"""Our torch-free ORT FLUX.2 [klein] pipeline (engines/pipelines/flux2.py) vs diffusers' ``Flux2KleinPipeline`` on
the same tiny weights and initial noise: the step-distilled checkpoint (no CFG, whatever the scale) and the base one
(CFG with diffusers' empty negative prompt) at two sizes (square and not: the empirical shift and the rotary
positions change with them); the schedule's timesteps and sigmas equal to the scheduler's; the served tokenizer
against transformers' with the chat template. ORT runs the exported graphs with its CPU provider
(onnxruntime/core/providers/cpu: fp32 kernels)."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.pipelines.contract import image_rng
from engines.pipelines.flow_family import detect_dit
from engines.pipelines.flux2 import TEMPLATE, Flux2Pipeline
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
SEEDS = [11, 12]
STEPS = 3
LENGTH = 48
"""max_sequence_length for both pipelines (512 in production: the same code path, a shorter test)."""
CASES = [("flux2-klein", 64, 64, 1.0), ("flux2-klein", 48, 32, 4.0), ("flux2-klein-base", 64, 64, 4.0),
         ("flux2-klein-base", 32, 48, 3.0)]
"""(family, width, height, guidance_scale): the distilled model (4.0 ignored, as diffusers ignores it) and the base
model with CFG, each at two sizes."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


@functools.lru_cache(maxsize=2)
def _ours(folder: Path) -> Flux2Pipeline:
    return Flux2Pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=2)
def _torch_pipeline(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.Flux2KleinPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(width: int, height: int) -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((128, height // 16, width // 16), dtype=np.float32)
                     for s in SEEDS])


@pytest.mark.parametrize(("family", "width", "height", "cfg"), CASES,
                         ids=[f"{f}-{w}x{h}-cfg{c}" for f, w, h, c in CASES])
def test_images_match_diffusers(family: str, width: int, height: int, cfg: float, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build(family)
    assert detect_dit(onnx_dir).name == detect_dit(diffusers_dir).name == family
    batch = Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=cfg) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  width=width, height=height, steps=STEPS)
    ours = _ours(onnx_dir)
    assert ours.uses_cfg(np.array([cfg], np.float32)) == (family == "flux2-klein-base" and cfg > 1)
    out = ours(batch, max_sequence_length=LENGTH)
    pipe = _torch_pipeline(diffusers_dir)
    with torch.no_grad():
        theirs = pipe(prompt=PROMPTS, guidance_scale=cfg, height=height, width=width, num_inference_steps=STEPS,
                      latents=torch.from_numpy(_noise(width, height)), max_sequence_length=LENGTH,
                      output_type="np").images
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\n{family} {width}x{height} cfg {cfg}: {match:.6f} within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10  # a real pattern, not a flat image any pipeline would match
    assert not np.array_equal(out.images[0], out.images[1])  # the prompts and seeds reached each image
    # the schedule diffusers ran (its scheduler after the call) is ours
    schedule = ours.schedule(STEPS, height // 16, width // 16)
    np.testing.assert_allclose(schedule.timesteps, pipe.scheduler.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(schedule.sigmas, pipe.scheduler.sigmas.numpy(), rtol=1e-6)


def test_guidance_changes_only_the_base_model(dit_build: Builder) -> None:
    """The distilled model ignores the guidance scale (one row per image), the base model's CFG changes the image."""
    batch = Batch((ImageSpec(PROMPTS[0], "", seed=3, guidance_scale=1.0),), width=32, height=32, steps=2)
    guided = Batch((ImageSpec(PROMPTS[0], "", seed=3, guidance_scale=5.0),), width=32, height=32, steps=2)
    distilled = _ours(dit_build("flux2-klein")[0])
    np.testing.assert_array_equal(distilled(batch, max_sequence_length=LENGTH).images,
                                  distilled(guided, max_sequence_length=LENGTH).images)
    base = _ours(dit_build("flux2-klein-base")[0])
    plain, cfg = (base(b, max_sequence_length=LENGTH).images.astype(np.int16) for b in (batch, guided))
    assert np.abs(plain - cfg).mean() > 1


def test_tokenizer_matches_transformers(dit_build: Builder) -> None:
    """The template is what the folder's chat template renders (enable_thinking=False), and the served ids (the
    tokenizers library on the exported tokenizer.json) are transformers' for it, padded to the length."""
    from transformers import Qwen2TokenizerFast

    onnx_dir, diffusers_dir = dit_build("flux2-klein")
    tokenizer = Qwen2TokenizerFast.from_pretrained(diffusers_dir / "tokenizer")
    prompt = "Ein Foto, détaillé: 3 Äpfel & a sign saying \"HELLO\"\n"
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
    assert text == TEMPLATE.format(prompt)
    theirs = tokenizer(text, padding="max_length", truncation=True, max_length=LENGTH)
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(onnx_dir / "tokenizer" / "tokenizer.json")).encode(text).ids
    assert ours == theirs.input_ids[:len(ours)] and sum(theirs.attention_mask) == len(ours)


@pytest.mark.parametrize(("class_name", "what"), [("Flux2KleinInpaintPipeline", "inpainting"),
                                                  ("Flux2KleinKVPipeline", "KV cache")])
def test_variants_not_served_are_refused_by_name(class_name: str, what: str, dit_build: Builder,
                                                 tmp_path: Path) -> None:
    """A klein folder relabelled as a klein variant not served is refused at load, by name (FLUX.2 [dev] is served:
    tests/integration/test_flux2_dev_parity.py)."""
    folder = tmp_path / "model"
    shutil.copytree(dit_build("flux2-klein")[1], folder)
    index = json.loads((folder / "model_index.json").read_text(encoding="utf-8"))
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": class_name}), encoding="utf-8")
    with pytest.raises(ModelLoadError, match=what.replace("[", r"\[").replace("]", r"\]")) as caught:
        detect_dit(folder)
    assert class_name in str(caught.value) and "Flux2KleinPipeline" in str(caught.value)


def test_export_of_the_diffusers_folder_is_the_tiny_build(dit_build: Builder, tmp_path: Path) -> None:
    """`sdserve engines export --from` a Flux2KleinPipeline folder (the registry row's ``export``) writes the graphs,
    tokenizer and ``is_distilled`` the tiny build wrote from the same weights."""
    from engines import architectures

    onnx_dir, diffusers_dir = dit_build("flux2-klein")
    row = architectures.of(diffusers_dir)
    assert row.name == "flux2-klein"
    out = row.load(row.export)(diffusers_dir, tmp_path / "exported")
    for part in ("text_encoder/model.onnx", "transformer/model.onnx", "vae_decoder/model.onnx",
                 "tokenizer/tokenizer.json"):
        assert (out / part).read_bytes() == (onnx_dir / part).read_bytes(), part
    assert json.loads((out / "model_index.json").read_text(encoding="utf-8"))["is_distilled"] is True
