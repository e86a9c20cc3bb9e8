"""Our torch-free ORT Qwen-Image pipeline vs diffusers' QwenImagePipeline / QwenImageImg2ImgPipeline on the same
tiny weights and initial noise: true CFG with negative prompts at two sizes (square and not: the dynamic shift, the
2×2 packing and the centred rotary positions change with it), without CFG, and img2img with diffusers' draws
answered by our per-image streams; the tokenizer and the rotary tables against transformers' and diffusers' own;
rows of different requests (different prompt lengths, CFG and not) joined in one transformer call; the variants
refused by name."""

from __future__ import annotations

import dataclasses
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
from engines.engine import OrtEngine
from engines.errors import ModelLoadError
from engines.numerics.qwen_tokenizer import TEMPLATE, TEMPLATE_DROP, QwenTokenizer
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import pack_latents
from engines.pipelines.flow_family import detect_dit
from engines.pipelines.qwen import QwenPipeline, qwen_rope
from engines.protocol import StepRun
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, BatchResult, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [11, 12]
STEPS = 4
CASES = [(64, 64, 4.0), (48, 32, 4.0), (64, 64, 1.0)]
"""(width, height, true_cfg_scale): CFG with negatives at two sizes, then no CFG."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


@functools.lru_cache(maxsize=2)
def _ours(folder: Path) -> QwenPipeline:
    return QwenPipeline(folder, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))


@functools.lru_cache(maxsize=2)
def _torch_pipeline(folder: Path) -> Any:
    import diffusers

    pipe = diffusers.QwenImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(width: int, height: int) -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((16, height // 8, width // 8), dtype=np.float32) for s in SEEDS])


def _compare(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(ours.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\n{what}: {match:.6f} of values within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"{what}: only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs.std() > 10  # a real pattern, not a flat image any pipeline would match


@pytest.mark.parametrize(("width", "height", "cfg"), CASES, ids=[f"{w}x{h}-cfg{c}" for w, h, c in CASES])
def test_images_match_diffusers(width: int, height: int, cfg: float, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build("qwen-image")
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=cfg) for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS,
                                                                                         strict=True)),
                  width=width, height=height, steps=STEPS)
    out = _ours(onnx_dir)(batch)
    latents = torch.from_numpy(pack_latents(_noise(width, height)))
    with torch.no_grad():  # both prompts in one call: diffusers pads the shorter one and masks it
        theirs = _torch_pipeline(diffusers_dir)(
            PROMPTS, negative_prompt=NEGATIVES if cfg > 1 else None, true_cfg_scale=cfg, height=height, width=width,
            num_inference_steps=STEPS, latents=latents, output_type="np").images
    theirs_u8 = np.asarray((theirs * 255).round().astype(np.uint8))
    assert out.images.shape == theirs_u8.shape == (2, height, width, 3)
    _compare(out.images, theirs_u8, f"qwen-image {width}x{height} true_cfg_scale {cfg}")
    assert not np.array_equal(out.images[0], out.images[1])  # the prompts and seeds reached each image


def _init_image(width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) / 64
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x + 4 * y)], axis=-1)
    return np.asarray((rgb * 255).round().astype(np.uint8))


def test_img2img_matches_diffusers(dit_build: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers
    import diffusers.models.autoencoders.vae as vae
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img as module
    from PIL import Image

    width, height, strength = 64, 48, 0.6
    onnx_dir, diffusers_dir = dit_build("qwen-image")
    image = _init_image(width, height)
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=4.0, edit=EditImage(image))
                        for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS, strict=True)),
                  width=width, height=height, steps=STEPS, strength=strength)
    ours = _ours(onnx_dir)
    assert ours.model_info("m").modes == ("txt2img", "img2img")
    out = ours(batch)
    rngs = [image_rng(s) for s in SEEDS]  # our order: start noise, then the encoder's sample noise
    noise, eps = (np.stack([r.standard_normal((16, height // 8, width // 8), dtype=np.float32) for r in rngs])
                  for _ in range(2))

    def answer(array: np.ndarray) -> Any:
        def randn(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
            assert tuple(shape) == array.shape
            return torch.from_numpy(array.copy()).to(dtype=dtype)
        return randn

    monkeypatch.setattr(vae, "randn_tensor", answer(eps[:, :, None]))  # diffusers' latents carry a frame axis
    monkeypatch.setattr(module, "randn_tensor", answer(noise[:, None]))
    pipe = diffusers.QwenImageImg2ImgPipeline.from_pipe(_torch_pipeline(diffusers_dir))
    with torch.no_grad():
        theirs = pipe(PROMPTS, negative_prompt=NEGATIVES, true_cfg_scale=4.0, image=[Image.fromarray(image)] * 2,
                      height=height, width=width, strength=strength, num_inference_steps=STEPS,
                      output_type="np").images
    _compare(out.images, (theirs * 255).round().astype(np.uint8), f"qwen-image img2img strength {strength}")
    txt2img = ours(dataclasses.replace(batch, images=tuple(dataclasses.replace(i, edit=None)
                                                           for i in batch.images))).images
    assert np.abs(txt2img.astype(np.int16) - out.images).mean() > 5  # the init image changed the result


def test_tokenizer_matches_transformers(dit_build: Builder) -> None:
    """The served tokenizer (tokenizers library, the exported tokenizer.json) gives transformers' Qwen2Tokenizer
    ids from the diffusers folder for the templated prompts; the system prefix is the 34 tokens dropped; a prompt
    past max_sequence_length is cut there and reported."""
    from transformers import Qwen2Tokenizer

    onnx_dir, diffusers_dir = dit_build("qwen-image")
    prompts = ["a cat", "Ein Foto, détaillé: 3 Äpfel & a sign saying \"HELLO\"\n", " ".join(["lighthouse"] * 40)]
    theirs = Qwen2Tokenizer.from_pretrained(diffusers_dir / "tokenizer")([TEMPLATE.format(p) for p in prompts],
                                                                        padding=True)
    ours = QwenTokenizer(onnx_dir / "tokenizer")(prompts, 512)
    np.testing.assert_array_equal(ours.ids, np.array(theirs.input_ids))
    assert ours.kept == tuple(sum(m) - TEMPLATE_DROP for m in theirs.attention_mask)
    assert ours.truncated == (False, False, False)
    short = QwenTokenizer(onnx_dir / "tokenizer")(prompts, 16)
    assert short.ids.shape[1] == TEMPLATE_DROP + 16 and short.truncated == (False, True, True)


@pytest.mark.parametrize(("grid_h", "grid_w", "text"), [(4, 4, 7), (5, 3, 2), (2, 7, 12)])
def test_rope_tables_match_diffusers(grid_h: int, grid_w: int, text: int, dit_build: Builder) -> None:
    """``qwen_rope`` equals QwenEmbedRope's complex tables (text then image tokens), odd grids included."""
    from diffusers import QwenImageTransformer2DModel

    config = json.loads((dit_build("qwen-image")[0] / "transformer" / "config.json").read_text())
    model = QwenImageTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")})
    image, words = model.pos_embed([(1, grid_h, grid_w)], max_txt_seq_len=text, device=torch.device("cpu"))
    joint = torch.cat([words, image])
    cos, sin = qwen_rope(grid_h, grid_w, text, tuple(config["axes_dims_rope"]))
    np.testing.assert_allclose(cos, torch.repeat_interleave(joint.real, 2, dim=1).numpy(), atol=2e-6)
    np.testing.assert_allclose(sin, torch.repeat_interleave(joint.imag, 2, dim=1).numpy(), atol=2e-6)


