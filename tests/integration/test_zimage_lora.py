"""LoRA on the Z-Image transformer, on real ONNX Runtime sessions of the tiny Turbo model, against diffusers'
``ZImagePipeline.load_lora_weights`` + ``fuse_lora(lora_scale=s)`` on the same file
(src/diffusers/loaders/lora_pipeline.py ``ZImageLoraLoaderMixin``).

The factors are made by peft on every Linear of the transformer (refiners, main layers, embedders, final layer)
and saved the ways users have them: diffusers/PEFT (``transformer.``), ComfyUI/ai-toolkit (``diffusion_model.``,
``lora_A``/``lora_B``, an ``alpha``), kohya (``lora_unet_``, ``lora_down``/``lora_up``, an ``alpha``) and the
kohya-style trainers' original layout (fused ``attention_qkv`` and bare ``attention_out``, ``lora.down``/
``lora.up``), which diffusers' ``_convert_non_diffusers_z_image_lora_to_diffusers`` splits over ``to_q``/``to_k``/
``to_v`` and renames ``to_out.0`` as engines/lora/keys.py ``ZIMAGE_RULES`` does. The exported graph scopes the
``all_x_embedder``/``all_final_layer`` ModuleDict children by their key alone: those modules must still resolve.
ORT runs the graphs with its CPU provider (onnxruntime/core/providers/cpu: fp32 kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.pipelines.contract import image_rng
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [11, 12]
STEPS, SIZE = 3, 64
ALPHA = 2.0
CASES = [("zimage_peft", 0.8, 0.0), ("zimage_comfy", 1.5, 0.0), ("zimage_kohya", 1.0, 4.0),
         ("zimage_fused", 1.0, 0.0)]
"""(file, multiplier, guidance scale): Turbo-style without CFG, and one with CFG and negative prompts."""

Builder = Callable[[str], tuple[Path, Path]]


def _attention_blocks(transformer: Any) -> list[str]:
    return [name.removesuffix(".attention") for name, _ in transformer.named_modules() if name.endswith(".attention")]


@pytest.fixture(scope="module")
def zimage(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny Z-Image-Turbo served with a LoRA folder holding the same factors in four conventions."""
    import diffusers

    onnx_dir, diffusers_dir = dit_build("z-image-turbo")
    folder = tmp_path_factory.mktemp("zimage_loras")
    transformer = diffusers.ZImageTransformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, lf.ZIMAGE_TARGETS, 4, seed=5, scale=2.0)
    pairs = {key.removesuffix(".lora_A.weight"): (value, factors[key.replace(".lora_A.", ".lora_B.")])
             for key, value in factors.items() if key.endswith(".lora_A.weight")}
    blocks = _attention_blocks(transformer)
    fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for block in blocks:
        fused[f"{block}.attention.qkv"] = lf.fused(factors, [f"{block}.attention.to_{p}" for p in "qkv"])
        fused[f"{block}.attention.out"] = pairs[f"{block}.attention.to_out.0"]
    lf.peft_file(folder / "zimage_peft.safetensors", {"transformer": factors})
    lf.renamed_file(folder / "zimage_comfy.safetensors", pairs, "diffusion_model.", flat=False, kohya_suffixes=False,
                    alpha=ALPHA)
    lf.renamed_file(folder / "zimage_kohya.safetensors", pairs, "lora_unet_", flat=True, kohya_suffixes=True,
                    alpha=ALPHA)
    lf.renamed_file(folder / "zimage_fused.safetensors", fused, "lora_unet_", flat=True, kohya_suffixes=True,
                    alpha=ALPHA, dots=True)
    settings = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                               lora=LoraSettings(dir=str(folder)))
    engine = OrtEngine(onnx_dir, settings)
    engine.load()
    try:
        yield {"engine": engine, "diffusers": diffusers_dir, "folder": folder, "blocks": blocks,
               "modules": set(pairs), "base": {cfg: _images(engine, _batch(cfg)) for cfg in {c for _, _, c in CASES}}}
    finally:
        engine.close()


def _batch(cfg: float, uses: tuple[LoraUse, ...] = ()) -> Batch:
    return Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=cfg) for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS,
                                                                                        strict=True)),
                 SIZE, SIZE, STEPS, loras=uses)


def _images(engine: OrtEngine, batch: Batch) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in engine.generate(batch).images])


