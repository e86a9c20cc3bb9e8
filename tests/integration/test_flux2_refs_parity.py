"""FLUX.2 [klein] reference images (engines/pipelines/flux2_refs.py) vs diffusers' ``Flux2KleinPipeline`` with
``image=`` on the same tiny weights and initial noise: one input image and two of different sizes (their own T
offsets and token grids), the step-distilled checkpoint and the base one under CFG (diffusers' empty negative
prompt), no size given to diffusers (its output size rule against ``flux2_size``); the preprocessing (the area
rescale, the floor by centre crop) against diffusers' ``Flux2ImageProcessor``; bad input refused by name. ORT runs
the exported graphs with its CPU provider (onnxruntime/core/providers/cpu: fp32 kernels)."""

from __future__ import annotations

import functools
import json
import shutil
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
from engines.pipelines.flux2 import Flux2Pipeline
from engines.pipelines.flux2_refs import REFERENCES, flux2_size, reference_pixels, reference_size
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["put the astronaut on a horse", "make the cube red and add a long shadow"]
SEEDS = [11, 12]
STEPS = 3
LENGTH = 48
"""max_sequence_length for both pipelines (512 served: the same code path, a shorter test)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""


def _picture(width: int, height: int, k: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    return np.stack([127 + 120 * np.sin(x / (3.0 + k)), 127 + 120 * np.cos(y / (2.0 + k)), (x * k + y) % 256],
                    axis=-1).clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(ONNX folder, diffusers folder) of the distilled tiny klein with its VAE encoder, and the base checkpoint:
    the same weights with ``is_distilled`` false (as engines/build/flux2.py builds both)."""
    from engines.build.flux2_refs import build_tiny_flux2_refs

    root = tmp_path_factory.mktemp("flux2_refs")
    build_tiny_flux2_refs(root / "onnx", diffusers_out=root / "diffusers")
    built = {"flux2-klein": (root / "onnx", root / "diffusers")}
    base = []
    for folder in built["flux2-klein"]:
        copy = root / f"base-{folder.name}"
        shutil.copytree(folder, copy)
        index = json.loads((copy / "model_index.json").read_text(encoding="utf-8"))
        (copy / "model_index.json").write_text(json.dumps({**index, "is_distilled": False}), encoding="utf-8")
        base.append(copy)
    built["flux2-klein-base"] = (base[0], base[1])
    return built


@functools.lru_cache(maxsize=2)
def _ours(folder: Path) -> Flux2Pipeline:
    return Flux2Pipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


