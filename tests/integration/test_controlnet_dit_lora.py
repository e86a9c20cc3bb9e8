"""LoRA with a FLUX.1 ControlNet on the tiny FLUX.1 dev (issue 56 item 6) against diffusers' FluxControlNetPipeline
with ``load_lora_weights`` + ``fuse_lora``: a FLUX.1 LoRA adapts the transformer, never the ControlNet
(src/diffusers/loaders/lora_pipeline.py FluxLoraLoaderMixin loads into the transformer and the CLIP encoder only).
The residual transformer (``transformer_controlnet/``) runs on its own LoRA variant session with the plain
transformer's merged tensors bound by name (engines/lora/residual.py renames its targets to the transformer's
initializer names), within 1/255 of diffusers; the LoRA changes the controlled image; a request without units runs as
before.

The merged weights are bound as overridable initializers through IO binding (onnxruntime/core/session/
inference_session.cc: an initializer listed as a graph input may be fed; onnxruntime/python/
onnxruntime_inference_collection.py IOBinding.bind_ortvalue_input), on ONNX Runtime's CPU execution provider. diffusers
samples the control image's VAE posterior; sdserve takes its mean, so the reference is asked for the mean too, as
tests/integration/test_controlnet_dit_parity.py does."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.build.controlnet_dit import export_controlled_flux, export_flux_controlnet, make_tiny_flux_controlnet
from engines.config import LoraSettings, RuntimeSettings
from engines.errors import InvalidRequestError
from engines.lora.active import Adapters
from engines.lora.manager import LoraManager
from engines.pipelines import controlnet_dit
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import load_pipeline, pack_latents
from engines.pipelines.ort_model import OrtModel
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec, LoraUse
from tests import lora_files as lf
from tests.integration.test_controlnet_lora import _control_image  # 64 px here too

PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [31, 32]
SIZE, STEPS, GUIDANCE, T5_LENGTH, SCALE = 64, 4, 3.5, 64, 0.8

Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def built(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the tiny FLUX.1 dev model with transformer_controlnet/, a tiny ControlNet (ONNX and torch), and a
    LoRA folder with one random PEFT LoRA on the transformer's attention and MLP Linears."""
    import diffusers

    onnx_dir, diffusers_dir = dit_build("flux")
    root = tmp_path_factory.mktemp("flux_controlnet_lora")
    model = root / "model"
    shutil.copytree(onnx_dir, model)
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(  # type: ignore[no-untyped-call]
        diffusers_dir / "transformer")
    export_controlled_flux(transformer.eval(), model)
    net = make_tiny_flux_controlnet(0)
    export_flux_controlnet(net, root / "edges", {"kind": "tiny", "seed": 0})
    net.save_pretrained(root / "edges_torch")
    loras = root / "loras"
    lf.peft_file(loras / "style.safetensors",
                 {"transformer": lf.lora_factors(transformer, lf.DIT_TARGETS, 4, seed=9, scale=0.5)})
    return {"model": model, "diffusers": diffusers_dir, "edges": root / "edges", "edges_torch": root / "edges_torch",
            "loras": loras}


@pytest.fixture(scope="module")
def manager(built: dict[str, Path]) -> LoraManager:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    family = load_pipeline(built["model"], runtime).model_info("tiny").family
    return LoraManager(LoraSettings(dir=str(built["loras"])), built["model"], family, runtime, OrtModel)


def _pipeline(built: dict[str, Path], manager: LoraManager, control: bool) -> Any:
    """A pipeline wired as the engine wires it (engines/engine.py: ControlNets attached, then the LoRA variants
    and, in _attach_variants, the residual transformer's)."""
    pipe = load_pipeline(built["model"], manager.runtime)
    if control:
        controlnet_dit.attach(pipe, built["model"], {"edges": built["edges"]})
    for model in pipe.adaptable():
        found = manager.components.get(model.component)
        model.variant = found.variant if found is not None else None
    if control:
        pipe.controls.attach_lora(manager)
    return pipe


@pytest.fixture(scope="module")
def ours(built: dict[str, Path], manager: LoraManager) -> Any:
    return _pipeline(built, manager, control=True)


def _use(manager: LoraManager, scale: float = SCALE) -> tuple[LoraUse, ...]:
    found = manager.files["style"]
    assert not found.problem, found.problem
    assert set(found.components) == {"transformer"}
    return (LoraUse("style", found.sha256, scale, scale),)


def _noise() -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])


def _mine(pipe: Any, manager: LoraManager, units: tuple[ControlUnit, ...],
          uses: tuple[LoraUse, ...] = ()) -> tuple[np.ndarray, set[str]]:
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  SIZE, SIZE, STEPS, loras=uses, control=units)
    adapters = Adapters(manager.weights(uses) if uses else {})
    out = pipe(batch, latents=_noise(), max_sequence_length=T5_LENGTH, adapters=adapters)
    return np.asarray(out.images), adapters.adapted


