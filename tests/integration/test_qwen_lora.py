"""LoRA on the Qwen-Image transformer, on real ONNX Runtime sessions of the tiny model, against diffusers'
``QwenImagePipeline.load_lora_weights`` + ``fuse_lora(lora_scale=s)`` on the same file.

The factors are made by peft on every Linear of the joint blocks (attention, both MLPs, both modulations), so the
file also adapts the last block's text stream, which the exported graph prunes (its output is never read): those
modules must be accepted, change nothing, and the image still match diffusers within 1/255. The same factors are
saved three ways users have them: diffusers/PEFT (``transformer.`` prefix), ComfyUI/musubi-tuner
(``diffusion_model.`` prefix, ``lora_down``/``lora_up``, an ``alpha``) and kohya (``lora_unet_``), at two
multipliers. A file that also adapts the Qwen2.5-VL text encoder is refused by name (diffusers loads no LoRA there).
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
from engines.pipelines.flow import pack_latents
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting, a long shadow"]
NEGATIVES = ["blurry", "low quality, watermark"]
SEEDS = [11, 12]
STEPS, CFG, SIZE = 4, 4.0, 64
PRUNED = ("attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
"""The last block's text-stream modules: in diffusers' model, absent from the exported graph."""
ALPHA = 2.0
CASES = [("qwen_peft", 0.8), ("qwen_comfy", 1.5), ("qwen_kohya", 1.0)]

Builder = Callable[[str], tuple[Path, Path]]


def _renamed(factors: dict[str, torch.Tensor], prefix: str, flat: bool) -> dict[str, torch.Tensor]:
    """PEFT-named factors under another convention: ``prefix`` + the module path (kohya: '.' -> '_'),
    ``lora_down``/``lora_up`` and an ``alpha`` per module."""
    out: dict[str, torch.Tensor] = {}
    for key, value in factors.items():
        module, _, kind = key.rpartition(".lora_")
        name = prefix + (module.replace(".", "_") if flat else module)
        out[f"{name}.{ {'A.weight': 'lora_down.weight', 'B.weight': 'lora_up.weight'}[kind]}"] = value
        out[f"{name}.alpha"] = torch.tensor(ALPHA)
    return out


@pytest.fixture(scope="module")
def qwen(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny Qwen-Image model served with a LoRA folder holding the same factors in three conventions."""
    import diffusers

    onnx_dir, diffusers_dir = dit_build("qwen-image")
    folder = tmp_path_factory.mktemp("qwen_loras")
    transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, lf.QWEN_TARGETS, 4, seed=5, scale=3.0)
    last = transformer.config.num_layers - 1
    assert all(any(k.startswith(f"transformer_blocks.{last}.{m}.") for k in factors) for m in PRUNED)
    lf.peft_file(folder / "qwen_peft.safetensors", {"transformer": factors})
    lf.save_safetensors(folder / "qwen_comfy.safetensors", _renamed(factors, "diffusion_model.", flat=False))
    lf.save_safetensors(folder / "qwen_kohya.safetensors", _renamed(factors, "lora_unet_", flat=True))
    settings = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                               lora=LoraSettings(dir=str(folder)))
    engine = OrtEngine(onnx_dir, settings)
    engine.load()
    try:
        yield {"engine": engine, "diffusers": diffusers_dir, "folder": folder, "last": last,
               "base": _images(engine, _batch())}
    finally:
        engine.close()


def _batch(uses: tuple[LoraUse, ...] = ()) -> Batch:
    return Batch(tuple(ImageSpec(p, n, seed=s, guidance_scale=CFG) for p, n, s in zip(PROMPTS, NEGATIVES, SEEDS,
                                                                                        strict=True)),
                 SIZE, SIZE, STEPS, loras=uses)


def _images(engine: OrtEngine, batch: Batch) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in engine.generate(batch).images])


def _use(engine: OrtEngine, name: str, multiplier: float) -> LoraUse:
    found = {f.name: f for f in engine.loras()}[name]
    assert not found.problem, found.problem
    return LoraUse(name, found.sha256, multiplier, multiplier)


def _diffusers_images(diffusers_dir: Path, lora: Path, multiplier: float) -> np.ndarray:
    import diffusers

    pipe = diffusers.QwenImagePipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.fuse_lora(lora_scale=multiplier)
    noise = np.stack([image_rng(s).standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])
    with torch.no_grad():
        images = pipe(PROMPTS, negative_prompt=NEGATIVES, true_cfg_scale=CFG, height=SIZE, width=SIZE,
                      num_inference_steps=STEPS, latents=torch.from_numpy(pack_latents(noise)),
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


@pytest.mark.parametrize(("name", "multiplier"), CASES, ids=[n for n, _ in CASES])
def test_transformer_lora_images_match_diffusers(qwen: dict[str, Any], name: str, multiplier: float) -> None:
    engine = qwen["engine"]
    result = engine.generate(_batch((_use(engine, name, multiplier),)))
    mine = np.stack([np.asarray(i.image) for i in result.images])
    assert result.adapted == ("transformer",)
    theirs = _diffusers_images(qwen["diffusers"], qwen["folder"] / f"{name}.safetensors", multiplier)
    _compare(mine, theirs, f"qwen-image {name} x{multiplier}")
    assert _changed(mine, qwen["base"]) > 0.1  # the LoRA moved the image: the base would fail the comparison


def test_every_module_but_the_pruned_text_stream_is_merged(qwen: dict[str, Any]) -> None:
    """The three conventions resolve to the same weights (Sequential children named as diffusers names them:
    ``img_mod.1``); the last block's pruned modules are accepted, not merged, and nothing else is left out."""
    manager = qwen["engine"]._lora
    merged = {n: {r.target.module for r in manager.files[n].resolved} for n, _ in CASES}
    assert merged["qwen_peft"] == merged["qwen_comfy"] == merged["qwen_kohya"]
    last = qwen["last"]
    expected = {f"transformer_blocks.{b}.{m}" for b in range(last + 1)
                for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                          "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                          "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1", "txt_mod.1")}
    assert merged["qwen_peft"] == expected - {f"transformer_blocks.{last}.{m}" for m in PRUNED}
    assert set(manager.components) == {"transformer"}  # Qwen2.5-VL takes no LoRA: no targets, no variant


def test_a_file_with_text_encoder_keys_is_refused_by_name(qwen: dict[str, Any], tmp_path: Path) -> None:
    """diffusers' QwenImageLoraLoaderMixin loads only the transformer; a file that also adapts the text encoder
    is listed refused, never served with its encoder part silently dropped while the manifest names the file."""
    from safetensors.torch import load_file

    engine, folder = qwen["engine"], qwen["folder"]
    path = lf.save_safetensors(folder / "qwen_with_te.safetensors", {
        **load_file(str(folder / "qwen_peft.safetensors")),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 32), 0.1),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((32, 4), 0.1)})
    try:
        listed = {f.name: f for f in engine.refresh_loras()}["qwen_with_te"]
        assert "adapts text_encoder" in listed.problem and "QwenImageLoraLoaderMixin" in listed.problem
        assert not listed.components
        assert set(engine._lora.components) == {"transformer"}  # the refresh built no encoder variant
    finally:
        path.unlink()
        engine.refresh_loras()
