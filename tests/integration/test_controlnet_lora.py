"""LoRA with ControlNet on the tiny SD 1.x (issue 56 item 6) against diffusers' StableDiffusionControlNetPipeline with
``load_lora_weights`` + ``fuse_lora``: the LoRA adapts the UNet and the text encoder, never the ControlNet. The
residual UNet (``unet_controlnet/``) runs on its own LoRA variant session with the plain UNet's merged tensors bound
by name (engines/lora/residual.py renames its targets to the UNet's initializer names), within 1/255 of diffusers;
the LoRA changes the controlled image; a request without units runs as before.

The merged weights are bound as overridable initializers through IO binding (onnxruntime/core/session/
inference_session.cc: an initializer listed as a graph input may be fed; onnxruntime/python/
onnxruntime_inference_collection.py IOBinding.bind_ortvalue_input), on ONNX Runtime's CPU execution provider."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engines.build.controlnet import export_controlled_unet, export_controlnet, make_tiny_controlnet
from engines.config import LoraSettings, RuntimeSettings
from engines.errors import InvalidRequestError, ModelLoadError
from engines.lora import residual
from engines.lora.active import Adapters
from engines.lora.manager import LoraManager
from engines.lora.targets import Target
from engines.pipelines import controlnet
from engines.pipelines.contract import image_rng
from engines.pipelines.ort_model import OrtModel
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec, LoraUse
from tests import lora_files as lf

PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [31, 32]
SIZE, STEPS, GUIDANCE, SCALE = 64, 6, 7.5, 0.8


@pytest.fixture(scope="module")
def built(tiny_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the tiny model with unet_controlnet/, a tiny ControlNet (ONNX and torch), and a LoRA folder with one
    random PEFT LoRA on the UNet and the text encoder."""
    import diffusers

    onnx_dir, diffusers_dir = tiny_build
    root = tmp_path_factory.mktemp("controlnet_lora")
    model = root / "model"
    shutil.copytree(onnx_dir, model)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(  # type: ignore[no-untyped-call]
        diffusers_dir, safety_checker=None)
    export_controlled_unet(pipe.unet.eval(), model)
    net = make_tiny_controlnet(0)
    export_controlnet(net, root / "edges", {"kind": "tiny", "seed": 0})
    net.save_pretrained(root / "edges_torch")
    loras = root / "loras"
    lf.peft_file(loras / "style.safetensors", {"unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, 1, 0.5),
                                               "text_encoder": lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 4,
                                                                               2, 0.5)})
    return {"model": model, "diffusers": diffusers_dir, "edges": root / "edges", "edges_torch": root / "edges_torch",
            "loras": loras}


def _pipeline(built: dict[str, Path], manager: LoraManager | None, control: bool) -> StableDiffusionOnnx:
    """A pipeline wired as the engine wires it: the plain components' LoRA variants, the ControlNets, and (what
    engines/engine.py _attach_variants does for a pipeline serving ControlNet) the residual UNet's variant."""
    runtime = manager.runtime if manager is not None else \
        Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    pipe = StableDiffusionOnnx(built["model"], runtime)
    if manager is not None:
        for model in pipe.adaptable():
            found = manager.components.get(model.component)
            model.variant = found.variant if found is not None else None  # type: ignore[assignment]
    if control:
        controls = controlnet.attach(pipe, built["model"], {"edges": built["edges"]})
        if manager is not None:
            controls.attach_lora(manager)
    return pipe


@pytest.fixture(scope="module")
def manager(built: dict[str, Path]) -> LoraManager:
    runtime = Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    family = StableDiffusionOnnx(built["model"], runtime).model_info("tiny").family
    return LoraManager(LoraSettings(dir=str(built["loras"])), built["model"], family, runtime, OrtModel)


@pytest.fixture(scope="module")
def ours(built: dict[str, Path], manager: LoraManager) -> StableDiffusionOnnx:
    return _pipeline(built, manager, control=True)


def _use(manager: LoraManager, te: float = SCALE, unet: float = SCALE) -> tuple[LoraUse, ...]:
    found = manager.files["style"]
    assert not found.problem, found.problem
    return (LoraUse("style", found.sha256, te, unet),)