@pytest.fixture(scope="module")
def theirs(built: dict[str, Path]) -> Any:
    """diffusers' FluxControlNetPipeline with the LoRA loaded and fused at SCALE."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    net = FluxControlNetModel.from_pretrained(built["edges_torch"]).eval()  # type: ignore[no-untyped-call]
    pipe = FluxControlNetPipeline.from_pretrained(built["diffusers"], controlnet=net)  # type: ignore[no-untyped-call]
    pipe.load_lora_weights(str(built["loras"]), weight_name="style.safetensors")
    pipe.fuse_lora(lora_scale=SCALE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _theirs(pipe: Any, unit: ControlUnit, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    from diffusers.pipelines.flux import pipeline_flux_controlnet as module

    given = module.retrieve_latents
    monkeypatch.setattr(module, "retrieve_latents",
                        lambda out, generator=None, sample_mode="sample": given(out, generator, "argmax"))
    with torch.no_grad():
        out = pipe(PROMPTS, control_image=Image.fromarray(unit.image), height=SIZE, width=SIZE,
                   num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=T5_LENGTH,
                   latents=torch.from_numpy(pack_latents(_noise())), output_type="np",
                   controlnet_conditioning_scale=unit.weight, control_guidance_start=unit.guidance_start,
                   control_guidance_end=unit.guidance_end).images
    return np.asarray((out * 255).round().astype(np.uint8))


def _assert_close(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    print(f"\n{what}: max |diff| {diff.max()}/255, {(diff > 1).sum()} values over 1/255")
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} values differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"


def _differs(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 1).mean())


@pytest.mark.parametrize(("start", "end"), [(0.0, 1.0), (0.25, 0.75)], ids=["every-step", "some-steps"])
def test_lora_with_flux_controlnet_matches_diffusers_fuse_lora(ours: Any, manager: LoraManager, theirs: Any,
                                                               monkeypatch: pytest.MonkeyPatch, start: float,
                                                               end: float) -> None:
    """Every evaluation on the residual transformer's variant, or some on it and the rest on the plain
    transformer's variant: both with the same merged set, recorded as the transformer's."""
    unit = ControlUnit(_control_image(1), "edges", 1.1, start, end)
    mine, adapted = _mine(ours, manager, (unit,), _use(manager))
    assert adapted == {"transformer"}
    _assert_close(mine, _theirs(theirs, unit, monkeypatch), f"LoRA + FLUX.1 ControlNet {start}-{end}")
    # the LoRA has teeth on the controlled image, and the control on the LoRA image
    assert _differs(mine, _mine(ours, manager, (unit,))[0]) > 0.1
    assert _differs(mine, _mine(ours, manager, (), _use(manager))[0]) > 0.1


def test_one_merged_set_serves_both_transformers(ours: Any, manager: LoraManager) -> None:
    """The residual transformer's variant binds the plain transformer's merged tensors by their names: the set holds
    one tensor per adapted weight, under the transformer's component only, none for ``transformer_controlnet``."""
    weights = manager.weights(_use(manager))
    assert set(weights) == {"transformer"}
    variant = ours.controls.transformer.variant
    assert variant is not None and variant is not ours.transformer.variant
    # overridable initializers (onnxruntime/python/onnxruntime_inference_collection.py
    # Session.get_overridable_initializers): the residual graph's own weight names were renamed to the transformer's
    names = {i.name for i in variant.session.get_overridable_initializers()}
    plain = {i.name for i in ours.transformer.variant.session.get_overridable_initializers()}
    assert set(weights["transformer"]) <= names and names == plain


def test_without_units_the_lora_path_is_unchanged(ours: Any, manager: LoraManager, built: dict[str, Path]) -> None:
    """A LoRA request without units on the pipeline serving ControlNet equals, bit for bit, the one on a pipeline
    serving none (the residual transformer never runs)."""
    plain = _pipeline(built, manager, control=False)
    mine, adapted = _mine(ours, manager, (), _use(manager))
    assert adapted == {"transformer"}
    assert np.array_equal(mine, _mine(plain, manager, (), _use(manager))[0])


def test_without_the_residual_variant_a_transformer_lora_is_refused(built: dict[str, Path],
                                                                    manager: LoraManager) -> None:
    """A server whose residual transformer has no LoRA variant refuses a unit with a transformer LoRA by name, never
    runs the controlled steps on the base weights; multiplier 0 (no transformer weights) runs."""
    pipe = _pipeline(built, manager, control=True)
    assert pipe.controls.transformer.variant is not None
    pipe.controls.transformer.variant = None
    unit = ControlUnit(_control_image(2), "edges", 1.0)
    with pytest.raises(InvalidRequestError, match="LoRA on the transformer") as raised:
        _mine(pipe, manager, (unit,), _use(manager))
    assert raised.value.param == "controlnet"
    image, adapted = _mine(pipe, manager, (unit,), _use(manager, 0.0))
    assert adapted == set()
    assert np.array_equal(image, _mine(pipe, manager, (unit,))[0])