def _use(engine: OrtEngine, name: str, multiplier: float) -> LoraUse:
    found = {f.name: f for f in engine.loras()}[name]
    assert not found.problem, found.problem
    return LoraUse(name, found.sha256, multiplier, multiplier)


def _diffusers_images(diffusers_dir: Path, lora: Path, multiplier: float, cfg: float) -> np.ndarray:
    import diffusers

    pipe = diffusers.ZImagePipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.fuse_lora(lora_scale=multiplier)
    noise = np.stack([image_rng(s).standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])
    with torch.no_grad():
        images = pipe(PROMPTS, negative_prompt=NEGATIVES if cfg > 0 else None, guidance_scale=cfg, height=SIZE,
                      width=SIZE, num_inference_steps=STEPS, latents=torch.from_numpy(noise),
                      output_type="np").images
    return np.asarray((images * 255).round().astype(np.uint8))


def _compare(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} values differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"
    assert theirs.std() > 10  # a real pattern, not a flat image any pipeline would match


def _changed(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 2).mean())


@pytest.mark.parametrize(("name", "multiplier", "cfg"), CASES, ids=[n for n, _, _ in CASES])
def test_transformer_lora_images_match_diffusers(zimage: dict[str, Any], name: str, multiplier: float,
                                                 cfg: float) -> None:
    engine = zimage["engine"]
    result = engine.generate(_batch(cfg, (_use(engine, name, multiplier),)))
    mine = np.stack([np.asarray(i.image) for i in result.images])
    assert result.adapted == ("transformer",)
    theirs = _diffusers_images(zimage["diffusers"], zimage["folder"] / f"{name}.safetensors", multiplier, cfg)
    _compare(mine, theirs, f"z-image {name} x{multiplier} guidance {cfg}")
    assert _changed(mine, zimage["base"][cfg]) > 0.05  # the LoRA moved the image: the base would fail the comparison


def test_the_conventions_resolve_to_the_same_weights(zimage: dict[str, Any]) -> None:
    """Every Linear of the graph is adapted by the PEFT, ComfyUI and kohya files (the ModuleDict children under the
    graph's short scopes); the fused file adapts each attention's q, k, v by its third of the up factor, and its
    output projection."""
    manager = zimage["engine"]._lora
    resolved = {n: {r.target.module: r.rows for r in manager.files[n].resolved} for n, _, _ in CASES}
    everything = set(manager.components["transformer"].targets)
    assert len(everything) == len(zimage["modules"])
    assert set(resolved["zimage_peft"]) == set(resolved["zimage_comfy"]) == set(resolved["zimage_kohya"]) == everything
    assert {"2-1", "2-1.linear", "2-1.adaLN_modulation.1"} <= everything  # all_x_embedder / all_final_layer
    expected = {f"{b}.attention.{p}": ((i, 3),) for b in zimage["blocks"] for i, p in enumerate(("to_q", "to_k",
                                                                                                   "to_v"))}
    expected |= {f"{b}.attention.to_out.0": () for b in zimage["blocks"]}
    assert resolved["zimage_fused"] == expected
    assert set(manager.components) == {"transformer"}  # Qwen3 takes no LoRA: no targets, no variant


def test_a_file_with_text_encoder_keys_is_refused_by_name(zimage: dict[str, Any]) -> None:
    """diffusers' ZImageLoraLoaderMixin loads only the transformer; a file that also adapts the Qwen3 text encoder
    is listed refused, never served with its encoder part silently dropped while the manifest names the file."""
    from safetensors.torch import load_file

    engine, folder = zimage["engine"], zimage["folder"]
    path = lf.save_safetensors(folder / "zimage_with_te.safetensors", {
        **load_file(str(folder / "zimage_peft.safetensors")),
        "text_encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 32), 0.1),
        "text_encoder.layers.0.self_attn.q_proj.lora_B.weight": torch.full((32, 4), 0.1)})
    try:
        listed = {f.name: f for f in engine.refresh_loras()}["zimage_with_te"]
        assert "adapts text_encoder" in listed.problem
        assert "ZImageLoraLoaderMixin" in listed.problem and "Qwen3" in listed.problem
        assert not listed.components
        assert set(engine._lora.components) == {"transformer"}  # the refresh built no encoder variant
    finally:
        path.unlink()
        engine.refresh_loras()