def _control_image(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, size=(SIZE // 8, SIZE // 8, 3), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(np.repeat(cells, 8, axis=0), 8, axis=1))


def _latents() -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((4, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])


def _mine(pipe: StableDiffusionOnnx, manager: LoraManager | None, units: tuple[ControlUnit, ...],
          uses: tuple[LoraUse, ...] = ()) -> tuple[np.ndarray, set[str]]:
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  SIZE, SIZE, STEPS, "euler", loras=uses, control=units)
    adapters = Adapters(manager.weights(uses) if manager is not None and uses else {})
    out = pipe(batch, latents=_latents(), adapters=adapters)
    return np.asarray(out.images), adapters.adapted


@pytest.fixture(scope="module")
def theirs(built: dict[str, Path]) -> Any:
    """diffusers' StableDiffusionControlNetPipeline with the LoRA loaded and fused at SCALE."""
    import diffusers
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    net = ControlNetModel.from_pretrained(built["edges_torch"]).eval()  # type: ignore[no-untyped-call]
    pipe = StableDiffusionControlNetPipeline.from_pretrained(  # type: ignore[no-untyped-call]
        built["diffusers"], controlnet=net, safety_checker=None)
    config = json.loads((built["model"] / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(config)  # type: ignore[no-untyped-call]
    pipe.load_lora_weights(str(built["loras"]), weight_name="style.safetensors")
    pipe.fuse_lora(lora_scale=SCALE)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _theirs(pipe: Any, unit: ControlUnit) -> np.ndarray:
    with torch.no_grad():
        out = pipe(PROMPTS, image=Image.fromarray(unit.image), height=SIZE, width=SIZE, num_inference_steps=STEPS,
                   guidance_scale=GUIDANCE, latents=torch.from_numpy(_latents()), output_type="np",
                   controlnet_conditioning_scale=unit.weight, control_guidance_start=unit.guidance_start,
                   control_guidance_end=unit.guidance_end).images
    return np.asarray((out * 255).round().astype(np.uint8))


def _assert_close(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} pixels differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"


def _differs(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 1).mean())


@pytest.mark.parametrize(("start", "end"), [(0.0, 1.0), (0.2, 0.7)], ids=["every-step", "some-steps"])
def test_lora_with_controlnet_matches_diffusers_fuse_lora(ours: StableDiffusionOnnx, manager: LoraManager,
                                                          theirs: Any, start: float, end: float) -> None:
    """Every evaluation on the residual UNet's variant, or some on it and the rest on the plain UNet's variant:
    both with the same merged set."""
    unit = ControlUnit(_control_image(1), "edges", 1.1, start, end)
    mine, adapted = _mine(ours, manager, (unit,), _use(manager))
    assert adapted == {"unet", "text_encoder"}
    _assert_close(mine, _theirs(theirs, unit), f"LoRA + ControlNet {start}-{end}")
    # the LoRA has teeth on the controlled image, and the control on the LoRA image
    assert _differs(mine, _mine(ours, manager, (unit,))[0]) > 0.3
    assert _differs(mine, _mine(ours, manager, (), _use(manager))[0]) > (0.3 if end - start == 1.0 else 0.01)


def test_without_units_the_lora_path_is_unchanged(ours: StableDiffusionOnnx, manager: LoraManager,
                                                  built: dict[str, Path]) -> None:
    """A LoRA request without units on the pipeline serving ControlNet equals, bit for bit, the one on a pipeline
    serving none (the residual UNet never runs)."""
    plain = _pipeline(built, manager, control=False)
    mine, adapted = _mine(ours, manager, (), _use(manager))
    assert adapted == {"unet", "text_encoder"}
    assert np.array_equal(mine, _mine(plain, manager, (), _use(manager))[0])


def test_text_encoder_only_lora_needs_no_residual_variant(built: dict[str, Path], manager: LoraManager) -> None:
    """Without the residual UNet's variant, a LoRA on the UNet with a unit is refused by name; one on the text
    encoder alone (UNet multiplier 0) runs, recorded on the text encoder only."""
    pipe = _pipeline(built, manager, control=True)
    assert pipe.controls is not None and pipe.controls.unet.variant is not None
    pipe.controls.unet.variant = None
    unit = ControlUnit(_control_image(2), "edges", 1.0)
    with pytest.raises(InvalidRequestError, match="LoRA on the UNet") as raised:
        _mine(pipe, manager, (unit,), _use(manager))
    assert raised.value.param == "controlnet"
    image, adapted = _mine(pipe, manager, (unit,), _use(manager, te=SCALE, unet=0.0))
    assert adapted == {"text_encoder"}
    assert _differs(image, _mine(pipe, manager, (unit,))[0]) > 0.05


def test_a_graph_with_other_weights_is_refused() -> None:
    """The residual variant is built only for a graph whose adaptable modules and their weights' shapes are the
    UNet's; the renaming moves a name it takes from another tensor out of the way."""
    like = {"a": Target("a", "w_a", "transposed", (4, 4), np.float32)}
    with pytest.raises(ModelLoadError, match="differ"):
        residual.rename_map({"b": Target("b", "w_b", "transposed", (4, 4), np.float32)}, like, "g", "unet")
    with pytest.raises(ModelLoadError, match="not the same unet"):
        residual.rename_map({"a": Target("a", "w_x", "transposed", (4, 8), np.float32)}, like, "g", "unet")
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "mine"], ["w_a"]), helper.make_node("Relu", ["w_a"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(np.eye(4, dtype=np.float32), "mine")])
    out = residual.renamed_like(helper.make_model(graph), {"a": Target("a", "mine", "transposed", (4, 4),
                                                                     np.float32)}, like, "g", "unet")
    assert [i.name for i in out.graph.initializer] == ["w_a"]
    assert list(out.graph.node[0].input) == ["x", "w_a"] and out.graph.node[0].output[0] != "w_a"
    assert out.graph.node[1].input[0] == out.graph.node[0].output[0]
