"""Half-precision DiT exports (`sdserve engines export --dtype fp16|bf16`) of a tiny Flux, made by the real CLI from
its diffusers folder, served by the real pipeline on the CPU and compared with the fp32 export of the same weights.

Tolerances, on the uint8 images of one batch (2 prompts, 64x64, 4 steps, dev guidance 3.5), measured here first and
set with margin:

- fp16: max |diff| <= 2/255 and mean <= 0.1/255. Measured 1/255, mean 0.013; diffusers' own fp16 pipeline against
  its fp32 one on the same weights and noise: 1/255, mean 0.067 (its VAE in fp16 too). A broken conversion fails it:
  a T5 whose feed-forward outputs pass 65504 (its ``wo`` weights x1e5, as T5-XXL's activations do) exported without
  transformers' fp32 keep gives 5/255, mean 0.56; with the keep, 1/255, mean 0.013.
- bf16 (T5 and transformer bf16, CLIP fp16, VAE fp32): ONNX Runtime's CPU provider has no bf16 kernels (the load
  is refused, by name), so the bf16 graphs run here with every bf16 op emulated: fp32 math, each result rounded to
  bf16, which is how the CUDA kernels store it. max <= 16/255 and mean <= 2/255. Measured 9/255, mean 0.96;
  diffusers' own bf16 pipeline against its fp32 one (its VAE in bf16 too): 8/255, mean 1.11. bf16 keeps 8 mantissa
  bits to fp16's 11: the drift is the format's, not the export's.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.pipelines.flow import load_pipeline
from engines.runtime.sessions import Runtime
from engines.types.request import Batch, ImageSpec
from server.cli.main import main
from server.exitcodes import ExitCode, exit_code_for

pytestmark = pytest.mark.slow
Builder = Callable[[str], tuple[Path, Path]]
BATCH = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=3.5) for p, s in (
    ("a photo of an astronaut riding a horse", 11), ("a red cube on a table, studio lighting", 12))),
    width=64, height=64, steps=4)
T5_LENGTH = 64
FP16_MAX, FP16_MEAN = 2, 0.1
BF16_MAX, BF16_MEAN = 16, 2.0
STRESS = 1e5
"""Scale on the tiny T5's ``wo`` weights: their outputs reach about 3.2e5, past fp16's 65504."""
NETWORKS = ("text_encoder", "text_encoder_2", "transformer", "vae_decoder", "vae_encoder")
CLAMP = 65504.0


def _cpu() -> Runtime:
    return Runtime(RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))


def _export(src: Path, out: Path, dtype: str) -> Path:
    assert main(["engines", "export", "--from", str(src), "--out", str(out), "--dtype", dtype]) == 0
    return out


def _images(folder: Path) -> np.ndarray:
    return load_pipeline(folder, _cpu())(BATCH, max_sequence_length=T5_LENGTH).images


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[int, float]:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return int(d.max()), float(d.mean())


@pytest.fixture(scope="module")
def flux(dit_build: Builder) -> tuple[Path, Path]:
    """(fp32 ONNX folder, diffusers folder) of the tiny Flux dev."""
    return dit_build("flux")


@pytest.fixture(scope="module")
def half(flux: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("half")
    return {dtype: _export(flux[1], root / dtype, dtype) for dtype in ("fp16", "bf16")}


@pytest.fixture(scope="module")
def fp32_images(flux: tuple[Path, Path]) -> np.ndarray:
    return _images(flux[0])


def _weights(path: Path) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in onnx.load(str(path)).graph.initializer}


def _matrices(path: Path) -> dict[str, int]:
    """Element type of every weight matrix (2-D and up: what the bytes are), by the node that consumes it."""
    model = onnx.load(str(path))
    inits = {t.name: t for t in model.graph.initializer if len(t.dims) >= 2}
    return {f"{n.name}:{name}": inits[name].data_type for n in model.graph.node for name in n.input if name in inits}


def _weight_bytes(path: Path) -> int:
    return sum(len(t.raw_data) for t in _weights(path).values())


def test_fp16_export_keeps_parity_with_fp32(half: dict[str, Path], fp32_images: np.ndarray) -> None:
    ours = _images(half["fp16"])
    worst, mean = _diff(ours, fp32_images)
    print(f"\nfp16 vs fp32 export: max |diff| {worst}/255, mean {mean:.4f}/255")
    assert worst <= FP16_MAX and mean <= FP16_MEAN, (worst, mean)
    assert mean > 0  # the half graphs computed in half: not the fp32 graphs again
    assert fp32_images.std() > 10 and not np.array_equal(ours[0], ours[1])


def test_half_exports_hold_the_dtypes_they_claim(flux: tuple[Path, Path], half: dict[str, Path]) -> None:
    fp16, bf16, fp32 = half["fp16"], half["bf16"], flux[0]
    claims = {fp16: {"text_encoder": TensorProto.FLOAT16, "transformer": TensorProto.FLOAT16,
                     "vae_decoder": TensorProto.FLOAT, "vae_encoder": TensorProto.FLOAT},  # force_upcast VAE
              bf16: {"text_encoder": TensorProto.FLOAT16, "text_encoder_2": TensorProto.BFLOAT16,
                     "transformer": TensorProto.BFLOAT16, "vae_decoder": TensorProto.FLOAT,
                     "vae_encoder": TensorProto.FLOAT}}  # no bf16 VAE: PRECISION
    for folder, expected in claims.items():
        for network, elem in expected.items():
            found = set(_matrices(folder / network / "model.onnx").values())
            assert found == {elem}, (folder.name, network, found)
    t5 = _matrices(fp16 / "text_encoder_2" / "model.onnx")  # transformers' _keep_in_fp32_modules = ["wo"]
    kept = sorted(node for node, elem in t5.items() if elem == TensorProto.FLOAT)
    assert kept and all("/wo/" in node for node in kept) and len(kept) == 2  # the tiny T5's two blocks
    assert {elem for node, elem in t5.items() if "/wo/" not in node} == {TensorProto.FLOAT16}
    for folder in (fp16, bf16):  # the graphs' edges stay fp32 (ids int64): the pipeline's types are unchanged
        for network in NETWORKS:
            model = onnx.load(str(folder / network / "model.onnx"), load_external_data=False)
            edges = {v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
            assert edges <= {TensorProto.FLOAT, TensorProto.INT64}, (folder.name, network, edges)
    for network in ("text_encoder", "text_encoder_2", "transformer"):  # weights at about half the bytes
        before = _weight_bytes(fp32 / network / "model.onnx")
        for folder in (fp16, bf16):
            ratio = _weight_bytes(folder / network / "model.onnx") / before
            print(f"\n{folder.name} {network}: weights {ratio:.3f} of fp32")
            assert ratio < (0.6 if (folder, network) == (fp16, "text_encoder_2") else 0.51), (folder.name, network)


def _clamps(path: Path) -> list[str]:
    """Clip nodes bounded at fp16's ±65504 (diffusers' fp16 clamps in Flux's blocks)."""
    model = onnx.load(str(path))
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node
              if n.op_type == "Constant"}
    return [n.name for n in model.graph.node if n.op_type == "Clip"
            and [float(consts[i]) for i in n.input[1:] if i in consts] == [-CLAMP, CLAMP]]