def _theirs(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.Flux2KleinPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


CASES = [("flux2-klein", ((83, 70),), 1.0), ("flux2-klein", ((83, 70), (64, 100)), 1.0),
         ("flux2-klein-base", ((64, 100), (83, 70)), 4.0)]
"""(family, input image sizes, guidance scale): one image, two of other sizes (the first sets the output size;
neither a multiple of 16: both cropped), the base model's CFG with two."""


@pytest.mark.parametrize(("family", "sizes", "cfg"), CASES, ids=["one", "two", "two-base-cfg"])
def test_edits_match_diffusers(family: str, sizes: tuple[tuple[int, int], ...], cfg: float,
                               folders: dict[str, tuple[Path, Path]]) -> None:
    onnx_dir, diffusers_dir = folders[family]
    refs = tuple(_picture(w, h, k + 1) for k, (w, h) in enumerate(sizes))
    ours = _ours(onnx_dir)
    width, height = ours.model_info("m").instruct_size(sizes)  # type: ignore[misc]
    edit = EditImage(image=refs[0][:height, :width], references=refs)
    batch = Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=cfg, edit=edit) for p, s in zip(PROMPTS, SEEDS,
                                                                                               strict=True)),
                  width=width, height=height, steps=STEPS)
    out = ours(batch, max_sequence_length=LENGTH)
    noise = np.stack([image_rng(s).standard_normal((128, height // 16, width // 16), dtype=np.float32)
                      for s in SEEDS])
    pipe = _theirs(diffusers_dir)
    with torch.no_grad():
        theirs = pipe(prompt=PROMPTS, image=[Image.fromarray(r) for r in refs], guidance_scale=cfg,
                      num_inference_steps=STEPS, latents=torch.from_numpy(noise), max_sequence_length=LENGTH,
                      output_type="np").images
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)  # the output size rule is diffusers'
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\n{family} {len(refs)} image(s) -> {width}x{height} cfg {cfg}: {match:.6f} within 1/255, "
          f"max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10
    # the final latents (before the VAE, which flattens small differences): diffusers' to float precision, and
    # far from the latents of the same call without the input images
    with torch.no_grad():
        latents = pipe(prompt=PROMPTS, image=[Image.fromarray(r) for r in refs], guidance_scale=cfg,
                       num_inference_steps=STEPS, latents=torch.from_numpy(noise), max_sequence_length=LENGTH,
                       output_type="latent").images
        bn = pipe.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        theirs_latents = ((pipe._patchify_latents(latents) - bn.running_mean.view(1, -1, 1, 1)) / std).numpy()
    edited = _our_latents(ours, batch, noise)
    plain = _our_latents(ours, replace(batch, images=tuple(replace(s, edit=None) for s in batch.images)), noise)
    error, effect = np.abs(edited - theirs_latents).max(), np.abs(edited - plain).max()
    print(f"latents: max |ours - diffusers'| {error:.2e}; the input images move them by {effect:.2e}")
    assert error < 1e-4 and effect > 100 * error


def _our_latents(ours: Flux2Pipeline, batch: Batch, noise: np.ndarray) -> np.ndarray:
    """The batch's final latents (normalised, patchified) after the loop ``__call__`` runs, copied to the host."""
    run = ours.begin(batch, noise, max_sequence_length=LENGTH)
    while not run.finished:
        ours.run_denoiser([run.state])
        ours.advance(run.state)
    return np.array(run.state.lat[0].numpy())


@pytest.mark.parametrize(("width", "height"), [(83, 70), (64, 100), (1100, 1000), (2000, 600), (1025, 1024)])
def test_preprocessing_is_diffusers(width: int, height: int) -> None:
    """Each input image as Flux2KleinPipeline prepares it (its loop over ``image``): the area rescale past 1024²,
    the floor to 16 by ``preprocess(..., resize_mode="crop")``; the output size its first image's."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    processor = Flux2ImageProcessor(vae_scale_factor=16)
    image = Image.fromarray(_picture(width, height, 1))
    processor.check_image_input(image)
    if image.width * image.height > 1024 * 1024:
        image = processor._resize_to_target_area(image, 1024 * 1024)
    w, h = image.width // 16 * 16, image.height // 16 * 16
    theirs = processor.preprocess(image, height=h, width=w, resize_mode="crop").numpy()
    assert reference_size(width, height) == flux2_size(((width, height), (64, 64))) == (w, h)
    np.testing.assert_allclose(reference_pixels(_picture(width, height, 1)), theirs, atol=1e-6)


def test_bad_input_is_refused_by_name(folders: dict[str, tuple[Path, Path]]) -> None:
    """What diffusers' ``check_image_input`` raises on, more images than the model takes and input images of one
    batch that encode to different sizes: each a 400 naming ``image``."""
    ours = _ours(folders["flux2-klein"][0])

    def batch(*refs: np.ndarray, second: tuple[np.ndarray, ...] = ()) -> Batch:
        specs = [ImageSpec("x", edit=EditImage(image=_picture(64, 64, 1), references=refs))]
        if second:
            specs.append(ImageSpec("x", edit=EditImage(image=_picture(64, 64, 1), references=second)))
        return Batch(tuple(specs), width=64, height=64, steps=1)

    cases = {"at least 64 pixels": batch(_picture(48, 64, 1)),
             "aspect ratio of at most 8": batch(_picture(600, 64, 1)),
             f"1 to {REFERENCES} input images": batch(*[_picture(64, 64, k) for k in range(REFERENCES + 1)]),
             "one encoded size": batch(_picture(64, 64, 1), second=(_picture(80, 64, 1),))}
    for words, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=words) as caught:
            ours(bad, max_sequence_length=LENGTH)
        assert caught.value.param == "image", words


def test_edit_rows_join_running_rows_and_keep_their_solo_latents(folders: dict[str, tuple[Path, Path]],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Step-level batching (engines/steps.py begin/tick): a 2-image txt2img request runs; after one tick two edit
    requests with other input images of one size join it (their reference tokens: one key, one transformer call
    joining their rows; the txt2img rows another). Each request's final latents equal its solo run's, far closer
    than the input images move them."""
    from tests.integration.test_step_batching import _engine

    engine = _engine(folders["flux2-klein"][0])
    size = engine.pipeline.default_size

    def edit(k: int, image: int | None = None) -> Batch:
        picture = _picture(size, size, k if image is None else image)
        return Batch((ImageSpec(PROMPTS[k % 2], seed=20 + k, guidance_scale=1.0,
                                edit=EditImage(image=picture, references=(picture,))),), size, size, 3, "euler")

    long = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=1.0) for p, s in zip(PROMPTS, SEEDS, strict=True)), size,
                 size, 4, "euler")
    batches = [long, edit(1), edit(2), edit(1, image=2)]  # the last: the first edit with the second's image

    def latents(run: Any) -> np.ndarray:
        return np.array(run.begun.state.lat[0].numpy())

    solo = []
    for batch in batches:
        run = engine.begin(batch)
        while not run.finished:
            engine.tick([run])
        solo.append(latents(run))
        engine.finish(run)
    calls: list[int] = []
    run_joined = engine.pipeline._run_joined
    monkeypatch.setattr(engine.pipeline, "_run_joined", lambda states: (calls.append(len(states)),
                                                                         run_joined(states)))
    running = {0: engine.begin(long)}
    engine.tick([running[0]])
    running.update({k: engine.begin(batches[k]) for k in (1, 2)})
    joined: dict[int, np.ndarray] = {}
    while running:
        engine.tick(list(running.values()))
        for k, run in list(running.items()):
            if run.finished:
                joined[k] = latents(run)
                engine.finish(running.pop(k))
    errors = [float(np.abs(joined[k] - solo[k]).max()) for k in range(3)]
    effect = float(np.abs(solo[1] - solo[3]).max())
    print(f"\njoined vs solo latents: max |diff| {errors}; the other input image moves them by {effect:.2e}; "
          f"rows per transformer call {calls}")
    assert max(errors) < 1e-5 and effect > 2e-4
    assert calls == [1] + [1, 2] * 3  # alone; then per tick the txt2img run's call and the two edit runs' one


def test_export_of_the_diffusers_folder_is_the_tiny_build(folders: dict[str, tuple[Path, Path]],
                                                          tmp_path: Path) -> None:
    """``export_flux2_refs_folder`` on the Flux2KleinPipeline folder writes the graphs the tiny build wrote from the
    same weights, the VAE encoder included, named in model_index.json and hashed by the manifest."""
    from engines.build.flux2_refs import export_flux2_refs_folder

    onnx_dir, diffusers_dir = folders["flux2-klein"]
    out = export_flux2_refs_folder(diffusers_dir, tmp_path / "exported")
    for part in ("vae_encoder/model.onnx", "transformer/model.onnx", "vae_decoder/model.onnx"):
        assert (out / part).read_bytes() == (onnx_dir / part).read_bytes(), part
    assert json.loads((out / "model_index.json").read_text(encoding="utf-8"))["vae_encoder"][1] == "OnnxRuntimeModel"
    manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert "vae_encoder/model.onnx" in manifest["files"] and manifest["source"]["kind"] == "diffusers-folder"
