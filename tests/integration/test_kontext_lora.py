"""LoRA on FLUX.1 Kontext [dev] instruction edits (issue 55, item 4): a Flux.1 LoRA file (diffusers/PEFT names on
every Linear of the transformer, and one with CLIP text-encoder keys too) served on the tiny Kontext model's edits,
against diffusers' ``FluxKontextPipeline.load_lora_weights`` + ``fuse_lora(lora_scale=s)`` on the same file and the
same initial noise (src/diffusers/loaders/lora_pipeline.py ``FluxLoraLoaderMixin``: the transformer and the CLIP
encoder; ``fuse_lora`` fuses the transformer unless told, so the encoder file names its components). The reference
image goes through the VAE encoder and joins the sequence as in tests/integration/test_kontext_parity.py; ORT runs
the graphs with its CPU provider (onnxruntime/core/providers/cpu: fp32 kernels). Kontext's preferred-resolution
table is narrowed to small entries in both pipelines alike (ours and diffusers' module tables), so a reference is
a few dozen tokens and the comparisons run in seconds; the full table is the parity tests'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import pack_latents
from engines.types.request import Batch, EditImage, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = pytest.mark.slow
PROMPTS = ["make the sky purple", "add a red hat"]
SEEDS = [31, 32]
STEPS, GUIDANCE, WIDTH, HEIGHT = 3, 3.5, 64, 48
CLIP_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
SMALL = [(96, 64), (64, 64), (64, 96)]


@pytest.fixture(autouse=True)
def small_references(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers.pipelines.flux import pipeline_flux_kontext

    from engines.pipelines import kontext

    monkeypatch.setattr(kontext, "PREFERRED_KONTEXT_RESOLUTIONS", tuple(SMALL))
    monkeypatch.setattr(pipeline_flux_kontext, "PREFERRED_KONTEXT_RESOLUTIONS", SMALL)


@pytest.fixture(scope="module")
def kontext(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny Kontext served with a LoRA folder; the diffusers folder on the same weights."""
    import diffusers

    from engines.build.kontext import build_tiny_kontext

    root = tmp_path_factory.mktemp("kontext_lora")
    build_tiny_kontext(root / "onnx", diffusers_out=root / "diffusers")
    pipe = diffusers.FluxKontextPipeline.from_pretrained(root / "diffusers")
    folder = root / "loras"
    folder.mkdir()
    transformer = lf.lora_factors(pipe.transformer, lf.DIT_TARGETS, 4, seed=9, scale=0.5)
    clip = lf.lora_factors(pipe.text_encoder, CLIP_TARGETS, 4, seed=10, scale=0.5)
    lf.peft_file(folder / "kontext_style.safetensors", {"transformer": transformer})
    lf.peft_file(folder / "kontext_both.safetensors", {"transformer": transformer, "text_encoder": clip})
    engine = OrtEngine(root / "onnx", RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                                      lora=LoraSettings(dir=str(folder))))
    engine.load()
    try:
        yield {"engine": engine, "diffusers": root / "diffusers", "folder": folder}
    finally:
        engine.close()


def _reference() -> np.ndarray:
    y, x = np.mgrid[0:48, 0:72].astype(np.float32)
    image = np.stack([127 + 120 * np.sin(x / 7.0), 127 + 120 * np.cos(y / 5.0), (x + y) % 256], axis=-1)
    return np.ascontiguousarray(image.clip(0, 255).astype(np.uint8))


def _batch(uses: tuple[LoraUse, ...] = ()) -> Batch:
    ref = _reference()
    edit = EditImage(np.asarray(Image.fromarray(ref).resize((WIDTH, HEIGHT))), references=(ref,))
    return Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, edit=edit) for p, s in zip(PROMPTS, SEEDS,
                                                                                                strict=True)),
                 WIDTH, HEIGHT, STEPS, loras=uses)


def _use(engine: OrtEngine, name: str, multiplier: float) -> LoraUse:
    found = {f.name: f for f in engine.loras()}[name]
    assert not found.problem, found.problem
    return LoraUse(name, found.sha256, multiplier, multiplier)


