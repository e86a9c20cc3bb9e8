"""FLUX.1 Kontext [dev] instruction edits: our ORT pipeline (engines/pipelines/kontext.py, the flow.py
``extra_tokens`` hook) vs diffusers' FluxKontextPipeline on the same tiny weights and initial noise, one input image
at two input sizes (another preferred resolution each, so another reference token count and other position ids),
and the output size rule where a call names no size."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import FlowPipeline, load_pipeline, pack_latents
from engines.pipelines.kontext import kontext_size, reference_size
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["make the sky purple", "add a red hat"]
SEEDS = [21, 22]
STEPS = 3
GUIDANCE = 3.5
T5_LENGTH = 64
"""A short T5 length to stay fast (passed to both pipelines)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""


@pytest.fixture(scope="module")
def kontext(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(ONNX folder, diffusers FluxKontextPipeline folder) of the tiny Kontext model."""
    from engines.build.kontext import build_tiny_kontext

    root = tmp_path_factory.mktemp("kontext")
    build_tiny_kontext(root / "onnx", diffusers_out=root / "diffusers")
    return root / "onnx", root / "diffusers"


@functools.lru_cache(maxsize=1)
def _ours(folder: Path) -> FlowPipeline:
    return load_pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=1)
def _theirs(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.FluxKontextPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _input_image(width: int, height: int) -> np.ndarray:
    """A smooth pattern with edges (the resize and the encoder see structure, not noise)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.stack([127 + 120 * np.sin(x / 7.0), 127 + 120 * np.cos(y / 5.0), (x + y) % 256], axis=-1)
    return np.ascontiguousarray(image.clip(0, 255).astype(np.uint8))


@pytest.mark.parametrize(("in_w", "in_h"), [(72, 48), (40, 88)])
def test_instruction_edit_matches_diffusers(in_w: int, in_h: int, kontext: tuple[Path, Path]) -> None:
    onnx_dir, diffusers_dir = kontext
    width, height = 64, 48
    ref = _input_image(in_w, in_h)
    edit = EditImage(np.asarray(Image.fromarray(ref).resize((width, height))), references=(ref,))
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, edit=edit) for p, s in zip(PROMPTS, SEEDS,
                                                                                                strict=True)),
                  width=width, height=height, steps=STEPS)
    assert batch.mode == "instruct"
    out = _ours(onnx_dir)(batch, max_sequence_length=T5_LENGTH)
    noise = np.stack([image_rng(s).standard_normal((16, height // 8, width // 8), dtype=np.float32) for s in SEEDS])
    with torch.no_grad():
        theirs = _theirs(diffusers_dir)(image=Image.fromarray(ref), prompt=PROMPTS, height=height, width=width,
                                        max_area=width * height, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                                        latents=torch.from_numpy(pack_latents(noise)),
                                        max_sequence_length=T5_LENGTH, output_type="np").images
    theirs = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs.shape == (2, height, width, 3)
    diff = np.abs(out.images.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nkontext parity, input {in_w}x{in_h} -> {reference_size(in_w, in_h, 16)}: {match:.6f} within 1/255, "
          f"max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs.std() > 10
    plain = _ours(onnx_dir)(Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(
        PROMPTS, SEEDS, strict=True)), width=width, height=height, steps=STEPS), max_sequence_length=T5_LENGTH)
    assert np.abs(plain.images.astype(np.int16) - out.images.astype(np.int16)).max() > 8  # the reference counted


def test_reference_sizes_follow_diffusers_table() -> None:
    """The preferred resolution nearest the aspect of the sides floored to 16 first: 72x48 is 64x48 (4:3, not
    3:2) -> 1184x880; 40x88 is 32x80 -> 672x1568; 96x64 (3:2) -> 1248x832."""
    assert reference_size(64, 64, 16) == (1024, 1024)
    assert reference_size(72, 48, 16) == (1184, 880)
    assert reference_size(96, 64, 16) == (1248, 832)
    assert reference_size(40, 88, 16) == (672, 1568)
    with pytest.raises(InvalidRequestError) as err:
        reference_size(8, 64, 16)
    assert err.value.param == "image"


def test_output_size_rule_matches_diffusers(kontext: tuple[Path, Path]) -> None:
    """With no size, diffusers gives the default square rescaled to max_area (1024x1024 whatever the input): the
    served ModelInfo.instruct_size says the same, and a one-step call's latents hold that many tokens."""
    onnx_dir, diffusers_dir = kontext
    info = _ours(onnx_dir).model_info("kontext")
    assert info.instruct_images == 1 and "instruct" in info.modes and info.instruct_size is not None
    width, height = info.instruct_size(((72, 48),))
    assert (width, height) == kontext_size(((40, 88),)) == (1024, 1024)
    with torch.no_grad():
        latents = _theirs(diffusers_dir)(image=None, prompt=PROMPTS[0],  # the input does not enter the rule
                                         num_inference_steps=1, max_sequence_length=T5_LENGTH,
                                         output_type="latent").images
    assert latents.shape[1] == (width // 16) * (height // 16)
    assert kontext_size(((72, 48),), max_area=80 * 80) == (80, 80)


def test_two_input_images_and_mixed_resolutions_are_refused(kontext: tuple[Path, Path]) -> None:
    ours = _ours(kontext[0])
    ref = _input_image(64, 64)
    two = Batch((ImageSpec("x", edit=EditImage(ref, references=(ref, ref))),), steps=1)
    with pytest.raises(InvalidRequestError, match="1 input image") as err:
        ours(two)
    assert err.value.param == "image"
    mixed = Batch((ImageSpec("x", edit=EditImage(ref, references=(ref,))),
                   ImageSpec("y", edit=EditImage(ref, references=(_input_image(72, 48),)))), steps=1)
    with pytest.raises(InvalidRequestError, match="one Kontext resolution"):
        ours(mixed)


def test_rows_with_other_references_joining_mid_way_get_their_solo_images(kontext: tuple[Path, Path]) -> None:
    """Step-level batching (engines/engine.py begin/tick/finish on ONNX Runtime's CPU sessions,
    onnxruntime/core/providers/cpu): an instruct request runs; a txt2img row, then an instruct row whose input
    resizes to another Kontext resolution (another token count, other rope tables) join it mid-way. The rows with
    other extra tokens run in calls of their own (flow.py ``run_denoiser``), so each gets its solo image."""
    from tests.integration.test_step_batching import _close, _engine, _pixels, _run_joined

    engine = _engine(kontext[0])
    wide, tall = _input_image(72, 48), _input_image(40, 88)

    def batch(prompt: str, seed: int, steps: int, ref: np.ndarray | None, n: int = 1) -> Batch:
        edit = None if ref is None else EditImage(np.zeros((64, 64, 3), np.uint8), references=(ref,))
        return Batch(tuple(ImageSpec(f"{prompt} {k}", seed=seed + k, guidance_scale=GUIDANCE, edit=edit)
                           for k in range(n)), 64, 64, steps, "euler")

    long = batch("make it snow", 10, 4, wide, n=2)
    alone_long = engine.generate(long)
    for later in (batch("a red cube", 40, 2, None), batch("add a hat", 50, 2, tall)):
        alone_later = engine.generate(later)
        joined_long, joined_later = _run_joined(engine, long, later, join_after=2)
        assert joined_long.steps_done == 4 and joined_later.steps_done == 2
        assert _close(joined_later, alone_later) <= 1
        assert _close(joined_long, alone_long) <= 1
        assert np.abs(_pixels(joined_later)[0] - _pixels(joined_long)[0]).max() > 8


def test_engines_export_from_a_kontext_folder_gives_the_same_images(kontext: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """`sdserve engines export --from <FluxKontextPipeline folder>`: the flux-kontext row's export (dit_export's
    Flux.1 path, the VAE encoder included) serves the images the tiny build serves."""
    import argparse
    import json

    from server.cli.engines import run as engines_run

    onnx_dir, diffusers_dir = kontext
    assert engines_run(argparse.Namespace(engines_cmd="export", src=diffusers_dir, out=tmp_path / "out")) == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]["family"] == "flux-kontext"
    assert json.loads((tmp_path / "out" / "model_index.json").read_text())["_class_name"] == "OnnxFluxKontextPipeline"
    ref = _input_image(48, 48)
    batch = Batch((ImageSpec("make it blue", seed=3, guidance_scale=GUIDANCE,
                             edit=EditImage(np.zeros((32, 32, 3), np.uint8), references=(ref,))),),
                  width=32, height=32, steps=2)
    exported = load_pipeline(tmp_path / "out", Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                       allow_cpu=True)))
    np.testing.assert_array_equal(exported(batch, max_sequence_length=T5_LENGTH).images,
                                  _ours(onnx_dir)(batch, max_sequence_length=T5_LENGTH).images)
