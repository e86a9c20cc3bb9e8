"""The real ORT pipeline on the tiny model (CPU): determinism, batching, models exported by other tools."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from engines.config import RuntimeSettings
from engines.numerics.tokenizer import ClipTokenizer
from engines.pipelines.unet import StableDiffusionOnnx
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec
from server.service import encode_png

CPU = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True)


@pytest.fixture(scope="module")
def pipe(tiny_model: Path) -> StableDiffusionOnnx:
    return StableDiffusionOnnx(tiny_model, Runtime(CPU))


def _batch(*seeds: int, scheduler: str = "euler_a", prompt: str = "a lighthouse at dusk") -> Batch:
    return Batch(tuple(ImageSpec(prompt, "blurry", s, 7.5) for s in seeds), 64, 64, 12, scheduler)


def test_same_request_twice_gives_identical_pngs(pipe: StableDiffusionOnnx) -> None:
    from PIL import Image

    first = pipe(_batch(42)).images
    second = pipe(_batch(42)).images
    assert encode_png(Image.fromarray(first[0])) == encode_png(Image.fromarray(second[0]))


def test_different_seeds_give_different_images(pipe: StableDiffusionOnnx) -> None:
    images = pipe(_batch(1, 2)).images
    assert (np.abs(images[0].astype(int) - images[1].astype(int)) > 2).mean() > 0.5


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "ddim", "dpmpp_2m"])
def test_image_in_a_batch_equals_image_alone(pipe: StableDiffusionOnnx, scheduler: str) -> None:
    together = pipe(_batch(5, 6, 7, scheduler=scheduler)).images
    alone = pipe(_batch(6, scheduler=scheduler)).images
    assert np.abs(together[1].astype(int) - alone[0].astype(int)).max() <= 1


def test_nothing_comes_down_but_the_image(pipe: StableDiffusionOnnx, monkeypatch: pytest.MonkeyPatch) -> None:
    """No device value is read back to the host (OrtValue.numpy copies a CUDA tensor down:
    onnxruntime/python/onnxruntime_pybind_ortvalue.cc): latents are scaled for the VAE on the device and the
    image arrives through the staging buffer bound as the VAE's output."""
    batch = _batch(8, 9, scheduler="euler_a")  # euler_a: step noise goes up every step too
    expected = pipe(batch).images

    def refuse(self: ort.OrtValue) -> np.ndarray:
        raise AssertionError("OrtValue.numpy() called: a device value came down to the host")

    monkeypatch.setattr(ort.OrtValue, "numpy", refuse)
    with pytest.raises(AssertionError, match="came down"):  # the patch is live: the old decode would fail here
        pipe.runtime.buffer("probe", (1,), np.float32).numpy()
    assert np.array_equal(pipe(batch).images, expected)


def test_long_prompt_is_truncated_and_reported(pipe: StableDiffusionOnnx) -> None:
    truncated = pipe(Batch((ImageSpec("tree " * 100, seed=1), ImageSpec("tree", seed=1)), 64, 64, 2)).truncated
    assert truncated == (True, False)


def test_check_inputs_refuses_instead_of_clamping(pipe: StableDiffusionOnnx) -> None:
    from engines.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="multiple of 16") as info:
        pipe(Batch((ImageSpec("a"),), 72, 64, 2))
    assert info.value.param == "size"


def _retype_input(model: onnx.ModelProto, name: str, elem: int, shape: list[int | str], nodes: list[onnx.NodeProto],
                  new_name: str) -> None:
    """Make input ``name`` arrive as ``elem``/``shape``; ``nodes`` convert it to ``new_name`` for the graph."""
    for node in model.graph.node:
        for i, inp in enumerate(node.input):
            if inp == name:
                node.input[i] = new_name
    graph_input = next(i for i in model.graph.input if i.name == name)
    graph_input.CopyFrom(helper.make_tensor_value_info(name, elem, shape))
    for node in reversed(nodes):
        model.graph.node.insert(0, node)


def _rename_output(model: onnx.ModelProto, old: str, new: str) -> None:
    for node in model.graph.node:
        for i, out in enumerate(node.output):
            if out == old:
                node.output[i] = new
    next(o for o in model.graph.output if o.name == old).name = new


@pytest.fixture(scope="module")
def optimum_style(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with the IO conventions other exporters use: int32 input_ids, a rank-0 int64 timestep,
    other output names, and no tokenizer.json (vocab.json + merges.txt only)."""
    out = tmp_path_factory.mktemp("optimum") / "model"
    shutil.copytree(tiny_model, out)
    (out / "tokenizer" / "tokenizer.json").unlink()
    text = onnx.load(out / "text_encoder" / "model.onnx")
    _retype_input(text, "input_ids", TensorProto.INT32, ["batch", 77],
                  [helper.make_node("Cast", ["input_ids"], ["input_ids_i64"], to=TensorProto.INT64)],
                  "input_ids_i64")
    _rename_output(text, "last_hidden_state", "hidden_states_out")
    onnx.save(text, out / "text_encoder" / "model.onnx")
    unet = onnx.load(out / "unet" / "model.onnx")
    axes = helper.make_tensor("axes0", TensorProto.INT64, [1], [0])
    unet.graph.initializer.append(axes)
    _retype_input(unet, "timestep", TensorProto.INT64, [],
                  [helper.make_node("Cast", ["timestep"], ["timestep_f"], to=TensorProto.FLOAT),
                   helper.make_node("Unsqueeze", ["timestep_f", "axes0"], ["timestep_1d"])], "timestep_1d")
    _rename_output(unet, "out_sample", "noise_pred")
    onnx.save(unet, out / "unet" / "model.onnx")
    return out


def test_models_from_other_exporters_load_and_match(pipe: StableDiffusionOnnx, optimum_style: Path) -> None:
    other = StableDiffusionOnnx(optimum_style, Runtime(CPU))
    assert other.text_encoder.input_dtype("input_ids") is np.int32
    assert other.io.timestep_shape == () and other.io.out == "noise_pred"
    batch = _batch(3, scheduler="ddim")  # integer timesteps: an int64 timestep input loses nothing
    ours = pipe(batch).images
    theirs = other(batch).images
    assert np.array_equal(ours, theirs)


def test_export_of_a_diffusers_folder_equals_the_tiny_build(tiny_build: tuple[Path, Path], tmp_path: Path) -> None:
    import json

    from engines.build.export import export_folder

    onnx_dir, diffusers_dir = tiny_build
    out = export_folder(diffusers_dir, tmp_path / "exported")
    exported = json.loads((out / "manifest.json").read_text())["files"]
    built = json.loads((onnx_dir / "manifest.json").read_text())["files"]
    for name in ("text_encoder/model.onnx", "unet/model.onnx", "vae_decoder/model.onnx"):
        assert exported[name] == built[name], name
    # transformers saved the tokenizer its own way; it must still tokenize exactly as ours.
    prompt = ["a photo of an astronaut riding a horse, 4k, (detailed)"]
    theirs, ours = ClipTokenizer(out / "tokenizer")(prompt), ClipTokenizer(onnx_dir / "tokenizer")(prompt)
    assert np.array_equal(theirs.ids, ours.ids)
