"""SDXL ControlNet on our ORT pipeline vs diffusers' torch StableDiffusionXLControlNetPipeline on the same weights and
initial latents (issue 56): one unit, two units (MultiControlNetModel: residuals summed) with their own scales and
guidance_start/end, the added conditions (pooled text embeddings, time ids) going into the ControlNet as into the
UNet; weight 0 gives the image without control. A ControlNet for another base (SD 1.x on SDXL, SDXL on SD 1.x) is
left out at load and refused by name per request.

The tiny SDXL model and its ControlNet come from `sdserve engines tiny --family sdxl --controlnet DIR` (the CLI).
The ONNX files run on ONNX Runtime's CPU execution provider; the residual and added-condition inputs are bound
through IO binding (onnxruntime/python/onnxruntime_inference_collection.py IOBinding.bind_ortvalue_input)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from engines.build.controlnet import export_controlled_unet, export_controlnet, make_tiny_controlnet
from engines.build.tiny import make_components
from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines import controlnet
from engines.pipelines.contract import Begun, image_rng
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec

PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [31, 32]
SIZE, STEPS, GUIDANCE = 64, 8, 6.0
SCHEDULERS = {"euler": "EulerDiscreteScheduler", "ddim": "DDIMScheduler"}
CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny SDXL model with unet_controlnet/ and its ControlNet (`engines tiny --controlnet`), a second SDXL
    ControlNet (another seed) as ONNX and torch weights, an SD 1.x one as ONNX."""
    from server.cli.main import main

    root = tmp_path_factory.mktemp("controlnet_xl")
    model, weights, edges = root / "model", root / "diffusers", root / "nets" / "edges"
    assert main(["engines", "tiny", "--family", "sdxl", "--out", str(model), "--diffusers-out", str(weights),
                 "--controlnet", str(edges)]) == 0
    paths = {"model": model, "diffusers": weights, "edges": edges, "edges_torch": weights / "controlnet"}
    for name, seed, family in (("depth", 5, "sdxl"), ("sd1net", 0, "sd1")):
        net = make_tiny_controlnet(seed, family)
        paths[name] = export_controlnet(net, root / "nets" / name, {"kind": "tiny", "seed": seed})
        if family == "sdxl":
            net.save_pretrained(root / f"{name}_torch")
            paths[f"{name}_torch"] = root / f"{name}_torch"
    return paths


@pytest.fixture(scope="module")
def reference(built: dict[str, Path]) -> dict[str, object]:
    """The diffusers SDXL components, loaded once (each case adds its ControlNets)."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(built["diffusers"])  # type: ignore[no-untyped-call]
    return dict(pipe.components)


@pytest.fixture(scope="module")
def ours(built: dict[str, Path]) -> StableDiffusionOnnx:
    pipe = StableDiffusionOnnx(built["model"], Runtime(CPU))
    controlnet.attach(pipe, built["model"], {n: built[n] for n in ("edges", "depth", "sd1net")})
    return pipe


def _control_image(seed: int, height: int, width: int) -> np.ndarray:
    """A blocky pattern, as an edge or depth map is: large areas, sharp borders."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(np.repeat(cells, 8, axis=0), 8, axis=1)[:height, :width])


