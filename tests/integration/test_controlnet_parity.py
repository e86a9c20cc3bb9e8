"""ControlNet on our ORT pipeline vs diffusers' torch StableDiffusionControlNetPipeline on the same weights and
initial latents (issue 56): one unit, two units (MultiControlNetModel: residuals summed), guidance_start/end and
the conditioning scale, a control image resized to the output size; weight 0 gives the image without control.

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

from engines.build.controlnet import export_controlled_unet, export_controlnet, make_tiny_controlnet
from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines import controlnet
from engines.pipelines.contract import Begun, image_rng
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec

PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [21, 22]
SIZE, STEPS, GUIDANCE = 64, 8, 7.5
SCHEDULERS = {"euler": "EulerDiscreteScheduler", "plms": "PNDMScheduler"}


@pytest.fixture(scope="module")
def built(tiny_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the tiny model with unet_controlnet/, two tiny ControlNets (ONNX and torch weights)."""
    from diffusers import UNet2DConditionModel

    onnx_dir, diffusers_dir = tiny_build
    root = tmp_path_factory.mktemp("controlnet")
    model = root / "model"
    shutil.copytree(onnx_dir, model)
    unet = UNet2DConditionModel.from_pretrained(diffusers_dir / "unet")  # type: ignore[no-untyped-call]
    export_controlled_unet(unet.eval(), model)
    paths = {"model": model, "diffusers": diffusers_dir}
    for name, seed in (("edges", 0), ("depth", 5)):
        net = make_tiny_controlnet(seed)
        export_controlnet(net, root / name, {"kind": "tiny", "seed": seed})
        net.save_pretrained(root / f"{name}_torch")
        paths[name], paths[f"{name}_torch"] = root / name, root / f"{name}_torch"
    return paths


@pytest.fixture(scope="module")
def ours(built: dict[str, Path]) -> StableDiffusionOnnx:
    pipe = StableDiffusionOnnx(built["model"], Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                        allow_cpu=True)))
    controlnet.attach(pipe, built["model"], {"edges": built["edges"], "depth": built["depth"]})
    return pipe