def _run_joined(engine: OrtEngine, first: Batch, later: Batch, join_after: int) -> tuple[BatchResult, BatchResult]:
    running: list[tuple[Batch, StepRun]] = [(first, engine.begin(first))]
    results: dict[int, BatchResult] = {}
    for tick in range(100):
        if tick == join_after:
            running.append((later, engine.begin(later)))
        assert len({engine.step_key(b) for b, _ in running}) == 1
        engine.tick([r for _, r in running])
        for batch, run in list(running):
            if run.finished:
                results[id(batch)] = engine.finish(run)
                running.remove((batch, run))
        if not running:
            break
    return results[id(first)], results[id(later)]


def test_rows_of_different_requests_share_a_call(dit_build: Builder) -> None:
    """A 2-image CFG job and a no-CFG job with a longer prompt joining at tick 2: each image equals its solo run
    (the padded text rows and their key masks are joined with the latents)."""
    engine = OrtEngine(dit_build("qwen-image")[0], RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                   allow_cpu=True))
    engine.load()
    assert engine.info.family == "qwen-image" and engine.info.default_steps == 50
    long = Batch((ImageSpec("a lighthouse", "fog", 3, 4.0), ImageSpec("a lighthouse at dusk", "", 4, 4.0)),
                 64, 64, 6)
    short = Batch((ImageSpec("a red cube on a wooden table under a lamp, photographed from above", "", 9, 1.0),),
                  64, 64, 3)
    alone = [np.stack([np.asarray(g.image, np.int16) for g in engine.generate(b).images]) for b in (long, short)]
    joined = _run_joined(engine, long, short, join_after=2)
    for solo, result in zip(alone, joined, strict=True):
        assert int(np.abs(solo - np.stack([np.asarray(g.image, np.int16) for g in result.images])).max()) <= 1


def test_family_detected_and_variants_refused(dit_build: Builder, tmp_path: Path) -> None:
    onnx_dir, diffusers_dir = dit_build("qwen-image")
    assert detect_dit(onnx_dir).name == detect_dit(diffusers_dir).name == "qwen-image"
    assert detect_dit(onnx_dir).cfg
    for class_name, said in (("QwenImageEditPipeline", "Qwen-Image-Edit"),
                             ("QwenImageLayeredPipeline", "Qwen-Image-Layered"),
                             ("QwenImageControlNetPipeline", "ControlNet")):
        folder = tmp_path / class_name
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
        with pytest.raises(ModelLoadError, match=said):
            detect_dit(folder)
    edit = tmp_path / "edit-2511"
    shutil.copytree(diffusers_dir / "transformer", edit / "transformer", ignore=shutil.ignore_patterns("*.safetensors"))
    shutil.copyfile(diffusers_dir / "model_index.json", edit / "model_index.json")
    config = json.loads((edit / "transformer" / "config.json").read_text())
    (edit / "transformer" / "config.json").write_text(json.dumps({**config, "zero_cond_t": True}))
    with pytest.raises(ModelLoadError, match="zero_cond_t"):
        detect_dit(edit)
