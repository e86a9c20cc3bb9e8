"""FLUX.2 [dev] reference images (klein's mixin engines/pipelines/flux2_refs.py under engines/pipelines/flux2_dev.py)
vs diffusers' ``Flux2Pipeline`` with ``image=`` on the same tiny weights (engines/build/mistral3.py, now with its VAE
encoder) and initial noise: one input image and two of different sizes (their own T offsets and token grids) under
the embedded guidance, no size given to diffusers (its output size rule against ``instruct_size``); the final
latents to float precision; [dev]'s count of input images (6, where klein takes 4) refused past it by name; the
export of the diffusers folder writing the tiny build's VAE encoder. ORT runs the exported graphs with its CPU
provider (onnxruntime/core/providers/cpu: fp32 kernels)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines.contract import image_rng
from engines.pipelines.flux2_dev import REFERENCES, Flux2DevPipeline
from engines.pipelines.flux2_refs import REFERENCES as KLEIN_REFERENCES
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["put the astronaut on a horse", "make the cube red and add a long shadow"]
SEEDS = [11, 12]
STEPS = 3
LENGTH = 96
"""max_sequence_length for both pipelines (512 served: the same code path, a shorter test; the template with its
system message takes about 60 tokens of it)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""
CASES = [(((83, 70),), 4.0), (((64, 100), (83, 70)), 2.5)]
"""(input image sizes, guidance scale): one image, two of other sizes (the first sets the output size; none a
multiple of 16: each cropped)."""

Builder = Callable[[str], tuple[Path, Path]]


def _picture(width: int, height: int, k: int) -> np.ndarray:
    """A smooth, distinct test picture per ``k`` (uint8 [h, w, 3])."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    return np.stack([127 + 120 * np.sin(x / (3.0 + k)), 127 + 120 * np.cos(y / (2.0 + k)), (x * k + y) % 256],
                    axis=-1).clip(0, 255).astype(np.uint8)


@functools.lru_cache(maxsize=1)
def _ours(folder: Path) -> Flux2DevPipeline:
    return Flux2DevPipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=1)
def _theirs(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.Flux2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(ours: Flux2DevPipeline, batch: Batch, noise: np.ndarray) -> np.ndarray:
    """The batch's final latents (normalised, patchified) after the loop ``__call__`` runs, copied to the host."""
    run = ours.begin(batch, noise, max_sequence_length=LENGTH)
    while not run.finished:
        ours.run_denoiser([run.state])
        ours.advance(run.state)
    return np.array(run.state.lat[0].numpy())


@pytest.mark.parametrize(("sizes", "guidance"), CASES, ids=["one", "two"])
def test_edits_match_diffusers(sizes: tuple[tuple[int, int], ...], guidance: float, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    refs = tuple(_picture(w, h, k + 1) for k, (w, h) in enumerate(sizes))
    ours = _ours(onnx_dir)
    info = ours.model_info("m")
    assert "instruct" in info.modes and info.instruct_images == REFERENCES
    width, height = info.instruct_size(sizes)  # type: ignore[misc]
    edit = EditImage(image=refs[0][:height, :width], references=refs)
    batch = Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=guidance, edit=edit)
                        for p, s in zip(PROMPTS, SEEDS, strict=True)), width=width, height=height, steps=STEPS)
    out = ours(batch, max_sequence_length=LENGTH)
    noise = np.stack([image_rng(s).standard_normal((128, height // 16, width // 16), dtype=np.float32)
                      for s in SEEDS])
    pipe = _theirs(diffusers_dir)
    call = dict(prompt=PROMPTS, image=[Image.fromarray(r) for r in refs], guidance_scale=guidance,
                num_inference_steps=STEPS, latents=torch.from_numpy(noise), max_sequence_length=LENGTH)
    with torch.no_grad():
        theirs = pipe(**call, output_type="np").images
        packed = pipe(**call, output_type="latent").images  # [B, h·w, 128], batch-normalised (dev's "latent")
    theirs_latents = packed.numpy().transpose(0, 2, 1).reshape(noise.shape)
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)  # the output size rule is diffusers'
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nflux2-dev {len(refs)} image(s) -> {width}x{height} guidance {guidance}: {match:.6f} within 1/255, "
          f"max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10
    # the final latents (before the VAE, which flattens small differences): diffusers' to float precision, and
    # far from the latents of the same call without the input images
    edited = _latents(ours, batch, noise)
    plain = _latents(ours, replace(batch, images=tuple(replace(s, edit=None) for s in batch.images)), noise)
    error, effect = np.abs(edited - theirs_latents).max(), np.abs(edited - plain).max()
    print(f"latents: max |ours - diffusers'| {error:.2e}; the input images move them by {effect:.2e}")
    assert error < 1e-4 and effect > 100 * error


def test_devs_count_of_input_images(dit_build: Builder) -> None:
    """[dev] takes more input images than klein (``REFERENCES`` against klein's); one more is a 400 naming
    ``image`` and the limit, as is an input image diffusers' ``check_image_input`` refuses."""
    ours = _ours(dit_build("flux2-dev")[0])
    assert REFERENCES > KLEIN_REFERENCES

    def batch(*refs: np.ndarray) -> Batch:
        edit = EditImage(image=_picture(64, 64, 1), references=refs)
        return Batch((ImageSpec("x", edit=edit),), width=64, height=64, steps=1)

    ours.check_inputs(batch(*[_picture(64, 64, k) for k in range(REFERENCES)]))  # past klein's limit: taken
    cases = {f"1 to {REFERENCES} input images": batch(*[_picture(64, 64, k) for k in range(REFERENCES + 1)]),
             "at least 64 pixels": batch(_picture(48, 64, 1))}
    for words, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=words) as caught:
            ours(bad, max_sequence_length=LENGTH)
        assert caught.value.param == "image", words


def test_export_of_the_diffusers_folder_writes_the_vae_encoder(dit_build: Builder, tmp_path: Path) -> None:
    """The registry row's ``export`` of the Flux2Pipeline folder writes the VAE encoder the tiny build wrote from the
    same weights, named in model_index.json and hashed by the manifest."""
    from engines import architectures

    onnx_dir, diffusers_dir = dit_build("flux2-dev")
    row = architectures.of(diffusers_dir)
    out = row.load(row.export)(diffusers_dir, tmp_path / "exported")
    assert (out / "vae_encoder/model.onnx").read_bytes() == (onnx_dir / "vae_encoder/model.onnx").read_bytes()
    index = json.loads((out / "model_index.json").read_text(encoding="utf-8"))
    assert index["vae_encoder"][1] == "OnnxRuntimeModel" and index["_class_name"] == "OnnxFlux2Pipeline"
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert "vae_encoder/model.onnx" in manifest["files"] and manifest["source"]["kind"] == "diffusers-folder"
