"""Our torch-free ORT DiT pipeline vs diffusers' FluxPipeline / StableDiffusion3Pipeline on the same tiny weights and
initial noise: Flux dev-like and schnell-like, SD 3 and SD 3.5, each at 64x64 and Flux dev / SD 3.5 at a second,
non-square size too (the dynamic shift and the 2×2 packing change with it); img2img vs FluxImg2ImgPipeline and
StableDiffusion3Img2ImgPipeline with diffusers' draws answered by our per-image streams."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError, ModelLoadError
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import FlowPipeline, load_pipeline, pack_latents
from engines.pipelines.flow_family import detect_dit
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, EditImage, ImageSpec

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
NEGATIVES = ["blurry", "low quality, watermark"]
"""SD 3's CFG rows (Flux has no negative prompt)."""
SEEDS = [11, 12]
STEPS = 4
GUIDANCE = {"flux": 3.5, "flux-schnell": 0.0, "sd3": 5.0, "sd35": 4.5}
T5_LENGTH = {"flux": 64, "flux-schnell": 64, "sd3": None, "sd35": None}
"""Flux at a short T5 length to stay fast (passed to both pipelines); SD 3 at the pipelines' default 256."""
CASES = [("flux", 64, 64), ("flux", 48, 32), ("flux-schnell", 64, 64), ("sd3", 64, 64), ("sd35", 64, 64),
         ("sd35", 32, 48)]
"""(family, width, height)."""
EDITS = {"flux": (64, 48, 0.6), "sd35": (64, 64, 0.7)}
"""img2img parity cases: family -> (width, height, strength)."""
MIN_MATCH = 0.999
"""Fraction of uint8 channel values that must be within 1/255 of diffusers'."""

Builder = Callable[[str], tuple[Path, Path]]


def _runtime() -> Runtime:
    return Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))


@functools.lru_cache(maxsize=8)
def _ours(folder: Path) -> FlowPipeline:
    """One loaded pipeline per folder for the whole module (sessions take about a second to build)."""
    return load_pipeline(folder, _runtime())


@functools.lru_cache(maxsize=4)
def _torch_pipeline(family: str, folder: Path) -> Any:
    import diffusers

    kind = diffusers.FluxPipeline if family.startswith("flux") else diffusers.StableDiffusion3Pipeline
    pipe = kind.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _theirs(family: str, folder: Path, noise: np.ndarray, width: int, height: int) -> np.ndarray:
    flux = family.startswith("flux")
    pipe = _torch_pipeline(family, folder)
    extra: dict[str, Any] = {"max_sequence_length": T5_LENGTH[family]} if T5_LENGTH[family] else \
        {"negative_prompt": NEGATIVES}
    latents = torch.from_numpy(pack_latents(noise) if flux else noise)
    with torch.no_grad():
        images = pipe(PROMPTS, height=height, width=width, num_inference_steps=STEPS, guidance_scale=GUIDANCE[family],
                      latents=latents, output_type="np", **extra).images
    return np.asarray((images * 255).round().astype(np.uint8))


