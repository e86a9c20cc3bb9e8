"""FLUX.1 ControlNet on our ORT flow pipeline vs diffusers' torch FluxControlNetPipeline on the same tiny weights and
initial latents (issue 56): one unit, two units (FluxMultiControlNetModel: block samples summed), the union kind, one
without single blocks (the transformer's single blocks then get no residual),
guidance_start/end and the conditioning scale; weight 0 gives the image without control.

diffusers samples the control image's VAE posterior with the request's generator; sdserve takes its mean, so the
reference is asked for the mean too (``retrieve_latents(..., sample_mode="argmax")``). The ONNX files run on ONNX
Runtime's CPU execution provider; the residual inputs, several bound to one device value, go through IO binding
(onnxruntime/python/onnxruntime_inference_collection.py IOBinding.bind_ortvalue_input)."""

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
from engines.config import RuntimeSettings
from engines.errors import InvalidRequestError
from engines.pipelines import controlnet_dit
from engines.pipelines.contract import image_rng
from engines.pipelines.flow import load_pipeline, pack_latents
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ControlUnit, ImageSpec

PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [31, 32]
SIZE, STEPS, GUIDANCE, T5_LENGTH = 64, 4, 3.5, 64

Builder = Callable[[str], tuple[Path, Path]]


@pytest.fixture(scope="module")
def built(dit_build: Builder, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A copy of the tiny FLUX.1 dev model with transformer_controlnet/, two tiny ControlNets and a union one (ONNX and
    torch weights)."""
    from diffusers import FluxTransformer2DModel

    onnx_dir, diffusers_dir = dit_build("flux")
    root = tmp_path_factory.mktemp("flux_controlnet")
    model = root / "model"
    shutil.copytree(onnx_dir, model)
    transformer = FluxTransformer2DModel.from_pretrained(diffusers_dir / "transformer")  # type: ignore[no-untyped-call]
    export_controlled_flux(transformer.eval(), model)
    paths = {"model": model, "diffusers": diffusers_dir}
    for name, seed, union, singles in (("edges", 0, False, 1), ("depth", 5, False, 1), ("union", 2, True, 1),
                                       ("doubles", 6, False, 0)):
        net = make_tiny_flux_controlnet(seed, union=union, single_layers=singles)
        export_flux_controlnet(net, root / "nets" / name, {"kind": "tiny", "seed": seed})
        net.save_pretrained(root / f"{name}_torch")
        paths[name], paths[f"{name}_torch"] = root / "nets" / name, root / f"{name}_torch"
    return paths


@pytest.fixture(scope="module")
def ours(built: dict[str, Path]) -> Any:
    pipe = load_pipeline(built["model"], Runtime(RuntimeSettings(providers=("CPUExecutionProvider",),
                                                                  allow_cpu=True)))
    controlnet_dit.attach(pipe, built["model"], {n: built[n] for n in ("edges", "depth", "union", "doubles")})
    return pipe


def _control_image(seed: int, height: int, width: int) -> np.ndarray:
    """A blocky pattern, as an edge or depth map is: large areas, sharp borders."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return np.ascontiguousarray(np.repeat(np.repeat(cells, 8, axis=0), 8, axis=1)[:height, :width])


def _noise() -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for s in SEEDS])


def _theirs(built: dict[str, Path], units: list[ControlUnit], monkeypatch: pytest.MonkeyPatch,
            mode: int | None = None) -> np.ndarray:
    from diffusers import FluxControlNetModel, FluxControlNetPipeline
    from diffusers.pipelines.flux import pipeline_flux_controlnet as module

    given = module.retrieve_latents
    monkeypatch.setattr(module, "retrieve_latents",
                        lambda out, generator=None, sample_mode="sample": given(out, generator, "argmax"))
    nets = [FluxControlNetModel.from_pretrained(built[f"{u.model}_torch"]).eval()  # type: ignore[no-untyped-call]
            for u in units]
    pipe = FluxControlNetPipeline.from_pretrained(  # type: ignore[no-untyped-call]
        built["diffusers"], controlnet=nets if len(nets) > 1 else nets[0])
    pipe.set_progress_bar_config(disable=True)
    images = [Image.fromarray(u.image) for u in units]
    one = len(units) == 1
    with torch.no_grad():
        out = pipe(PROMPTS, control_image=images[0] if one else images, height=SIZE, width=SIZE,
                   num_inference_steps=STEPS, guidance_scale=GUIDANCE, max_sequence_length=T5_LENGTH,
                   latents=torch.from_numpy(pack_latents(_noise())), output_type="np", control_mode=mode,
                   controlnet_conditioning_scale=units[0].weight if one else [u.weight for u in units],
                   control_guidance_start=units[0].guidance_start if one else [u.guidance_start for u in units],
                   control_guidance_end=units[0].guidance_end if one else [u.guidance_end for u in units]).images
    return np.asarray((out * 255).round().astype(np.uint8))


