"""An inpaint ControlNet unit (sd-webui-controlnet's inpaint_global_harmonious) on our ORT pipeline vs diffusers'
torch StableDiffusionControlNetPipeline given the hint tensor as diffusers' docs build it for
control_v11p_sd15_inpaint (``make_inpaint_condition``: the image in [0, 1], pixels with mask > 0.5 set to -1), on the
tiny model and the tiny ControlNet of tests/integration/test_controlnet_parity.py, same initial latents (issue 56).
The control image comes at another size than the output: the -1 is applied after the resize, so it survives.

The tiny ControlNet of engines/build/controlnet.py keeps diffusers' zero-initialised ``controlnet_cond_embedding.
conv_out``: its residuals do not depend on the control image at all. This test's ControlNet (``seen``) gives that
convolution random weights, so the hint, and the -1 where masked, reach the residuals.

The ONNX files run on ONNX Runtime's CPU execution provider; the residual inputs are bound through IO binding
(onnxruntime/python/onnxruntime_inference_collection.py IOBinding.bind_ortvalue_input)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engines.build.controlnet import export_controlnet, make_tiny_controlnet
from engines.config import RuntimeSettings
from engines.pipelines import controlnet
from engines.pipelines.controlnet import prepare_hint
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec
from tests.integration.test_controlnet_parity import (  # noqa: F401, F811  (built: that module's fixture)
    GUIDANCE,
    PROMPTS,
    SCHEDULERS,
    SIZE,
    STEPS,
    _assert_close,
    _control_image,
    _differs,
    _latents,
    _mine,
    built,
)

NET = "seen"


@pytest.fixture(scope="module")
def seen(built: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    """The tiny ControlNet with a random (not zero) conditioning embedding output: ONNX and torch weights."""
    root = tmp_path_factory.mktemp("inpaint_net")
    net = make_tiny_controlnet(11)
    generator = torch.Generator().manual_seed(12)
    embedding = net.controlnet_cond_embedding
    with torch.no_grad():  # residuals of about the size of the sample's path, the hint moving them by about half
        for conv in [m for m in embedding.modules() if isinstance(m, torch.nn.Conv2d)]:
            for param in conv.parameters():
                std = 1e-3 if conv is embedding.conv_out else 0.3
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    export_controlnet(net, root / NET, {"kind": "tiny", "seed": 11})
    net.save_pretrained(root / f"{NET}_torch")
    model = root / "model"
    shutil.copytree(built["model"], model)
    return {"model": model, NET: root / NET, "torch": root / f"{NET}_torch", "diffusers": built["diffusers"]}


@pytest.fixture(scope="module")
def ours(seen: dict[str, Path]) -> StableDiffusionOnnx:
    pipe = StableDiffusionOnnx(seen["model"], Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                       allow_cpu=True)))
    controlnet.attach(pipe, seen["model"], {NET: seen[NET]})
    return pipe


def _unit(masked: bool) -> ControlUnit:
    """A 48x40 picture (resized to the output by the pipeline) and its mask at the same size, the right part masked."""
    image = _control_image(7, 40, 48)
    mask = np.zeros((40, 48), bool)
    if masked:
        mask[:, 20:] = True
    return ControlUnit(image, NET, hint_mask=mask, inpaint="global")


def _hint(image: np.ndarray, mask: np.ndarray) -> torch.Tensor:
    """diffusers' make_inpaint_condition on the output-size image and mask: [1, 3, H, W], -1 where mask > 0.5."""
    pixels = np.asarray(Image.fromarray(image).resize((SIZE, SIZE), Image.Resampling.LANCZOS)).astype(np.float32)
    pixels = pixels / 255.0
    keep = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize((SIZE, SIZE), Image.Resampling.NEAREST))
    pixels[keep.astype(np.float32) / 255.0 > 0.5] = -1.0
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))[None])


def _theirs(paths: dict[str, Path], hint: torch.Tensor, latents: np.ndarray) -> np.ndarray:
    import diffusers
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    net = ControlNetModel.from_pretrained(paths["torch"]).eval()  # type: ignore[no-untyped-call]
    pipe = StableDiffusionControlNetPipeline.from_pretrained(  # type: ignore[no-untyped-call]
        paths["diffusers"], controlnet=net, safety_checker=None)
    config = json.loads((paths["model"] / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = getattr(diffusers, SCHEDULERS["euler"]).from_config(config)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(PROMPTS, image=hint, height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                   latents=torch.from_numpy(latents), output_type="np").images
    return np.asarray((out * 255).round().astype(np.uint8))


def test_inpaint_unit_matches_diffusers_given_the_hint(ours: StableDiffusionOnnx, seen: dict[str, Path]) -> None:
    unit = _unit(masked=True)
    assert unit.hint_mask is not None
    hint = _hint(unit.image, unit.hint_mask)
    ours_hint = prepare_hint(unit, Batch((ImageSpec("p"),), SIZE, SIZE, control=(unit,)))
    assert np.array_equal(ours_hint, hint[0].numpy())  # the same tensor, -1 where masked
    assert (ours_hint == -1).mean() > 0.4
    latents = _latents()
    mine = _mine(ours, "euler", (unit,), latents)
    theirs = _theirs(seen, hint, latents)
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    print(f"inpaint unit vs diffusers: max pixel difference {int(diff.max())}/255, "
          f"{float((diff > 1).mean()):.5f} over 1/255")
    _assert_close(mine, theirs, "inpaint unit")
    # The mask has teeth: the same unit without a masked pixel is a plain hint, and a different image.
    assert _differs(mine, _mine(ours, "euler", (_unit(masked=False),), latents)) > 0.05