def _theirs(diffusers_dir: Path, lora: Path, multiplier: float, components: list[str]) -> np.ndarray:
    import diffusers

    pipe = diffusers.FluxKontextPipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.fuse_lora(components=components, lora_scale=multiplier)
    noise = np.stack([image_rng(s).standard_normal((16, HEIGHT // 8, WIDTH // 8), dtype=np.float32) for s in SEEDS])
    with torch.no_grad():
        images = pipe(image=Image.fromarray(_reference()), prompt=PROMPTS, height=HEIGHT, width=WIDTH,
                      max_area=WIDTH * HEIGHT, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                      latents=torch.from_numpy(pack_latents(noise)), output_type="np").images
    return np.asarray((images * 255).round().astype(np.uint8))


@pytest.mark.parametrize(("name", "multiplier", "components"),
                         [("kontext_style", 0.8, ["transformer"]),
                          ("kontext_both", 1.2, ["transformer", "text_encoder"])])
def test_a_flux_lora_on_kontext_edits_matches_diffusers(kontext: dict[str, Any], name: str, multiplier: float,
                                                        components: list[str]) -> None:
    engine = kontext["engine"]
    result = engine.generate(_batch((_use(engine, name, multiplier),)))
    assert result.adapted == tuple(sorted(components)), result.adapted
    mine = np.stack([np.asarray(i.image) for i in result.images])
    theirs = _theirs(kontext["diffusers"], kontext["folder"] / f"{name}.safetensors", multiplier, components)
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    base = np.stack([np.asarray(i.image) for i in engine.generate(_batch()).images])
    moved = float((np.abs(mine.astype(np.int16) - base.astype(np.int16)) > 2).mean())
    print(f"\nkontext LoRA {name} x{multiplier}: {(diff <= 1).mean():.6f} within 1/255, max |diff| {diff.max()}/255; "
          f"{moved:.3f} of the values moved by the LoRA")
    assert mine.shape == theirs.shape == (2, HEIGHT, WIDTH, 3)
    assert (diff <= 1).mean() >= 0.999 and diff.max() <= 3
    assert theirs.std() > 10 and moved > 0.05  # the LoRA moved the image: the base would fail the comparison



def test_a_t5_lora_is_refused_by_name_as_diffusers_loads_none(kontext: dict[str, Any]) -> None:
    """diffusers' FluxLoraLoaderMixin loads the transformer and the CLIP encoder (``text_encoder.`` keys) only: a
    file adapting T5 (``text_encoder_2.``, T5's module names) leaves its pipeline's T5 untouched, so the server
    lists it refused (engines/lora/library.py ``T5_LORA``), naming the component and the loader, rather than serve
    an image diffusers would not make."""
    import diffusers

    pipe = diffusers.FluxKontextPipeline.from_pretrained(kontext["diffusers"])
    t5 = lf.lora_factors(pipe.text_encoder_2, ["q", "k", "v", "o"], 4, seed=11, scale=0.5)
    transformer = lf.lora_factors(pipe.transformer, lf.DIT_TARGETS, 4, seed=9, scale=0.5)
    path = lf.peft_file(kontext["folder"] / "kontext_t5.safetensors", {"transformer": transformer,
                                                                      "text_encoder_2": t5})
    before = {k: v.clone() for k, v in pipe.text_encoder_2.state_dict().items()}
    pipe.load_lora_weights(str(path.parent), weight_name=path.name)
    assert pipe._lora_loadable_modules == ["transformer", "text_encoder"]  # no T5 among them
    pipe.fuse_lora(components=["transformer", "text_encoder"], lora_scale=1.0)
    after = pipe.text_encoder_2.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # diffusers left T5 as it was
    listed = {f.name: f for f in kontext["engine"].refresh_loras()}
    try:
        problem = listed["kontext_t5"].problem
        assert "adapts text_encoder_2, a T5 text encoder" in problem and "FluxLoraLoaderMixin" in problem, problem
        assert not listed["kontext_t5"].components and not listed["kontext_style"].problem
    finally:
        path.unlink()
        kontext["engine"].refresh_loras()