def _mine(ours: Any, units: tuple[ControlUnit, ...]) -> np.ndarray:
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                  SIZE, SIZE, STEPS, control=units)
    return np.asarray(ours(batch, latents=_noise(), max_sequence_length=T5_LENGTH).images)


def _assert_close(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape == (2, SIZE, SIZE, 3)
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} values differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"


def _differs(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 1).mean())


CASES = {
    # one unit; a control image of another size, resized to the output as diffusers' VaeImageProcessor does
    "one": [("edges", 1.0, 0.0, 1.0, (40, 56))],
    # start/end: active over the middle half of the steps only
    "window": [("edges", 1.3, 0.25, 0.75, (SIZE, SIZE))],
    # FluxMultiControlNetModel: samples summed, each unit its scale and its own active fraction of the steps
    "two": [("edges", 0.8, 0.0, 0.8, (SIZE, SIZE)), ("depth", 1.2, 0.25, 1.0, (SIZE, SIZE))],
    # double blocks only, alone and after one with single blocks (diffusers then keeps the first unit's single
    # samples; sdserve sums zeros in: the same. In the other order diffusers drops the second unit's single samples,
    # sdserve does not: engines/pipelines/controlnet_dit.py)
    "doubles": [("doubles", 1.0, 0.0, 1.0, (SIZE, SIZE))],
    "edges+doubles": [("edges", 0.6, 0.0, 1.0, (SIZE, SIZE)), ("doubles", 0.9, 0.0, 1.0, (SIZE, SIZE))],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_flux_controlnet_matches_diffusers(case: str, ours: Any, built: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    units = tuple(ControlUnit(_control_image(k, h, w), name, weight, start, end)
                  for k, (name, weight, start, end, (h, w)) in enumerate(CASES[case]))
    mine = _mine(ours, units)
    _assert_close(mine, _theirs(built, list(units), monkeypatch), case)
    # The control has teeth: the same request without it differs far more than the tolerance.
    assert _differs(mine, _mine(ours, ())) > 0.1


@pytest.mark.parametrize("mode", [None, 2])
def test_union_controlnet_matches_diffusers(ours: Any, built: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                            mode: int | None) -> None:
    """The union kind: its mode embedding leads the text tokens (mode 0, canny, where the unit names none; 2, depth,
    as server/controlnet.py ``union_mode`` gives a ``depth_midas`` unit), diffusers' ``control_mode``."""
    units = (ControlUnit(_control_image(8, SIZE, SIZE), "union", 1.0, union_mode=mode),)
    mine = _mine(ours, units)
    _assert_close(mine, _theirs(built, list(units), monkeypatch, mode=controlnet_dit.union_mode(units[0])), "union")
    assert _differs(mine, _mine(ours, ())) > 0.1
    if mode is not None:
        canny = (ControlUnit(units[0].image, "union", 1.0),)
        assert not np.array_equal(mine, _mine(ours, canny)), "the control type is an input of the union ControlNet"


def test_weight_zero_is_the_image_without_control(ours: Any, built: dict[str, Path]) -> None:
    unit = ControlUnit(_control_image(3, SIZE, SIZE), "edges", 0.0)
    assert np.array_equal(_mine(ours, (unit,)), _mine(ours, ()))


def test_unit_inactive_over_every_step_runs_the_plain_transformer(ours: Any) -> None:
    unit = ControlUnit(_control_image(4, SIZE, SIZE), "edges", 1.0, guidance_start=1.0, guidance_end=1.0)
    assert np.array_equal(_mine(ours, (unit,)), _mine(ours, ()))


def test_unknown_or_foreign_controlnet_is_refused_by_name(ours: Any, built: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="lineart") as raised:
        _mine(ours, (ControlUnit(_control_image(0, SIZE, SIZE), "lineart"),))
    assert raised.value.param == "controlnet.model"
    foreign = tmp_path / "sd15"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"_class_name": "ControlNetModel"}')
    (foreign / "model.onnx").write_bytes(b"")
    controls = controlnet_dit.FluxControlNets(ours, built["model"], {"sd15": foreign})
    assert "sd15" in controls.refused and not controls.nets


def test_controlled_rows_side_by_side_get_their_solo_images(ours: Any) -> None:
    """Two controlled requests (other ControlNets, scales, fractions) and a plain one advance through shared
    ``run_denoiser`` ticks, as step-level batching drives them (each controlled state runs its own ControlNet and
    residual-transformer calls; the plain one and any controlled state with no unit active at its step join the
    plain call): each image equals its solo run."""
    sets = [(ControlUnit(_control_image(6, SIZE, SIZE), "edges", 0.7),),
            (ControlUnit(_control_image(7, SIZE, SIZE), "union", 1.2, 0.25, 0.75),), ()]
    solo = [_mine(ours, units) for units in sets]
    runs = []
    for k, units in enumerate(sets):
        batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE)
                            for p, s in zip(PROMPTS, SEEDS, strict=True)), SIZE, SIZE, STEPS, control=units)
        with ours.runtime.scoped(f"side{k}"):
            runs.append(ours.begin(batch, _noise(), max_sequence_length=T5_LENGTH))
    for _ in range(4 * STEPS):
        running = [run for run in runs if not run.finished]
        if not running:
            break
        ours.run_denoiser([run.state for run in running])
        for run in running:
            ours.advance(run.state)
    assert all(run.finished for run in runs)
    for run, alone in zip(runs, solo, strict=True):
        assert np.array_equal(np.asarray(ours.finish(run).images), alone)


