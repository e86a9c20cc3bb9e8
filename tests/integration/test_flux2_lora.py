"""LoRA on the FLUX.2 [klein] transformer, on real ONNX Runtime sessions of the tiny distilled model, against
diffusers' ``Flux2KleinPipeline.load_lora_weights`` + ``fuse_lora(lora_scale=s)`` on the same file
(src/diffusers/loaders/lora_pipeline.py ``Flux2LoraLoaderMixin``).

The factors are made by peft on every Linear of the transformer and saved the ways users have them:
diffusers/PEFT (``transformer.`` and diffusers' module names), ComfyUI/ai-toolkit (``diffusion_model.`` and the
original BFL names: ``double_blocks.N.img_attn.qkv`` fused, ``single_blocks.N.linear1``, ``img_in``...) and kohya
(``lora_unet_double_blocks_N_img_attn_qkv``, ``lora_down``/``lora_up``, an ``alpha``), the fused qkv split over
``to_q``/``to_k``/``to_v`` as diffusers' conversions split it (engines/lora/keys.py ``FLUX2_RULES``). The kohya file
leaves out the modulations, which diffusers' kohya conversion drops. The final layer's modulation in BFL names holds
(shift, scale) where diffusers' ``norm_out.linear`` holds (scale, shift): its file is checked against diffusers
loading the same product under the diffusers name. ORT runs the graphs with its CPU provider
(onnxruntime/core/providers/cpu: fp32 kernels).
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
SEEDS = [11, 12]
STEPS, GUIDANCE, SIZE = 3, 1.0, 64
ALPHA = 2.0
CASES = [("flux2_peft", 0.8), ("flux2_comfy", 1.5), ("flux2_kohya", 1.0), ("flux2_comfy_final", 1.0)]
REFERENCE = {"flux2_comfy_final": "flux2_peft_final"}
"""The file diffusers loads for a case, where it is not the case's own (diffusers maps the BFL final modulation
without swapping its halves)."""
DOUBLE = {"attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj", "ff.linear_in": "img_mlp.0",
          "ff.linear_out": "img_mlp.2", "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2"}
GLOBAL = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
          "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
          "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer"}
MODULATIONS = {"double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
               "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
               "single_stream_modulation.linear": "single_stream_modulation.lin"}

Builder = Callable[[str], tuple[Path, Path]]
Pairs = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _bfl(factors: dict[str, torch.Tensor], blocks: int, singles: int, modulations: bool) -> Pairs:
    """The PEFT factors under FLUX.2's original (BFL) module names: q, k and v fused into one qkv LoRA."""
    def pair(module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return factors[f"{module}.lora_A.weight"], factors[f"{module}.lora_B.weight"]

    out: Pairs = {}
    for i in range(blocks):
        block = f"transformer_blocks.{i}.attn"
        out[f"double_blocks.{i}.img_attn.qkv"] = lf.fused(factors, [f"{block}.to_q", f"{block}.to_k",
                                                                    f"{block}.to_v"])
        out[f"double_blocks.{i}.txt_attn.qkv"] = lf.fused(factors, [f"{block}.add_q_proj", f"{block}.add_k_proj",
                                                                    f"{block}.add_v_proj"])
        out.update({f"double_blocks.{i}.{bfl}": pair(f"transformer_blocks.{i}.{ours}") for ours, bfl in DOUBLE.items()})
    for i in range(singles):
        out[f"single_blocks.{i}.linear1"] = pair(f"single_transformer_blocks.{i}.attn.to_qkv_mlp_proj")
        out[f"single_blocks.{i}.linear2"] = pair(f"single_transformer_blocks.{i}.attn.to_out")
    out.update({bfl: pair(ours) for ours, bfl in {**GLOBAL, **(MODULATIONS if modulations else {})}.items()})
    return out


@pytest.fixture(scope="module")
def klein(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny FLUX.2 [klein] served with a LoRA folder holding the same factors in three conventions."""
    import diffusers

    onnx_dir, diffusers_dir = dit_build("flux2-klein")
    folder = tmp_path_factory.mktemp("flux2_loras")
    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, lf.FLUX2_TARGETS, 4, seed=5, scale=2.0)
    blocks, singles = transformer.config.num_layers, transformer.config.num_single_layers
    final = {k: v for k, v in factors.items() if k.startswith("norm_out.linear.")}
    lf.peft_file(folder / "flux2_peft.safetensors", {"transformer": factors})
    lf.peft_file(folder / "flux2_peft_final.safetensors", {"transformer": final})
    lf.renamed_file(folder / "flux2_comfy.safetensors", _bfl(factors, blocks, singles, modulations=True),
                    "diffusion_model.", flat=False, kohya_suffixes=False)
    lf.renamed_file(folder / "flux2_kohya.safetensors", _bfl(factors, blocks, singles, modulations=False),
                    "lora_unet_", flat=True, kohya_suffixes=True, alpha=ALPHA)
    down, up = final["norm_out.linear.lora_A.weight"], final["norm_out.linear.lora_B.weight"]
    shift_scale = torch.cat(up.chunk(2, dim=0)[::-1])  # BFL's row order: (shift, scale)
    lf.renamed_file(folder / "flux2_comfy_final.safetensors", {"final_layer.adaLN_modulation.1": (down, shift_scale)},
                    "diffusion_model.", flat=False, kohya_suffixes=False)
    settings = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                               lora=LoraSettings(dir=str(folder)))
    engine = OrtEngine(onnx_dir, settings)
    engine.load()
    try:
        yield {"engine": engine, "diffusers": diffusers_dir, "folder": folder, "blocks": blocks, "singles": singles,
               "base": _images(engine, _batch())}
    finally:
        engine.close()


def _batch(uses: tuple[LoraUse, ...] = (), guidance: float = GUIDANCE) -> Batch:
    return Batch(tuple(ImageSpec(p, "", seed=s, guidance_scale=guidance) for p, s in zip(PROMPTS, SEEDS,
                                                                                          strict=True)),
                 SIZE, SIZE, STEPS, loras=uses)


def _images(engine: OrtEngine, batch: Batch) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in engine.generate(batch).images])


def _use(engine: OrtEngine, name: str, multiplier: float) -> LoraUse:
    found = {f.name: f for f in engine.loras()}[name]
    assert not found.problem, found.problem
    return LoraUse(name, found.sha256, multiplier, multiplier)


def _diffusers_images(diffusers_dir: Path, lora: Path, multiplier: float, guidance: float = GUIDANCE) -> np.ndarray:
    import diffusers

    pipe = diffusers.Flux2KleinPipeline.from_pretrained(diffusers_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    pipe.fuse_lora(lora_scale=multiplier)
    noise = np.stack([image_rng(s).standard_normal((128, SIZE // 16, SIZE // 16), dtype=np.float32)
                      for s in SEEDS])
    with torch.no_grad():
        images = pipe(prompt=PROMPTS, guidance_scale=guidance, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                      latents=torch.from_numpy(noise), output_type="np").images
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
def test_transformer_lora_images_match_diffusers(klein: dict[str, Any], name: str, multiplier: float) -> None:
    engine = klein["engine"]
    result = engine.generate(_batch((_use(engine, name, multiplier),)))
    mine = np.stack([np.asarray(i.image) for i in result.images])
    assert result.adapted == ("transformer",)
    reference = klein["folder"] / f"{REFERENCE.get(name, name)}.safetensors"
    theirs = _diffusers_images(klein["diffusers"], reference, multiplier)
    _compare(mine, theirs, f"flux2-klein {name} x{multiplier}")
    assert _changed(mine, klein["base"]) > 0.05  # the LoRA moved the image: the base would fail the comparison


def test_the_conventions_resolve_to_the_same_weights(klein: dict[str, Any]) -> None:
    """Every Linear of the graph is adapted by the PEFT file, and by the ComfyUI file but the final modulation
    (in a file of its own), each of q, k, v by its third of the fused up factor; the kohya file adapts the same
    weights less the modulations."""
    manager = klein["engine"]._lora
    resolved = {n: {r.target.module: r.rows for r in manager.files[n].resolved} for n, _ in CASES}
    everything = set(manager.components["transformer"].targets)
    assert set(resolved["flux2_peft"]) == everything
    assert set(resolved["flux2_comfy"]) == everything - {"norm_out.linear"}
    assert set(resolved["flux2_kohya"]) == everything - {"norm_out.linear", *MODULATIONS}
    for i in range(klein["blocks"]):
        for part, proj in enumerate(("to_q", "to_k", "to_v")):
            assert resolved["flux2_comfy"][f"transformer_blocks.{i}.attn.{proj}"] == ((part, 3),)
            assert resolved["flux2_kohya"][f"transformer_blocks.{i}.attn.{proj}"] == ((part, 3),)
    assert resolved["flux2_comfy_final"]["norm_out.linear"] == ((1, 2), (0, 2))
    assert resolved["flux2_peft"]["norm_out.linear"] == ()
    assert set(manager.components) == {"transformer"}  # Qwen3 takes no LoRA: no targets, no variant


def test_a_file_with_text_encoder_keys_is_refused_by_name(klein: dict[str, Any]) -> None:
    """diffusers' Flux2LoraLoaderMixin loads only the transformer; a file that also adapts the Qwen3 text encoder
    (PEFT or kohya names) is listed refused, never served with its encoder part silently dropped."""
    from safetensors.torch import load_file

    engine, folder = klein["engine"], klein["folder"]
    base = load_file(str(folder / "flux2_peft.safetensors"))
    paths = [lf.save_safetensors(folder / "flux2_with_te.safetensors", {
        **base, "text_encoder.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 32), 0.1),
        "text_encoder.model.layers.0.self_attn.q_proj.lora_B.weight": torch.full((32, 4), 0.1)}),
        lf.save_safetensors(folder / "flux2_with_kohya_te.safetensors", {
            **load_file(str(folder / "flux2_kohya.safetensors")),
            "lora_te_layers_0_self_attn_q_proj.lora_down.weight": torch.full((4, 32), 0.1),
            "lora_te_layers_0_self_attn_q_proj.lora_up.weight": torch.full((32, 4), 0.1)})]
    try:
        listed = {f.name: f for f in engine.refresh_loras()}
        for name in ("flux2_with_te", "flux2_with_kohya_te"):
            assert "adapts text_encoder" in listed[name].problem
            assert "Flux2LoraLoaderMixin" in listed[name].problem and "Qwen3" in listed[name].problem
            assert not listed[name].components
        assert set(engine._lora.components) == {"transformer"}  # the refresh built no encoder variant
    finally:
        for path in paths:
            path.unlink()
        engine.refresh_loras()


def test_the_base_model_with_cfg_matches_diffusers(dit_build: Builder, tmp_path: Path) -> None:
    """flux2-klein-base (CFG with diffusers' empty negative prompt: the transformer runs on both halves with the
    merged weights) with a kohya file made from its own transformer."""
    import diffusers

    onnx_dir, diffusers_dir = dit_build("flux2-klein-base")
    transformer = diffusers.Flux2Transformer2DModel.from_pretrained(diffusers_dir / "transformer")
    factors = lf.lora_factors(transformer, lf.FLUX2_TARGETS, 4, seed=6, scale=2.0)
    path = lf.renamed_file(tmp_path / "base_kohya.safetensors", _bfl(factors, transformer.config.num_layers,
                                                                      transformer.config.num_single_layers, False),
                           "lora_unet_", flat=True, kohya_suffixes=True, alpha=ALPHA)
    engine = OrtEngine(onnx_dir, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                                                 lora=LoraSettings(dir=str(tmp_path))))
    engine.load()
    try:
        assert engine.info.family == "flux2-klein-base"
        base = _images(engine, _batch(guidance=4.0))
        result = engine.generate(_batch((_use(engine, "base_kohya", 1.2),), guidance=4.0))
    finally:
        engine.close()
    mine = np.stack([np.asarray(i.image) for i in result.images])
    assert result.adapted == ("transformer",)
    _compare(mine, _diffusers_images(diffusers_dir, path, 1.2, guidance=4.0), "flux2-klein-base kohya x1.2 cfg 4")
    assert _changed(mine, base) > 0.05