def test_flux_fp16_clamps_are_in_the_graph_and_recorded(flux: tuple[Path, Path], half: dict[str, Path]) -> None:
    """One clamp per joint block (the text stream) and per single block, as diffusers' transformer_flux.py applies
    at fp16; none at bf16 or fp32. The manifest records each network's dtype and T5's fp32 keeps."""
    clamps = _clamps(half["fp16"] / "transformer" / "model.onnx")
    assert sorted(name.split("/")[-2] for name in clamps) == ["single_transformer_blocks.0", "transformer_blocks.0"]
    assert not _clamps(half["bf16"] / "transformer" / "model.onnx")
    assert not _clamps(flux[0] / "transformer" / "model.onnx")
    source = json.loads((half["fp16"] / "manifest.json").read_text())["source"]
    assert source["precision"] == {"text_encoder": "fp16", "text_encoder_2": "fp16", "transformer": "fp16",
                                   "vae": "fp32"}
    assert [k.split(".")[-2] for k in source["fp32_keeps"]["text_encoder_2"]] == ["wo", "wo"]


def _stressed(diffusers_dir: Path, out: Path) -> Path:
    """The diffusers folder with its T5's ``wo`` weights scaled by STRESS."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(diffusers_dir, out)
    path = out / "text_encoder_2" / "model.safetensors"
    weights = {k: v * np.float32(STRESS) if ".wo." in k else v for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    return out


def test_fp16_t5_needs_its_fp32_keep(flux: tuple[Path, Path], tmp_path: Path) -> None:
    """With feed-forward outputs past 65504, the fp16 export keeps parity only with transformers' fp32 ``wo``: the
    same export with the keep dropped fails the fp16 tolerance."""
    import engines.build.dit_export as dit_export

    src = _stressed(flux[1], tmp_path / "stressed")
    reference = _images(_export(src, tmp_path / "fp32", "fp32"))
    kept = _diff(_images(_export(src, tmp_path / "fp16", "fp16")), reference)
    with mock.patch.object(dit_export, "fp32_keeps", return_value=[]):
        dropped = _diff(_images(_export(src, tmp_path / "nokeep", "fp16")), reference)
    print(f"\nstressed T5, fp16 vs fp32: with the wo keep {kept}, without {dropped} (max, mean /255)")
    assert kept[0] <= FP16_MAX and kept[1] <= FP16_MEAN, kept
    assert dropped[0] > FP16_MAX and dropped[1] > FP16_MEAN, dropped


def _emulate_bf16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every op touching bf16 run in fp32 with its bf16 inputs cast up and its bf16 outputs rounded back to bf16:
    what a bf16 kernel stores (fp32 accumulation, a bf16 result), with the CPU's fp32 kernels. Cast and Constant
    nodes stay (ONNX Runtime's CPU provider casts bf16)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]}
    types |= {t.name: t.data_type for t in model.graph.initializer}
    types |= {n.output[0]: n.attribute[0].t.data_type for n in model.graph.node if n.op_type == "Constant"}
    bf16, nodes = TensorProto.BFLOAT16, []
    for node in model.graph.node:
        if node.op_type in ("Cast", "Constant") or bf16 not in [types.get(x) for x in [*node.input, *node.output]]:
            nodes.append(node)
            continue
        up: dict[str, str] = {}
        for i, name in enumerate(node.input):
            if types.get(name) == bf16:
                if name not in up:
                    up[name] = f"{name}/fp32@{node.name}"
                    nodes.append(helper.make_node("Cast", [name], [up[name]], to=TensorProto.FLOAT,
                                                  name=f"{node.name}/up{i}"))
                node.input[i] = up[name]
        down = []
        for i, name in enumerate(node.output):
            if types.get(name) == bf16:
                node.output[i] = f"{name}/fp32"
                down.append(helper.make_node("Cast", [node.output[i]], [name], to=bf16, name=f"{node.name}/down{i}"))
        nodes += [node, *down]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]
    return model


def test_bf16_export_is_refused_on_the_cpu_by_name(half: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"text_encoder_2: .*computes in bfloat16.*CUDA or TensorRT") as caught:
        load_pipeline(half["bf16"], _cpu())
    assert exit_code_for(caught.value) == ExitCode.MODEL_INVALID


def test_bf16_export_emulated_keeps_parity_with_fp32(half: dict[str, Path], fp32_images: np.ndarray,
                                                     tmp_path: Path) -> None:
    folder = shutil.copytree(half["bf16"], tmp_path / "bf16-emulated")
    for network in ("text_encoder_2", "transformer"):
        path = folder / network / "model.onnx"
        onnx.save(_emulate_bf16(onnx.load(str(path))), str(path))
    ours = _images(folder)
    worst, mean = _diff(ours, fp32_images)
    print(f"\nbf16 (emulated) vs fp32 export: max |diff| {worst}/255, mean {mean:.4f}/255")
    assert worst <= BF16_MAX and mean <= BF16_MEAN, (worst, mean)
    assert mean > 0.1  # bf16 rounding took place: the emulation is no fp32 run


def _bf16_edges(model: onnx.ModelProto, names: tuple[str, ...]) -> onnx.ModelProto:
    """The graph with the named inputs and outputs made bf16 (a Cast at each edge), as other exporters write."""
    graph = model.graph
    for value in [v for v in graph.input if v.name in names]:
        for node in graph.node:
            node.input[:] = [f"{x}/edge" if x == value.name else x for x in node.input]
        graph.node.insert(0, helper.make_node("Cast", [value.name], [f"{value.name}/edge"], to=TensorProto.FLOAT))
        value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    for value in [v for v in graph.output if v.name in names]:
        for node in graph.node:
            node.output[:] = [f"{x}/edge" if x == value.name else x for x in node.output]
        graph.node.append(helper.make_node("Cast", [f"{value.name}/edge"], [value.name], to=TensorProto.BFLOAT16))
        value.type.tensor_type.elem_type = TensorProto.BFLOAT16
    return model


def test_bf16_io_graph_is_refused_by_name(flux: tuple[Path, Path], half: dict[str, Path], tmp_path: Path) -> None:
    """Through real ONNX Runtime: a graph with bf16 inputs/outputs is refused at load (exit 11) naming the component,
    the input and tensor(bfloat16), whether the session builds (fp32 inside: the check after creation) or not
    (bf16 inside, no CPU kernels: read from the file); the fp32-edged bf16 export is what serves."""
    folder = shutil.copytree(flux[0], tmp_path / "bf16-io")
    path = folder / "transformer" / "model.onnx"
    onnx.save(_bf16_edges(onnx.load(str(path)), ("hidden_states", "out_hidden_states")), str(path))
    with pytest.raises(ModelLoadError, match=r"transformer: input 'hidden_states' is tensor\(bfloat16\)") as caught:
        load_pipeline(folder, _cpu())
    assert exit_code_for(caught.value) == ExitCode.MODEL_INVALID
    inside = tmp_path / "bf16-inside.onnx"
    model = onnx.load(str(half["bf16"] / "transformer" / "model.onnx"))
    onnx.save(_bf16_edges(model, ("out_hidden_states",)), str(inside))
    with pytest.raises(ModelLoadError, match=r"denoiser: output 'out_hidden_states' is tensor\(bfloat16\)"):
        _cpu().session(inside, "denoiser")