def test_tiny_build_for_a_flux_folder(dit_build: Builder, tmp_path: Path) -> None:
    """``build_tiny_controlnet`` on a tiny FLUX.1 folder (what `sdserve engines tiny --family flux --controlnet DIR`
    runs): the family read from model_index.json, the ControlNet and the transformer's residual variant written; the
    variant carries the folder's transformer weights (weight 0 gives the plain image), the ControlNet steers."""
    from engines.build.controlnet import build_tiny_controlnet, tiny_family

    model = tmp_path / "model"
    shutil.copytree(dit_build("flux")[0], model)
    assert tiny_family(model) == "flux"
    build_tiny_controlnet(tmp_path / "nets" / "canny", model)
    assert (model / "transformer_controlnet" / "model.onnx").is_file()
    pipe = load_pipeline(model, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    controls = controlnet_dit.attach(pipe, model, {"canny": tmp_path / "nets" / "canny"})
    assert sorted(controls.nets) == ["canny"] and not controls.refused
    image = _control_image(11, SIZE, SIZE)
    plain = _mine(pipe, ())
    assert np.array_equal(_mine(pipe, (ControlUnit(image, "canny", 0.0),)), plain)
    assert _differs(_mine(pipe, (ControlUnit(image, "canny", 1.0),)), plain) > 0.1


def test_cli_exports_a_flux_controlnet_folder(built: dict[str, Path], tmp_path: Path) -> None:
    """`sdserve engines export --controlnet --from <diffusers FluxControlNetModel folder>` gives the same ONNX file as
    the build (deterministic export), the union kind too."""
    import json

    from server.cli.main import main

    for name in ("edges", "union"):
        out = tmp_path / name
        assert main(["engines", "export", "--controlnet", "--from", str(built[f"{name}_torch"]), "--out",
                     str(out)]) == 0
        assert (out / "model.onnx").read_bytes() == (built[name] / "model.onnx").read_bytes()
        assert json.loads((out / "config.json").read_text())["_class_name"] == "FluxControlNetModel"


def test_img2img_with_a_unit_matches_diffusers(ours: Any, built: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """img2img with a unit vs FluxControlNetImg2ImgPipeline: the init image's posterior sampled with our streams'
    draws (start noise first, then the encoder's sample noise, as test_dit_parity.py feeds diffusers), the control
    image's taken at its mean."""
    import dataclasses

    import diffusers.models.autoencoders.vae as vae
    from diffusers import FluxControlNetImg2ImgPipeline, FluxControlNetModel
    from diffusers.pipelines.flux import pipeline_flux_controlnet_image_to_image as module

    from engines.types.request import EditImage

    strength = 0.7
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    init = np.asarray((np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x + 4 * y)], axis=-1) * 255).round().astype(np.uint8))
    unit = ControlUnit(_control_image(12, SIZE, SIZE), "edges", 1.1, 0.0, 0.9)
    batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=GUIDANCE, edit=EditImage(init))
                        for p, s in zip(PROMPTS, SEEDS, strict=True)), SIZE, SIZE, STEPS, strength=strength,
                  control=(unit,))
    mine = np.asarray(ours(batch, max_sequence_length=T5_LENGTH).images)
    rngs = [image_rng(s) for s in SEEDS]
    noise, eps = (np.stack([r.standard_normal((16, SIZE // 8, SIZE // 8), dtype=np.float32) for r in rngs])
                  for _ in range(2))

    def answer(array: np.ndarray) -> Any:
        def randn(shape, generator=None, device=None, dtype=None, layout=None):  # type: ignore[no-untyped-def]
            assert tuple(shape) == array.shape
            return torch.from_numpy(array.copy()).to(dtype=dtype)
        return randn

    monkeypatch.setattr(vae, "randn_tensor", answer(eps))
    monkeypatch.setattr(module, "randn_tensor", answer(noise))
    given, calls = module.retrieve_latents, list[int]()

    def retrieve(out: Any, generator: Any = None, sample_mode: str = "sample") -> Any:
        calls.append(len(calls))  # the control image is encoded first: its mean; then the init images: sampled
        return given(out, generator, "argmax" if len(calls) == 1 else sample_mode)

    monkeypatch.setattr(module, "retrieve_latents", retrieve)
    net = FluxControlNetModel.from_pretrained(built["edges_torch"]).eval()  # type: ignore[no-untyped-call]
    pipe = FluxControlNetImg2ImgPipeline.from_pretrained(built["diffusers"], controlnet=net)  # type: ignore[no-untyped-call]
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = pipe(PROMPTS, image=[Image.fromarray(init)] * 2, control_image=Image.fromarray(unit.image),
                      height=SIZE, width=SIZE, strength=strength, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                      max_sequence_length=T5_LENGTH, output_type="np", controlnet_conditioning_scale=unit.weight,
                      control_guidance_start=unit.guidance_start, control_guidance_end=unit.guidance_end).images
    assert len(calls) == 2
    _assert_close(mine, np.asarray((theirs * 255).round().astype(np.uint8)), "img2img")
    plain = dataclasses.replace(batch, control=())
    assert _differs(mine, np.asarray(ours(plain, max_sequence_length=T5_LENGTH).images)) > 0.1


def test_residual_transformer_maps_fewer_samples_to_its_blocks(tmp_path: Path) -> None:
    """A transformer deeper than its ControlNet (2 double and 3 single blocks; 1 and 2 samples, as FLUX.1 dev's 19/38
    take InstantX's 5/10): the residual variant fed per block by ``block_sources`` equals diffusers'
    FluxTransformer2DModel given the samples themselves (its interval rule)."""
    import onnxruntime as ort
    from diffusers import FluxTransformer2DModel

    from engines.build.dit import FLUX as TINY
    from engines.pipelines.flux import flux_rope, image_ids

    FLUX: dict[str, Any] = TINY
    torch.manual_seed(3)
    transformer: Any = FluxTransformer2DModel(**{**FLUX, "num_layers": 2, "num_single_layers": 3})  # type: ignore[no-untyped-call]
    transformer.eval()
    export_controlled_flux(transformer, tmp_path)
    assert controlnet_dit.block_sources(19, 5) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 + [4] * 3
    rng = np.random.default_rng(0)
    rows, text, grid = 2, 5, 4
    tokens, inner = grid * grid, int(FLUX["num_attention_heads"]) * int(FLUX["attention_head_dim"])
    feeds = {"hidden_states": rng.standard_normal((rows, tokens, 64), np.float32),
             "encoder_hidden_states": rng.standard_normal((rows, text, int(FLUX["joint_attention_dim"])), np.float32),
             "pooled_projections": rng.standard_normal((rows, int(FLUX["pooled_projection_dim"])), np.float32),
             "timestep": np.array([0.7, 0.3], np.float32)}
    ids = np.concatenate([np.zeros((text, 3), np.float32), image_ids(grid, grid)])
    feeds["rope_cos"], feeds["rope_sin"] = flux_rope(ids, FLUX["axes_dims_rope"])
    doubles = [rng.standard_normal((rows, tokens, inner), np.float32)]
    singles = [rng.standard_normal((rows, tokens, inner), np.float32) for _ in range(2)]
    for k, j in enumerate(controlnet_dit.block_sources(2, 1)):
        feeds[f"block_residual_{k}"] = doubles[j]
    for k, j in enumerate(controlnet_dit.block_sources(3, 2)):
        feeds[f"single_residual_{k}"] = singles[j]
    session = ort.InferenceSession(str(tmp_path / "transformer_controlnet" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    mine = session.run(None, feeds)[0]
    inputs = {name: torch.from_numpy(feeds[name]) for name in ("hidden_states", "encoder_hidden_states",
                                                               "pooled_projections", "timestep")}
    positions = {"img_ids": torch.from_numpy(image_ids(grid, grid)), "txt_ids": torch.zeros(text, 3)}
    with torch.no_grad():
        theirs = transformer(**inputs, **positions, controlnet_block_samples=[torch.from_numpy(d) for d in doubles],
                             controlnet_single_block_samples=[torch.from_numpy(s) for s in singles],
                             return_dict=False)[0].numpy()
        plain = transformer(**inputs, **positions, return_dict=False)[0].numpy()
    assert np.abs(mine - theirs).max() < 1e-4
    assert np.abs(mine - plain).max() > 1e-2  # the residuals reached the blocks


def test_what_a_controlled_request_is_refused(ours: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by name, never run without its control: a step cache (its reused outputs would skip the units), and a
    model that serves no ControlNet."""
    from engines.types.request import CACHE_MIN_STEPS, StepCache

    unit = ControlUnit(_control_image(1, SIZE, SIZE), "edges")
    cached = Batch((ImageSpec(PROMPTS[0], seed=SEEDS[0], guidance_scale=GUIDANCE),), SIZE, SIZE, CACHE_MIN_STEPS,
                   control=(unit,), cache=StepCache())
    with pytest.raises(InvalidRequestError, match="step cache") as raised:
        ours(cached, max_sequence_length=T5_LENGTH)
    assert raised.value.param == "cache"
    monkeypatch.setattr(ours, "controls", None)
    with pytest.raises(InvalidRequestError, match="serves no ControlNet") as raised:
        _mine(ours, (unit,))
    assert raised.value.param == "controlnet"


def test_fp16_exports_keep_parity_with_fp32(ours: Any, built: dict[str, Path], tmp_path: Path) -> None:
    """The ControlNet and the residual transformer exported at ``--dtype fp16`` (networks cast, fp32 inputs and
    outputs, the rope tables fp32 inside as diffusers keeps them) serve the same unit as the fp32 exports do, within
    half precision's drift (tolerance as tests/integration/test_dit_half.py measures the plain transformer's)."""
    from diffusers import FluxControlNetModel, FluxTransformer2DModel

    model = tmp_path / "model"
    shutil.copytree(built["model"], model)
    transformer = FluxTransformer2DModel.from_pretrained(built["diffusers"] / "transformer")  # type: ignore[no-untyped-call]
    export_controlled_flux(transformer.eval(), model, "fp16")
    net = FluxControlNetModel.from_pretrained(built["edges_torch"]).eval()  # type: ignore[no-untyped-call]
    export_flux_controlnet(net, tmp_path / "edges", {"kind": "tiny"}, "fp16")
    import onnx

    for path in (model / "transformer_controlnet" / "model.onnx", tmp_path / "edges" / "model.onnx"):
        graph = onnx.load(str(path)).graph  # weights in half, inputs and outputs fp32
        kinds = {init.data_type for init in graph.initializer}
        assert onnx.TensorProto.FLOAT16 in kinds, path
        assert {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]} <= {
            onnx.TensorProto.FLOAT, onnx.TensorProto.INT64}, path
    pipe = load_pipeline(model, Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)))
    controlnet_dit.attach(pipe, model, {"edges": tmp_path / "edges"})
    unit = (ControlUnit(_control_image(13, SIZE, SIZE), "edges", 1.0),)
    half, full = _mine(pipe, unit), _mine(ours, unit)
    diff = np.abs(half.astype(np.int16) - full.astype(np.int16))
    print(f"\nfp16 ControlNet: max |diff| {diff.max()}/255, mean {diff.mean():.4f}")
    assert diff.max() <= 2 and diff.mean() <= 0.1
    assert _differs(half, _mine(pipe, ())) > 0.1