def _theirs(built: dict[str, Path], reference: dict[str, object], scheduler: str, units: list[ControlUnit],
            latents: np.ndarray) -> np.ndarray:
    import diffusers
    from diffusers import ControlNetModel, MultiControlNetModel, StableDiffusionXLControlNetPipeline

    nets = [ControlNetModel.from_pretrained(built[f"{u.model}_torch"]).eval()  # type: ignore[no-untyped-call]
            for u in units]
    components = {k: v for k, v in reference.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = StableDiffusionXLControlNetPipeline(  # type: ignore[no-untyped-call]
        **components, controlnet=MultiControlNetModel(nets) if len(nets) > 1 else nets[0], add_watermarker=False)
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
    # MultiControlNet: residuals summed, each unit's scale and its own active fraction of the steps
    "two": ("ddim", [("edges", 0.8, 0.2, 0.8, (SIZE, SIZE)), ("depth", 1.3, 0.0, 0.5, (SIZE, SIZE))]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdxl_controlnet_matches_diffusers(case: str, ours: StableDiffusionOnnx, built: dict[str, Path],
                                           reference: dict[str, object]) -> None:
    scheduler, specs = CASES[case]
    units = tuple(ControlUnit(_control_image(k, h, w), name, weight, start, end)
                  for k, (name, weight, start, end, (h, w)) in enumerate(specs))
    latents = _latents()
    mine = _mine(ours, scheduler, units, latents)
    _assert_close(mine, _theirs(built, reference, scheduler, list(units), latents), case)
    # The control has teeth: the same request without it differs far more than the tolerance.
    assert _differs(mine, _mine(ours, scheduler, (), latents)) > 0.3


def test_sdxl_weight_zero_is_the_image_without_control(ours: StableDiffusionOnnx) -> None:
    """The residual UNet with the zero residuals of a weight-0 unit gives the plain UNet's image (whose parity with
    StableDiffusionXLPipeline tests/integration/test_families.py holds)."""
    latents = _latents()
    unit = ControlUnit(_control_image(3, SIZE, SIZE), "edges", 0.0)
    _assert_close(_mine(ours, "euler", (unit,), latents), _mine(ours, "euler", (), latents), "weight 0")


def test_sd1_controlnet_on_sdxl_is_refused_by_name(ours: StableDiffusionOnnx) -> None:
    """Left out at load (the SDXL ones attached beside it), refused per request naming the file and its base."""
    assert ours.controls is not None and sorted(ours.controls.nets) == ["depth", "edges"]
    assert "sd1net" in ours.controls.refused
    unit = ControlUnit(_control_image(0, SIZE, SIZE), "sd1net")
    with pytest.raises(InvalidRequestError, match="sd1net is an SD 1.x/2.x ControlNet, this is an SDXL model") as e:
        _mine(ours, "euler", (unit,), _latents())
    assert e.value.param == "controlnet.model"


def test_sdxl_controlnet_on_sd1_is_refused_by_name(built: dict[str, Path], tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "sd1"
    shutil.copytree(tiny_model, model)
    export_controlled_unet(make_components()["unet"], model)
    pipe = StableDiffusionOnnx(model, Runtime(CPU))
    controls = controlnet.attach(pipe, model, {"edges": built["edges"], "sd1net": built["sd1net"]})
    assert sorted(controls.nets) == ["sd1net"] and "edges" in controls.refused
    batch = Batch((ImageSpec(PROMPTS[0], seed=1),), SIZE, SIZE, 2, "euler",
                  control=(ControlUnit(_control_image(0, SIZE, SIZE), "edges"),))
    with pytest.raises(InvalidRequestError, match="edges is an SDXL ControlNet, this is an SD 1.x/2.x model") as e:
        pipe(batch)
    assert e.value.param == "controlnet.model"
    plain = Batch((ImageSpec(PROMPTS[0], seed=1),), SIZE, SIZE, 2, "euler",
                  control=(ControlUnit(_control_image(0, SIZE, SIZE), "sd1net"),))
    assert np.asarray(pipe(plain).images).shape == (1, SIZE, SIZE, 3)  # the file that fits is served


def test_cli_exports_an_sdxl_controlnet_folder(built: dict[str, Path], tmp_path: Path) -> None:
    """`sdserve engines export --controlnet --from <diffusers SDXL ControlNet folder>` gives the same ONNX file as
    the tiny build (deterministic export), with the added-condition inputs."""
    import onnx

    from server.cli.main import main

    out = tmp_path / "edges"
    assert main(["engines", "export", "--controlnet", "--from", str(built["edges_torch"]), "--out", str(out)]) == 0
    assert (out / "model.onnx").read_bytes() == (built["edges"] / "model.onnx").read_bytes()
    inputs = [i.name for i in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.input]
    assert inputs == ["sample", "timestep", "encoder_hidden_states", "controlnet_cond", "text_embeds", "time_ids",
                      "conditioning_scale"]
    assert json.loads((out / "config.json").read_text())["addition_embed_type"] == "text_time"


def test_sdxl_controlled_rows_side_by_side_get_their_solo_images(ours: StableDiffusionOnnx) -> None:
    """Two controlled SDXL requests (other images, scales, fractions, time ids) and a plain one advance through
    shared ``run_denoiser`` ticks, as step-level batching drives them (engines/steps.py step_key keys them apart by
    ControlNet set): each controlled state's units get its own added conditions; each image equals its solo run."""
    latents = _latents()
    sets = [(ControlUnit(_control_image(6, SIZE, SIZE), "edges", 0.7),),
            (ControlUnit(_control_image(7, SIZE, SIZE), "depth", 1.2, 0.25, 0.75),), ()]
    batches = [Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                     SIZE, SIZE, STEPS, "euler", control=units, original_size=(96 + 32 * k, 80))
               for k, units in enumerate(sets)]
    solo = [np.asarray(ours(batch, latents=latents).images) for batch in batches]
    runs: list[Begun] = []
    for batch in batches:
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