@pytest.mark.parametrize(("family", "width", "height"), CASES, ids=[f"{f}-{w}x{h}" for f, w, h in CASES])
def test_images_match_diffusers(family: str, width: int, height: int, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build(family)
    ours = _ours(onnx_dir)
    negatives = NEGATIVES if family.startswith("sd3") else ["", ""]
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=GUIDANCE[family])
                        for p, n, s in zip(PROMPTS, negatives, SEEDS, strict=True)),
                  width=width, height=height, steps=STEPS)
    out = ours(batch, max_sequence_length=T5_LENGTH[family])  # our own seeded noise, handed to diffusers below
    noise = np.stack([image_rng(s).standard_normal((16, height // 8, width // 8), dtype=np.float32) for s in SEEDS])
    theirs = _theirs(family, diffusers_dir, noise, width, height)
    assert out.images.shape == theirs.shape == (2, height, width, 3)
    diff = np.abs(out.images.astype(np.int16) - theirs.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nparity {family} {width}x{height}: {match:.6f} of values within 1/255, max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"{family}: only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs.std() > 10  # a real pattern, not a flat image any pipeline would match
    assert not np.array_equal(out.images[0], out.images[1])  # the prompts and seeds reached each image


def _init_image(width: int, height: int) -> np.ndarray:
    """A smooth, structured RGB picture (not noise), the same on both sides."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) / 64
    rgb = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x + 4 * y)], axis=-1)
    return np.asarray((rgb * 255).round().astype(np.uint8))


def _patch_noise(monkeypatch: pytest.MonkeyPatch, module: Any, noise: np.ndarray, eps: np.ndarray) -> None:
    """diffusers' draws answered with ours: the start noise in the pipeline, the encoder's sample noise in vae.py."""
    import diffusers.models.autoencoders.vae as vae

    def answer(array: np.ndarray) -> Any:
        def randn(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
            assert tuple(shape) == array.shape
            return torch.from_numpy(array.copy()).to(dtype=dtype)
        return randn

    monkeypatch.setattr(vae, "randn_tensor", answer(eps))
    monkeypatch.setattr(module, "randn_tensor", answer(noise))


@pytest.mark.parametrize("family", sorted(EDITS))
def test_img2img_matches_diffusers(family: str, dit_build: Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers
    from PIL import Image

    width, height, strength = EDITS[family]
    onnx_dir, diffusers_dir = dit_build(family)
    image = _init_image(width, height)
    negatives = NEGATIVES if family.startswith("sd3") else ["", ""]
    batch = Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=GUIDANCE[family], edit=EditImage(image))
                        for p, n, s in zip(PROMPTS, negatives, SEEDS, strict=True)),
                  width=width, height=height, steps=STEPS, strength=strength)
    ours = _ours(onnx_dir)
    assert ours.model_info("m").modes == ("txt2img", "img2img")
    out = ours(batch, max_sequence_length=T5_LENGTH[family])
    rngs = [image_rng(s) for s in SEEDS]  # our order: start noise, then the encoder's sample noise
    noise, eps = (np.stack([r.standard_normal((16, height // 8, width // 8), dtype=np.float32) for r in rngs])
                  for _ in range(2))
    flux = family.startswith("flux")
    module = __import__("diffusers.pipelines.flux.pipeline_flux_img2img" if flux else
                        "diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img", fromlist=["_"])
    _patch_noise(monkeypatch, module, noise, eps)
    kind = diffusers.FluxImg2ImgPipeline if flux else diffusers.StableDiffusion3Img2ImgPipeline
    pipe = kind.from_pipe(_torch_pipeline(family, diffusers_dir))
    extra: dict[str, Any] = {"max_sequence_length": T5_LENGTH[family]} if flux else {"negative_prompt": NEGATIVES}
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(image)] * 2, height=height, width=width, strength=strength,
                      num_inference_steps=STEPS, guidance_scale=GUIDANCE[family], output_type="np", **extra).images
    theirs_u8 = (theirs * 255).round().astype(np.uint8)
    diff = np.abs(out.images.astype(np.int16) - theirs_u8.astype(np.int16))
    match = float((diff <= 1).mean())
    print(f"\nimg2img parity {family} {width}x{height} strength {strength}: {match:.6f} within 1/255, "
          f"max |diff| {diff.max()}/255")
    assert match >= MIN_MATCH, f"{family} img2img: only {match:.4%} within 1/255 (max diff {diff.max()})"
    assert theirs_u8.std() > 10
    txt2img = ours(dataclasses.replace(batch, images=tuple(dataclasses.replace(i, edit=None) for i in batch.images)),
                   max_sequence_length=T5_LENGTH[family]).images
    assert np.abs(txt2img.astype(np.int16) - out.images).mean() > 5  # the init image changed the result


def test_flux_graph_has_no_double_ops_and_takes_fp32_rope_tables(dit_build: Builder) -> None:
    model = onnx.load(str(dit_build("flux")[0] / "transformer" / "model.onnx"))
    double = onnx.TensorProto.DOUBLE
    inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    assert inputs["rope_cos"] == inputs["rope_sin"] == onnx.TensorProto.FLOAT
    assert "guidance" in inputs
    assert not [t.name for t in model.graph.initializer if t.data_type == double]
    casts = [n.name for n in model.graph.node if n.op_type == "Cast"
             and any(a.name == "to" and a.i == double for a in n.attribute)]
    assert not casts
    schnell = onnx.load(str(dit_build("flux-schnell")[0] / "transformer" / "model.onnx"))
    assert "guidance" not in {i.name for i in schnell.graph.input}


@pytest.mark.parametrize("family", ["flux", "flux-schnell", "sd3", "sd35"])
def test_family_detected_from_both_folders(family: str, dit_build: Builder) -> None:
    onnx_dir, diffusers_dir = dit_build(family)
    assert detect_dit(onnx_dir).name == detect_dit(diffusers_dir).name == family


def test_tokenizers_match_transformers(dit_build: Builder) -> None:
    """The served tokenizers (tokenizers library) give the ids transformers' tokenizers give from the diffusers
    folder: T5 with truncation at max_sequence_length, and SD 3's CLIP-G padding with ``!``."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    from engines.numerics.t5_tokenizer import T5Tokenizer
    from engines.numerics.tokenizer import ClipTokenizer

    onnx_dir, diffusers_dir = dit_build("sd3")
    prompts = ["a cat", "A photo of an ASTRONAUT riding a horse on Mars, 8k, détaillé",
               " ".join(["lighthouse"] * 40)]
    theirs = T5TokenizerFast.from_pretrained(diffusers_dir / "tokenizer_3")(
        prompts, padding="max_length", max_length=16, truncation=True).input_ids
    ours = T5Tokenizer(onnx_dir / "tokenizer_3")(prompts, 16)
    np.testing.assert_array_equal(ours.ids, np.array(theirs))
    assert ours.truncated == (False, True, True)
    clip_g = CLIPTokenizer.from_pretrained(diffusers_dir / "tokenizer_2")(prompts, padding="max_length",
                                                                         max_length=77, truncation=True).input_ids
    ours_g = ClipTokenizer(onnx_dir / "tokenizer_2")(prompts)
    np.testing.assert_array_equal(ours_g.ids, np.array(clip_g))
    assert ours_g.ids[0, -1] == 0  # "!"


def test_t5_truncation_is_reported_or_refused(dit_build: Builder) -> None:
    ours = _ours(dit_build("flux-schnell")[0])
    long = " ".join(["lighthouse"] * 20)
    batch = Batch((ImageSpec("a cat", seed=1, guidance_scale=0.0), ImageSpec(long, seed=2, guidance_scale=0.0)),
                  width=32, height=32, steps=1)
    assert ours(batch, max_sequence_length=8).truncated == (False, True)
    with pytest.raises(InvalidRequestError, match="T5"):
        ours(Batch(batch.images, width=32, height=32, steps=1, truncate_prompts=False), max_sequence_length=8)
    with pytest.raises(InvalidRequestError, match="multiple of 16"):
        ours(Batch(batch.images, width=40, height=32, steps=1))
    with pytest.raises(InvalidRequestError, match="Euler"):
        ours(Batch(batch.images, width=32, height=32, steps=1, scheduler="ddim"))
    edit = (ImageSpec("a cat", edit=EditImage(np.zeros((32, 32, 3), np.uint8))),)
    with pytest.raises(InvalidRequestError, match="img2img is not served by this model"):  # no vae_encoder
        ours(Batch(edit, width=32, height=32, steps=1))
    info = ours.model_info("tiny-flux-schnell")
    assert (info.family, info.cfg_default, info.default_steps, info.default_guidance) == ("flux-schnell", False, 4,
                                                                                          0.0)
    assert (info.text_encoders, info.schedulers, info.size_multiple, info.prediction_type) == (
        2, ("euler", "euler_a", "dpmpp_2m", "unipc"), 16, "flow")


def test_serving_the_dit_pipeline_imports_no_torch(dit_build: Builder) -> None:
    folder = dit_build("sd35")[0]
    code = ("import sys; from engines.config import RuntimeSettings; from engines.runtime.sessions import Runtime; "
            "from engines.pipelines.flow import load_pipeline; from engines.types.request import Batch, ImageSpec; "
            f"p = load_pipeline(__import__('pathlib').Path({str(folder)!r}), "
            "Runtime(RuntimeSettings(providers=('CPUExecutionProvider',), allow_cpu=True))); "
            "p(Batch((ImageSpec('a cat', guidance_scale=5.0),), width=32, height=32, steps=1)); "
            "bad = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules); "
            "print('imported:', bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_engines_export_from_a_diffusers_folder_gives_the_same_images(dit_build: Builder, tmp_path: Path) -> None:
    """`sdserve engines export --from <FluxPipeline folder>`: the family is detected and the export serves the
    images the tiny build serves."""
    from server.cli.engines import run as engines_run

    onnx_dir, diffusers_dir = dit_build("flux-schnell")
    assert engines_run(argparse.Namespace(engines_cmd="export", src=diffusers_dir, out=tmp_path / "out")) == 0
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["source"]["family"] == "flux-schnell"
    batch = Batch((ImageSpec("a lighthouse at dusk", seed=5, guidance_scale=0.0),), width=32, height=32, steps=2)
    exported = load_pipeline(tmp_path / "out", _runtime())(batch).images
    np.testing.assert_array_equal(exported, _ours(onnx_dir)(batch).images)
    kontext = tmp_path / "kontext"
    (kontext / "transformer").mkdir(parents=True)
    (kontext / "model_index.json").write_text(json.dumps({"_class_name": "FluxKontextInpaintPipeline"}))
    with pytest.raises(ModelLoadError, match="Flux.1 Kontext inpainting"):
        engines_run(argparse.Namespace(engines_cmd="export", src=kontext, out=tmp_path / "k"))


@pytest.mark.plugin_ep
@pytest.mark.parametrize("family", sorted(EDITS))
def test_every_dit_node_runs_on_the_accelerator_ep(family: str, dit_build: Builder) -> None:
    """The openvino profile's runtime (a real plugin EP, CPU fallback disabled, placement audit on) builds every DiT
    session, the step, decode and edit graphs included, with no node on the CPU, and gives the CPU's images."""
    from server.settings import load_settings
    from tests.plugin_ep import PROFILE, accelerator

    runtime = load_settings(config=PROFILE).runtime
    assert runtime.plugin is not None and runtime.disable_cpu_ep_fallback and not runtime.allow_cpu
    plugin = runtime.plugin.model_copy(update={"require_artifacts": False,  # plain models: no EP-context here
                                               "library": accelerator().library or runtime.plugin.library})
    onnx_dir = dit_build(family)[0]
    ours = load_pipeline(onnx_dir, Runtime(runtime.model_copy(update={"plugin": plugin})))
    reports = ours.runtime.reports
    assert {"transformer", "flow_step", "flow_decode", "flow_noise1", "vae_encoder"} <= set(reports)
    for name, report in reports.items():
        assert report.providers_used[0] == plugin.name, name
        assert report.placement is not None and not report.placement.cpu_nodes, (name, report.placement)
    edit = EditImage(_init_image(32, 32))
    for images in ((ImageSpec("a lighthouse", "blurry", seed=3, guidance_scale=GUIDANCE[family]),),
                   (ImageSpec("a lighthouse", "blurry", seed=3, guidance_scale=GUIDANCE[family], edit=edit),)):
        batch = Batch(images, width=32, height=32, steps=2, strength=0.5)
        on_ep = ours(batch, max_sequence_length=16).images
        on_cpu = _ours(onnx_dir)(batch, max_sequence_length=16).images
        assert np.abs(on_ep.astype(np.int16) - on_cpu).max() <= 1