def _control_image(seed: int, height: int, width: int) -> np.ndarray:
    """A blocky pattern, as an edge or depth map is: large areas, sharp borders."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(np.repeat(cells, 8, axis=0), 8, axis=1)[:height, :width])


def _theirs(built: dict[str, Path], scheduler: str, units: list[ControlUnit], latents: np.ndarray) -> np.ndarray:
    import diffusers
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

    nets = [ControlNetModel.from_pretrained(built[f"{u.model}_torch"]).eval()  # type: ignore[no-untyped-call]
            for u in units]
    pipe = StableDiffusionControlNetPipeline.from_pretrained(  # type: ignore[no-untyped-call]
        built["diffusers"], controlnet=nets if len(nets) > 1 else nets[0], safety_checker=None)
    config = json.loads((built["model"] / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = getattr(diffusers, SCHEDULERS[scheduler]).from_config(config)
    pipe.set_progress_bar_config(disable=True)
    images = [Image.fromarray(u.image) for u in units]
    one = len(units) == 1
    with torch.no_grad():
        out = pipe(PROMPTS, image=images[0] if one else images, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                   guidance_scale=GUIDANCE, latents=torch.from_numpy(latents), output_type="np",
                   controlnet_conditioning_scale=units[0].weight if one else [u.weight for u in units],
                   control_guidance_start=units[0].guidance_start if one else [u.guidance_start for u in units],
                   control_guidance_end=units[0].guidance_end if one else [u.guidance_end for u in units]).images
    return np.asarray((out * 255).round().astype(np.uint8))


def _mine(ours: StableDiffusionOnnx, scheduler: str, units: tuple[ControlUnit, ...],
          latents: np.ndarray) -> np.ndarray:
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  SIZE, SIZE, STEPS, scheduler, control=units)
    return np.asarray(ours(batch, latents=latents).images)


def _latents() -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((4, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])


def _assert_close(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} pixels differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"


def _differs(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 1).mean())


CASES = {
    # one unit; a control image of another size, resized to the output as diffusers' VaeImageProcessor does
    "one": ("euler", [("edges", 1.0, 0.0, 1.0, (40, 56))]),
    # MultiControlNet: residuals summed, each unit's scale and its own active fraction of the steps; PLMS runs
    # one more UNet evaluation than steps (diffusers' timesteps hold it too)
    "two": ("plms", [("edges", 0.8, 0.2, 0.8, (SIZE, SIZE)), ("depth", 1.3, 0.0, 0.5, (SIZE, SIZE))]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_controlnet_matches_diffusers(case: str, ours: StableDiffusionOnnx, built: dict[str, Path]) -> None:
    scheduler, specs = CASES[case]
    units = tuple(ControlUnit(_control_image(k, h, w), name, weight, start, end)
                  for k, (name, weight, start, end, (h, w)) in enumerate(specs))
    latents = _latents()
    mine = _mine(ours, scheduler, units, latents)
    _assert_close(mine, _theirs(built, scheduler, list(units), latents), case)
    # The control has teeth: the same request without it differs far more than the tolerance.
    assert _differs(mine, _mine(ours, scheduler, (), latents)) > 0.3


def test_weight_zero_is_the_image_without_control(ours: StableDiffusionOnnx, built: dict[str, Path]) -> None:
    latents = _latents()
    unit = ControlUnit(_control_image(3, SIZE, SIZE), "edges", 0.0)
    mine = _mine(ours, "euler", (unit,), latents)
    plain = _mine(ours, "euler", (), latents)
    _assert_close(mine, plain, "weight 0")
    _assert_close(mine, _theirs(built, "euler", [unit], latents), "weight 0 vs diffusers")


def test_unit_inactive_over_every_step_runs_the_plain_unet(ours: StableDiffusionOnnx) -> None:
    latents = _latents()
    unit = ControlUnit(_control_image(4, SIZE, SIZE), "edges", 1.0, guidance_start=1.0, guidance_end=1.0)
    assert np.array_equal(_mine(ours, "euler", (unit,), latents), _mine(ours, "euler", (), latents))


def test_unknown_controlnet_is_refused_by_name(ours: StableDiffusionOnnx) -> None:
    unit = ControlUnit(_control_image(0, SIZE, SIZE), "lineart")
    with pytest.raises(InvalidRequestError, match="lineart") as raised:
        _mine(ours, "euler", (unit,), _latents())
    assert raised.value.param == "controlnet.model"


def test_controlled_rows_side_by_side_get_their_solo_images(ours: StableDiffusionOnnx) -> None:
    """Two controlled requests (other images, scales, fractions) and a plain one advance through shared
    ``run_denoiser`` ticks, as step-level batching drives them (the stepper keys them apart by ControlNet set,
    engines/steps.py step_key; the pipeline runs each controlled state's units on its own rows): each image equals
    its solo run."""
    latents = _latents()
    sets = [(ControlUnit(_control_image(6, SIZE, SIZE), "edges", 0.7),),
            (ControlUnit(_control_image(7, SIZE, SIZE), "edges", 1.2, 0.25, 0.75),), ()]
    solo = [_mine(ours, "euler", units, latents) for units in sets]
    runs: list[Begun] = []
    for units in sets:
        batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE)
                            for p, s in zip(PROMPTS, SEEDS, strict=True)), SIZE, SIZE, STEPS, "euler", control=units)
        with ours.runtime.scoped(f"side{len(runs)}"):
            runs.append(ours.begin(batch, latents))
    for _ in range(100):
        running = [run for run in runs if not run.finished]
        if not running:
            break
        ours.run_denoiser([run.state for run in running])
        for run in running:
            ours.advance(run.state)
    for run, alone in zip(runs, solo, strict=True):
        assert np.array_equal(np.asarray(ours.finish(run).images), alone)


def test_a1111_units_drive_the_pipeline(ours: StableDiffusionOnnx, built: dict[str, Path]) -> None:
    """An ``alwayson_scripts.controlnet`` unit as an A1111 client sends it (base64 image, canny module, the model as
    model_list names it) parsed by server/controlnet.py runs its ControlNet; the same unit at weight 0 gives the
    image without control."""
    import base64
    import io

    from server.controlnet import ControlNetLibrary, parse_units

    library = ControlNetLibrary(built["edges"].parent)
    assert [t.split(" [")[0] for t in library.titles()] == ["depth", "edges"]
    buf = io.BytesIO()
    Image.fromarray(_control_image(9, 96, 80)).save(buf, format="PNG")
    unit = {"enabled": True, "image": base64.b64encode(buf.getvalue()).decode(), "module": "canny",
            "model": library.titles()[1], "weight": 1.0, "resize_mode": "Crop and Resize", "pixel_perfect": True}
    latents, plain = _latents(), _mine(ours, "euler", (), _latents())
    for weight, same in ((1.0, False), (0.0, True)):
        parsed = parse_units({"args": [{**unit, "weight": weight}]}, library, SIZE, SIZE, 1 << 20)
        assert parsed[0].unit.image.shape == (SIZE, SIZE, 3) and parsed[0].unit.model == "edges"
        mine = _mine(ours, "euler", tuple(p.unit for p in parsed), latents)
        if same:
            _assert_close(mine, plain, "weight 0")
        else:
            assert _differs(mine, plain) > 0.3


def test_cli_exports_a_controlnet_folder(built: dict[str, Path], tmp_path: Path) -> None:
    """`sdserve engines export --controlnet --from <diffusers ControlNet folder>` gives the same ONNX file as the
    build (deterministic export); `engines tiny --controlnet` is refused on a family other than sd1, before anything
    is built."""
    from server.cli.main import main

    out = tmp_path / "edges"
    assert main(["engines", "export", "--controlnet", "--from", str(built["edges_torch"]), "--out", str(out)]) == 0
    assert (out / "model.onnx").read_bytes() == (built["edges"] / "model.onnx").read_bytes()
    assert json.loads((out / "config.json").read_text())["_class_name"] == "ControlNetModel"
    assert main(["engines", "tiny", "--family", "sd2", "--out", str(tmp_path / "m"),
                 "--controlnet", str(tmp_path / "cn")]) != 0
    assert not (tmp_path / "cn").exists() and not (tmp_path / "m").exists()  # refused before building
